"""What every model family's stage shares: the output type, the stage base class, the family adapter.

A stage mirrors the module tree of the unpartitioned HF model for the parts it holds (``transformer.h.3``,
``deberta.encoder.layer.5``, ``lm_head``, ...), so its own ``state_dict()`` names are the HF names and
``hf_state_dict()`` needs no renaming. Blocks sit in an ``nn.ModuleDict`` keyed by their global index.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from ..seeding import reseed


@dataclass
class StageOutput:
    """What the last stage returns: the loss (0-d; None only when the batch carries no labels) and the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class PipelineStage(nn.Module):
    """One contiguous slice of an HF model: optional embeddings, blocks ``block_indices``, optional head + loss.

    ``forward(hidden, batch, seed=None)``: the first stage takes ``hidden=None`` and reads ``batch["input_ids"]``
    (and ``attention_mask``, ``token_type_ids`` when present); later stages take the boundary activation
    ``(B, T, hidden_size)``. Every stage rebuilds its masks / positions from ``batch``. The last stage returns a
    :class:`StageOutput`, the others the next boundary activation. With ``seed`` (the engine's, per step and
    micro-batch) each part's dropout draws from ``reseed(seed, part)``: part ``"embed"`` before the embeddings'
    dropout, the block's global index before each block, ``"head"`` before the head's.
    """

    def __init__(self, config: Any, stage_index: int, num_stages: int, block_indices: list[int],
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.block_indices = list(block_indices)
        self.activation_checkpointing = activation_checkpointing
        self.hidden_size = int(config.hidden_size)
        # local parameter name -> HF name of the parameter it copies (the first name in model.named_parameters())
        self._origin: dict[str, str] = {}
        # tie key -> local parameter name, for parameters of which other stages hold copies (set by partition())
        self._tie_keys: dict[str, str] = {}

    def forward(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor],
                seed: int | None = None) -> torch.Tensor | StageOutput:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"stage {self.stage_index}/{self.num_stages}, blocks {self.block_indices}"

    # ------------------------------------------------------------------ ties and HF names
    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """Tie key (HF name of the shared weight) -> this stage's copy, for weights other stages also hold.

        ``tie_groups`` lists the stages holding each; PipelineEngine keeps the copies in step (pipeline/ties.py).
        A weight shared only inside this stage is not listed.
        """
        return {key: self.get_parameter(local) for key, local in self._tie_keys.items()}

    def tied_lookups(self) -> dict[str, tuple[str, ...]]:
        """Tie key -> the batch fields whose values are the rows this stage reads of that weight, for the tied
        weights it uses only as a lookup table (an embedding). Such a copy needs just those rows each step."""
        return {}

    def hf_parameter_names(self) -> dict[str, str]:
        """Local parameter name -> HF parameter name of the original it was copied from (tied copies included)."""
        return dict(self._origin)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and persistent buffers under their names in the unpartitioned HF model."""
        return {k: v for k, v in self.state_dict().items()}

    # ------------------------------------------------------------------ helpers for subclasses
    def _checkpointing(self) -> bool:
        return self.activation_checkpointing and self.training and torch.is_grad_enabled()

    def _call_block(self, index: int, seed: int | None, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Call block `index`, its dropout seeded for it, through non-reentrant activation checkpointing when enabled
        and training (the checkpoint keeps the seeded generator state for the recomputation)."""
        reseed(seed, index)
        if self._checkpointing():
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, **kwargs)
        return block(*args, **kwargs)

    def _finish(self, model: nn.Module, memo: dict[int, Any]) -> None:
        """Record, for every parameter of this stage, which HF parameter it copies; drop copied gradients."""
        copies = {id(c): c for c in memo.values() if isinstance(c, nn.Parameter)}
        origin_of = {}
        for name, p in model.named_parameters():  # deduplicated: a tied weight appears once, by its first name
            c = memo.get(id(p))
            if c is not None and id(c) in copies:
                origin_of[id(c)] = name
        for local, p in self.named_parameters():
            if id(p) not in origin_of:
                raise RuntimeError(f"stage {self.stage_index}: parameter {local!r} was not copied from the model")
            self._origin[local] = origin_of[id(p)]
            p.grad = None
        self.train(model.training)


def container(**children: nn.Module | None) -> nn.Module:
    """A bare module used only as a namespace, so that stage parameter names mirror the HF module tree."""
    m = nn.Module()
    for name, child in children.items():
        if child is not None:
            m.add_module(name, child)
    return m


def deep_copier(model: nn.Module) -> tuple[dict[int, Any], Callable[[Any], Any]]:
    """A deepcopy function with one memo per stage: ties inside a stage are kept, ties across stages cut.

    The model's config is copied once per stage and shared by every module of that stage.
    """
    memo: dict[int, Any] = {}
    memo[id(model.config)] = copy.deepcopy(model.config)

    def dc(obj: Any) -> Any:
        return copy.deepcopy(obj, memo)

    return memo, dc


def numel(*modules: nn.Module | None) -> int:
    """Parameter count of the given modules (None skipped; a parameter shared between them counted once)."""
    seen: dict[int, int] = {}
    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


class FamilyAdapter:
    """How to cut one model family: its blocks, its stage-0 and last-stage extras, and its stage builder."""

    supported: tuple[type, ...] = ()

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def first_extra_numel(self, model: nn.Module) -> int:
        """Parameters only the first stage holds besides its blocks (embeddings, ...)."""
        raise NotImplementedError

    def last_extra_numel(self, model: nn.Module) -> int:
        """Parameters only the last stage holds besides its blocks (final norm, head, pooler, ...)."""
        raise NotImplementedError

    def check(self, model: nn.Module) -> None:
        """Raise ValueError for configurations this adapter cannot split exactly."""

    def build(self, model: nn.Module, stage_index: int, num_stages: int, block_indices: list[int],
              activation_checkpointing: bool) -> PipelineStage:
        raise NotImplementedError
