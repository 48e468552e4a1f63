"""The independent reference every pipeline shape is held to: the unpartitioned HF model in a plain PyTorch loop.

Nothing of the engine runs here: `model(**batch).loss / M` backwarded per micro-batch, the global norm
clipped with `torch.nn.utils.clip_grad_norm_`, the optimizer and LR scheduler stepped, as a user's own loop
would. Dropout stays on: before each part of the model (`DROPOUT_PARTS`) its generator is seeded as a pipeline
stage seeds it (`pipeline.seeding`), so masks are the same on any stage count.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from aqpipe.pipeline.seeding import derive_seed, reseed

# where each family's dropout draws, by part: the module a stage seeds the part before (the embeddings' dropout,
# block i, the head), named in the unpartitioned model
DROPOUT_PARTS: dict[str, Callable[[int], dict[Any, str]]] = {
    "gpt2": lambda n: {"embed": "transformer.drop", **{i: f"transformer.h.{i}" for i in range(n)}},
    "deberta": lambda n: {"embed": "deberta.embeddings", **{i: f"deberta.encoder.layer.{i}" for i in range(n)},
                          "head": "pooler"},
    "bert": lambda n: {"embed": "bert.embeddings", **{i: f"bert.encoder.layer.{i}" for i in range(n)},
                       "head": "bert.pooler"},
    "roberta": lambda n: {"embed": "roberta.embeddings", **{i: f"roberta.encoder.layer.{i}" for i in range(n)},
                          "head": "classifier"},
    "decoder": lambda n: {i: f"model.layers.{i}" for i in range(n)},  # the Llama lineage: dropout inside blocks
}


@contextlib.contextmanager
def seeded_like_a_stage(model: torch.nn.Module, family: str, num_blocks: int) -> Iterator[Callable[[int], None]]:
    """Hooks that seed each part's dropout; yields `use(seed)`, which sets the micro-batch's seed."""
    current: dict[str, int | None] = {"seed": None}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, part=part: reseed(current["seed"], part))
        for part, name in DROPOUT_PARTS[family](num_blocks).items()]
    try:
        yield lambda seed: current.__setitem__("seed", seed)
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """As the spawned stages compute: one thread (the same kernels, so the same float results)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_reference(model: torch.nn.Module, steps: list[list[dict[str, torch.Tensor]]], *, family: str,
                    num_blocks: int, optimizer: torch.optim.Optimizer, clip: float, scheduler: Any = None,
                    seed: int = 0) -> dict[str, Any]:
    """Train `model` on `steps` (each a list of micro-batches); per step the loss (a causal LM's per target token
    over the step, as HF's Trainer computes it with `num_items_in_batch`; else the mean micro-batch loss) and the
    global gradient norm before clipping, and the final weights."""
    losses, norms = [], []
    model.train()
    with one_thread(), seeded_like_a_stage(model, family, num_blocks) as use:
        for step, micro_batches in enumerate(steps):
            optimizer.zero_grad(set_to_none=True)
            causal = micro_batches[0]["labels"].dim() == 2
            weights = [int((mb["labels"][:, 1:] != -100).sum()) if causal else 1 for mb in micro_batches]
            total = 0.0
            for k, mb in enumerate(micro_batches):
                use(derive_seed(seed, 0, step, k))  # replica 0, step, micro-batch: as the engine derives it
                loss = model(**{key: v for key, v in mb.items() if key != "sample_id"}).loss
                total += float(loss.detach()) * weights[k]
                (loss * weights[k] / sum(weights)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(total / sum(weights))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": losses, "grad_norm": norms, "weights": weights}


def random_batches(steps: int, micro: int, size: int, seq: int, vocab: int, *, classes: int | None = None,
                   pad_id: int | None = None) -> list[list[dict[str, torch.Tensor]]]:
    """`steps` steps of `micro` seeded micro-batches of `size` x `seq` random ids (from 3 up), with labels the ids
    (causal LM) or random classes (`classes`), distinct sample ids; with `pad_id`, the second row's last 3 tokens
    are padding (masked, and -100 as causal labels)."""
    g = torch.Generator().manual_seed(5)
    out: list[list[dict[str, torch.Tensor]]] = []
    for _ in range(steps):
        mbs = []
        for k in range(micro):
            ids = torch.randint(3, vocab, (size, seq), generator=g)
            mask = torch.ones_like(ids)
            if pad_id is not None:
                mask[1, seq - 3:] = 0
                ids[mask == 0] = pad_id
            labels = ids.masked_fill(mask == 0, -100) if classes is None else \
                torch.randint(0, classes, (size,), generator=g)
            mbs.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                        "sample_id": torch.arange(size) + size * (k + micro * len(out))})
        out.append(mbs)
    return out
