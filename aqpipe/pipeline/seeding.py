"""Seeds derived from names, so that what a random draw gives does not depend on where it runs.

Dropout inside a stage draws from the global torch generator. Seeding it before each part of the model
(the embeddings, block i, the head) from (run seed, replica, step, micro-batch, part) gives every part the
same masks on any stage count and schedule: a pipeline with dropout on computes what the unpartitioned
model computes with the same seeds, and a resumed run draws what the uninterrupted one drew. A compiled stage
(`--compile`) seeds once a micro-batch, by its stage index, before its one graph: its compiled kernels draw masks of
their own, which a resumed compiled run draws again but no eager run or other stage count does.
"""
from __future__ import annotations

import torch

from aqpipe.compression.seeds import derive_seed

__all__ = ["derive_seed", "reseed"]


def reseed(seed: int | None, part: object) -> None:
    """Seed the global generators (CPU and every GPU) for `part` of a forward whose seed is `seed`; nothing when
    `seed` is None (evaluation, or a stage called outside the engine)."""
    if seed is not None:
        seed_generators(derive_seed(seed, part))


def seed_generators(value: int) -> None:
    """What `torch.manual_seed(value)` does to the generators a stage draws from (the CPU's, each started CUDA
    device's), without its cost: it also queues the seed, with a captured traceback, for each accelerator kind not
    started (XPU, MTIA; CUDA too in a CPU run), 50-90 us a call, and a stage calls this once a block a micro-batch."""
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_initialized():
        for generator in torch.cuda.default_generators:
            generator.manual_seed(value)
