"""Split a HuggingFace model into pipeline stages, and merge the stages' weights back into one HF model.

    stages = partition(model, num_stages=3)            # contiguous blocks, balanced by parameter count
    hidden = None
    for stage in stages:                               # in one process; the engine runs one stage per rank
        hidden = stage(hidden, batch)
    hidden.loss.backward()                             # the last stage returns StageOutput(loss, logits)
    # ties: tie_groups(stages) names the weights several stages hold (PipelineEngine keeps them in step)
    merge_into(fresh_model, [s.hf_state_dict() for s in stages]).save_pretrained(out_dir)

A rank that should hold only its own stage builds it from the model's config instead (aqpipe/pipeline/loading.py).
Supported: `supported_classes()` (GPT2, DeBERTa, BERT, RoBERTa, and the Llama lineage: Llama, Qwen2, Qwen3, Mistral,
Gemma 3 text, Phi-3, their causal LM and sequence classification heads).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from .stages import Family, PipelineStage, StageOutput, family_for, supported_classes
from .stages.base import present
from .ties import Tie
from aqpipe.compression.fields import check_int, is_int

METHODS = ("parameters", "uniform", "auto")


def model_family(model: PreTrainedModel) -> Family:
    return family_for(type(model).__name__, model.config)


def numel(*modules: nn.Module | None) -> int:
    """Parameter count of the given modules (None skipped; a parameter shared between them counted once)."""
    seen = {id(p): p.numel() for m in modules if m is not None for p in m.parameters()}
    return sum(seen.values())


def stage_block_counts(model: PreTrainedModel, num_stages: int,
                       method: str | Sequence[int] = "parameters") -> list[int]:
    """Blocks per stage (each >= 1, summing to the model's block count) for ``method``.

    - ``"uniform"``: counts differ by at most one; the first ``L % S`` stages get the extra block.
    - ``"parameters"``: contiguous split minimising the largest stage's parameter count, where stage 0 also counts
      its embeddings (and DeBERTa-v2's conv layer), the last stage its final norm / head / pooler (a tied LM head
      counts in full: the last stage holds its own copy); weights every stage holds alike (DeBERTa's relative
      embeddings) do not change the choice and are left out. Among the splits with that smallest maximum, the one
      with the smallest sum of squared stage sizes is taken (the most even); remaining ties give later stages
      more blocks.
    - a list of ints: taken as is, after checking it.

    The model may be on the meta device: only its shapes are read.
    """
    family = model_family(model)
    blocks = model.get_submodule(family.blocks)
    n = len(blocks)
    check_int("num_stages", num_stages, 1)
    if num_stages > n:
        raise ValueError(
            f"num_stages={num_stages} is more than the {n} blocks of {type(model).__name__}: every stage holds "
            f"at least one block"
        )
    if isinstance(method, str):
        if method == "uniform":
            base, extra = divmod(n, num_stages)
            return [base + (1 if s < extra else 0) for s in range(num_stages)]
        if method in ("parameters", "auto"):  # auto: a planner's blocks, where one planned (aqpipe/plan); else these
            sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
            first = numel(*(present(model, p) for p in family.first))
            last = numel(*(present(model, p) for p in family.last))
            return balance_by_size(sizes, num_stages, first, last)
        raise ValueError(f"unknown partition method {method!r}: expected one of {METHODS} or a list of block counts")
    if not isinstance(method, (list, tuple)) or not all(is_int(c) for c in method):
        raise ValueError(f"partition method must be one of {METHODS} or a list of ints, got {method!r}")
    counts = list(method)
    if len(counts) != num_stages:
        raise ValueError(f"block counts {counts} name {len(counts)} stages, but num_stages={num_stages}")
    if any(c < 1 for c in counts):
        raise ValueError(f"block counts {counts}: every stage needs at least 1 block")
    if sum(counts) != n:
        raise ValueError(f"block counts {counts} sum to {sum(counts)}, but {type(model).__name__} has {n} blocks")
    return counts


def block_ranges(counts: Sequence[int]) -> list[list[int]]:
    """Each stage's global block indices, from the counts."""
    bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(len(counts))]


def tied_names(model: PreTrainedModel, family: Family, counts: Sequence[int]) -> frozenset[str]:
    """The weights (HF names, a tied one by its first name) that more than one stage of this split holds."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    blocks = model.get_submodule(family.blocks)
    holders: dict[str, int] = {}
    for s, indices in enumerate(block_ranges(counts)):
        parts = [present(model, path) for path in family.paths(s, len(counts)) if path != family.blocks] + \
            [blocks[i] for i in indices]
        for name in {name_of[id(p)] for part in parts if part is not None for p in part.parameters()}:
            holders[name] = holders.get(name, 0) + 1
    return frozenset(name for name, count in holders.items() if count > 1)


def balance_by_size(sizes: Sequence[int], num_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Contiguous split of ``sizes`` into ``num_stages`` non-empty parts minimising the largest part (extras added
    to the first / last part), then the sum of squared parts. Exact dynamic programme, O(S * L^2)."""
    n, S = len(sizes), num_stages
    if not 1 <= S <= n:
        raise ValueError(f"cannot split {n} blocks into {S} non-empty stages")
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + int(x))

    def cost(s: int, i: int, j: int) -> int:  # stage s holds blocks [i, j)
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0) + (last_extra if s == S - 1 else 0)

    inf = float("inf")
    # best[s][j]: smallest possible maximum over stages 0..s-1 holding blocks [0, j)
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0
    for s in range(1, S + 1):
        for j in range(s, n - (S - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(s - 1, i, j)) for i in range(s - 1, j))
    bound = best[S][n]
    # second pass: among splits whose every stage is <= bound, the smallest sum of squares
    sq = [[inf] * (n + 1) for _ in range(S + 1)]
    back = [[-1] * (n + 1) for _ in range(S + 1)]
    sq[0][0] = 0
    for s in range(1, S + 1):
        for j in range(s, n - (S - s) + 1):
            for i in range(s - 1, j):  # strict '<' keeps the smallest i: ties give the later stage more blocks
                c = cost(s - 1, i, j)
                if c > bound or sq[s - 1][i] == inf:
                    continue
                v = sq[s - 1][i] + c * c
                if v < sq[s][j]:
                    sq[s][j], back[s][j] = v, i
    counts, j = [], n
    for s in range(S, 0, -1):
        i = back[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def partition(model: PreTrainedModel, num_stages: int, method: str | list[int] = "parameters",
              activation_checkpointing: bool = False, copy_modules: bool = True) -> list[PipelineStage]:
    """Split ``model`` into ``num_stages`` independent stage modules.

    Stage ``s`` holds a contiguous run of transformer blocks (``stage_block_counts``); stage 0 also the embeddings,
    the last stage the final norm, head and loss. Weights several stages need (a tied LM head, DeBERTa's relative
    embeddings) are held by each of them; ``tied_parameters()`` / ``tie_groups`` name them. ``copy_modules``: each
    stage deep-copies its parts (so the stages can train apart), or takes the modules themselves (a model on the meta
    device, of which each rank materializes one stage: loading.py). ``activation_checkpointing`` wraps each block
    call in non-reentrant ``torch.utils.checkpoint`` while training.
    """
    family = model_family(model)
    counts = stage_block_counts(model, num_stages, method)
    tied = tied_names(model, family, counts)
    return [family.stage(model, family, s, num_stages, indices, tied=tied, copy_modules=copy_modules,
                         activation_checkpointing=activation_checkpointing)
            for s, indices in enumerate(block_ranges(counts))]


def tie_groups(stages: Sequence[PipelineStage]) -> dict[str, Tie]:
    """Tie key -> the stages holding a copy (two or more) and the ones that only look rows up in it."""
    holders: dict[str, list[int]] = {}
    lookups: dict[str, dict[int, tuple[str, ...]]] = {}
    for stage in sorted(stages, key=lambda st: st.stage_index):
        for key in stage.tied_parameters():
            holders.setdefault(key, []).append(stage.stage_index)
        for key, fields in stage.tied_lookups().items():
            lookups.setdefault(key, {})[stage.stage_index] = fields
    return {key: Tie(tuple(h), lookups.get(key, {})) for key, h in holders.items()}


def merge_into(model: PreTrainedModel, state_dicts: Sequence[dict[str, torch.Tensor]]) -> PreTrainedModel:
    """Load all stages' ``hf_state_dict()`` into ``model`` (an HF model of the same class and config) and return it.

    Strict: every key of ``model.state_dict()`` must be covered (a key tied inside ``model``, e.g. ``lm_head.weight``
    to ``transformer.wte.weight``, is covered by either name); every copy of one weight, whether the same key from
    several stages or tied keys, must be equal; unknown keys and shape mismatches are errors. Nothing is loaded
    unless all checks pass.
    """
    expected = model.state_dict()
    # keys that name the same tensor inside the model (tied weights)
    by_tensor: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if name in expected:
            by_tensor.setdefault(id(t), []).append(name)

    merged: dict[str, torch.Tensor] = {}
    source: dict[str, int] = {}
    for idx, sd in enumerate(state_dicts):
        for key, value in sd.items():
            if key not in expected:
                raise ValueError(f"stage {idx} has key {key!r}, which {type(model).__name__} does not have")
            if tuple(value.shape) != tuple(expected[key].shape):
                raise ValueError(
                    f"stage {idx}: {key!r} has shape {tuple(value.shape)}, "
                    f"the model expects {tuple(expected[key].shape)}"
                )
            if key in merged:
                if not torch.equal(merged[key].cpu(), value.detach().cpu()):
                    raise ValueError(
                        f"copies of {key!r} in stages {source[key]} and {idx} differ: tied weights diverged"
                    )
                continue
            merged[key], source[key] = value.detach(), idx
    for names in by_tensor.values():
        present = [n for n in names if n in merged]
        for other in present[1:]:
            if not torch.equal(merged[present[0]].cpu(), merged[other].cpu()):
                raise ValueError(f"tied weights {present[0]!r} (stage {source[present[0]]}) and {other!r} "
                                 f"(stage {source[other]}) differ")
        if present:
            for n in names:
                merged.setdefault(n, merged[present[0]])
    missing = [k for k in expected if k not in merged]
    if missing:
        groups = list(dict.fromkeys(".".join(k.split(".")[:3]) for k in missing))
        raise ValueError(
            f"no stage provides {len(missing)} weights of {type(model).__name__} (under {', '.join(groups)}; "
            f"first: {missing[0]!r}): pass the hf_state_dict() of every stage"
        )
    nn.Module.load_state_dict(model, merged, strict=True)
    return model


__all__ = [
    "METHODS", "PipelineStage", "StageOutput", "balance_by_size", "block_ranges", "merge_into", "model_family",
    "partition", "stage_block_counts", "supported_classes", "tie_groups", "tied_names",
]
