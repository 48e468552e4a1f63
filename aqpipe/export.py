"""The fine-tuned model, merged back from its stages into one HF model that `from_pretrained` loads."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from pipeline import PipelineEngine
from pipeline.partitioning import merge_into

from . import checkpoint
from .config import RunConfig
from .world import World, barrier


def save_merged_model(model_factory: Callable[[], Any], engine: PipelineEngine, tokenizer: Any, cfg: RunConfig,
                      world: World, groups: Any) -> str | None:
    """Merge every stage's weights (replica 0) into one HF model on rank 0 and save_pretrained it.

    Each stage writes its part into the output directory (shared by every rank, as checkpoints need) and
    rank 0 reads them after a barrier: the weights never cross the pipeline's links, where a slow one would
    take minutes (GPT2's 51 MB tied head at 5 Mbit/s: 85 s, past the collective timeout). A tied weight
    comes from its owner's copy."""
    out = Path(cfg.output_dir)
    parts = out / "model.parts"
    if groups.replica == 0:
        parts.mkdir(parents=True, exist_ok=True)
        checkpoint.write_state(parts / f"stage{groups.stage}.pt",
                               {k: v.detach().cpu() for k, v in engine.hf_state_dict().items()})
    barrier(world)
    if world.rank != 0:
        return None
    pieces = [checkpoint.read_state(parts / f"stage{s}.pt") for s in range(groups.grid.stages)]
    target, tmp = out / "model", out / "model.partial"
    model = merge_into(model_factory(), pieces)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for writing one small file is noise after the run's own bar
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)  # never leave a half-written model where a loader looks
    shutil.rmtree(parts)
    return str(target)
