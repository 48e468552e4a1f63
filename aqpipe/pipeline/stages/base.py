"""What every model family's stage shares: where a family keeps its parts, the stage base class, its output.

A stage mirrors the module tree of the unpartitioned HF model for the parts it holds (``transformer.h.3``,
``model.layers.5``, ``lm_head``, ...), so its own ``state_dict()`` names are the HF names: a checkpoint's tensors
load by name and an export needs no renaming. Blocks sit in an ``nn.ModuleDict`` keyed by their global index.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.utils.checkpoint
from torch import nn

from ..adapters import has_adapters, merged_state_dict
from ..seeding import reseed
from .lm_loss import fused_ready


@dataclass
class StageOutput:
    """What the last stage returns: the loss (0-d; None only when the batch carries no labels) and the logits; a
    causal LM's also its token statistics (lm_loss.token_stats: targets predicted, entropy sum), on the device."""

    loss: torch.Tensor | None
    logits: torch.Tensor
    token_stats: torch.Tensor | None = None


@dataclass(frozen=True)
class Family:
    """Where one HF model class keeps its parts, as module paths in the unpartitioned model: what a stage is cut by.

    `first` only stage 0 holds (the embeddings), `last` only the last stage (final norm, head), `every` every stage
    (parameter-free helpers such as the rotary embedding, or weights every block reads); `blocks` is the block list,
    split contiguously. A path the model lacks (an optional part) is skipped. `lookups`: a weight (HF name) that a
    stage without the head reads only at some rows, and the batch fields that are those rows (a token embedding).
    """

    def in_head(self, name: str) -> bool:
        """Whether the weight `name` (HF name) belongs to the task's head."""
        return any(name.startswith(path + ".") for path in self.head)

    stage: type["PipelineStage"]
    first: tuple[str, ...]
    blocks: str
    last: tuple[str, ...]
    head: tuple[str, ...]  # of `last`, the task's head: what a checkpoint of another task (a base model) may lack
    every: tuple[str, ...] = ()
    lookups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)  # what the family's stage reads besides the config

    def paths(self, stage_index: int, num_stages: int) -> list[str]:
        """The parts stage `stage_index` of `num_stages` holds, in the model's order (`blocks` for its blocks)."""
        return [*(self.first if stage_index == 0 else ()), self.blocks, *self.every,
                *(self.last if stage_index == num_stages - 1 else ())]


def present(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at `path`, or None where this configuration has no such part."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def mount(root: nn.Module, path: str, module: nn.Module) -> None:
    """Place `module` at `path` under `root`, with bare modules as the namespaces on the way."""
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(name, module)


class PipelineStage(nn.Module):
    """One contiguous slice of an HF model: stage 0 its embeddings, every stage blocks `block_indices`, the last
    stage the final norm, head and loss (where a `Family` says they live).

    ``forward(hidden, batch, seed=None)``: the first stage takes ``hidden=None`` and reads ``batch["input_ids"]``
    (and ``attention_mask``, ``token_type_ids`` when present); later stages take the boundary activation
    ``(B, T, hidden_size)``. Every stage rebuilds its masks / positions from ``batch``. The last stage returns a
    :class:`StageOutput`, the others the next boundary activation. With ``seed`` (the engine's, per step and
    micro-batch) each part's dropout draws from ``reseed(seed, part)``: part ``"embed"`` before the embeddings'
    dropout, the block's global index before each block, ``"head"`` before the head's. A compiled stage
    (:meth:`compile`) seeds once per call instead, by its stage index.

    Built from a model whose parts it takes: copies (``copy=True``, several stages from one model in memory) or the
    modules themselves (a model on the meta device that only this stage will use). ``tied``: the HF names of the
    weights other stages hold copies of too.
    """

    def __init__(self, model: nn.Module, family: Family, stage_index: int, num_stages: int, block_indices: list[int],
                 *, tied: frozenset[str] = frozenset(), copy_modules: bool = True,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        memo: dict[int, Any] = {}
        take: Callable[[Any], Any] = (lambda m: copy.deepcopy(m, memo)) if copy_modules else (lambda m: m)
        self.config = take(model.config)  # one copy per stage, shared by its modules
        self.family = family
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.block_indices = list(block_indices)
        self.activation_checkpointing = activation_checkpointing
        self.fused_loss: str | None = None  # a causal LM head's loss kernel in training (lm_loss.FUSED)
        self._compiled: Callable[..., Any] | None = None  # _forward under torch.compile (compile())
        self.hidden_size = int(self.config.hidden_size)
        blocks = model.get_submodule(family.blocks)
        for path in family.paths(stage_index, num_stages):  # the embeddings, the blocks, the rest: the model's order
            if path == family.blocks:
                mount(self, path, nn.ModuleDict({str(i): take(blocks[i]) for i in block_indices}))
            elif (part := present(model, path)) is not None:
                mount(self, path, take(part))
        # local parameter name -> HF name of the weight it holds (a tied weight by its first name)
        named = model.named_parameters()  # deduplicated: a weight tied inside the model once, by its first name
        source = {id(memo[id(p)]): name for name, p in named if id(p) in memo} if copy_modules else \
            {id(p): name for name, p in named}
        self._origin = {local: source[id(p)] for local, p in self.named_parameters()}
        self._tie_keys = {name: local for local, name in self._origin.items() if name in tied}
        self.train(model.training)

    @staticmethod
    def check(config: Any) -> str | None:
        """What in `config` this family cannot split exactly (None: nothing), said before anything is built."""
        return None

    def extra_repr(self) -> str:
        return f"stage {self.stage_index}/{self.num_stages}, blocks {self.block_indices}"

    def use_fused_loss(self, fused: str | None) -> None:
        """Train the causal-LM loss by `fused` (lm_loss.FUSED: None, the chunked loss; "liger"), checked here once,
        alike on every stage: what it needs is installed, and a last stage's head is one it can fuse."""
        fused_ready(fused, getattr(self, "lm_head", None) if self.is_last else None)
        self.fused_loss = fused

    @property
    def whole_backward(self) -> bool:
        """Whether zb1 must run this stage's backward whole, not split into its input and weight parts: checkpointed
        blocks would be recomputed per weight node, and Liger's fused loss scales the gradients it saved in place by
        its incoming gradient, so a second pass over its node would scale the head's gradient twice."""
        return self.activation_checkpointing or (self.is_last and self.fused_loss is not None)

    def blocks(self) -> Iterator[tuple[int, nn.Module]]:
        held = self.get_submodule(self.family.blocks)
        return ((i, held[str(i)]) for i in self.block_indices)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile the stage's forward whole, in place (`torch.compile`'s arguments): embeddings, blocks, head
        and loss in one graph, as a compiled plain loop compiles its model.

        A part's dropout seed is a hash taken on the host, which a graph cannot hold, and a graph break inside the
        loop over the blocks sends the whole forward back to eager. So a compiled stage seeds the generators once a
        call, before its graph, from (run seed, replica, step, micro-batch) and its stage index: a resumed compiled
        run draws what the uninterrupted one drew, and no two stages draw alike. The masks are the compiled
        kernels' own, so they differ from an eager run's and from another stage count's. A copy (deepcopy, pickle)
        is an eager stage, as a copy of a module compiled by `nn.Module.compile` is."""
        self._compiled = torch.compile(self._forward, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_compiled"] = None  # bound to this stage's own forward: a copy would run the original's weights
        return state

    # ------------------------------------------------------------------ the forward, written once
    def forward(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor],
                seed: int | None = None) -> torch.Tensor | StageOutput:
        """The stage's slice of the model's forward (class docstring); a family fills in three hooks: `embed`, the
        arguments its blocks take (`block_arguments`), and its `head` with the loss."""
        if self._compiled is None:
            return self._forward(hidden, batch, seed)
        reseed(seed, f"compiled stage {self.stage_index}")
        return self._compiled(hidden, batch, None)

    def _forward(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor],
                 seed: int | None) -> torch.Tensor | StageOutput:
        if self.is_first:
            if hidden is not None:
                raise ValueError("the first stage takes hidden=None and reads batch['input_ids']")
            hidden = self.embed(batch, seed)
        elif hidden is None:
            raise ValueError(f"stage {self.stage_index} needs the boundary activation, got None")
        arguments = self.block_arguments(hidden, batch)
        for i, block in self.blocks():
            hidden = self.run_block(i, seed, block, hidden, arguments)
        return self.head(hidden, batch, seed) if self.is_last else hidden

    def embed(self, batch: dict[str, torch.Tensor], seed: int | None) -> torch.Tensor:
        """Stage 0: the embeddings of `batch` (their dropout drawn from ``reseed(seed, "embed")``)."""
        raise NotImplementedError

    def block_arguments(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> Any:
        """What the blocks take besides the hidden state (masks, positions), rebuilt from `batch` on every stage:
        block index -> (positional arguments, keyword arguments), for `run_block`."""
        raise NotImplementedError

    def run_block(self, index: int, seed: int | None, block: nn.Module, hidden: torch.Tensor, arguments: Any
                  ) -> torch.Tensor:
        """Block `index` on `hidden` with its `arguments` (a family whose blocks return more overrides this)."""
        args, kwargs = arguments[index]
        return self._call_block(index, seed, block, hidden, *args, **kwargs)

    def head(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], seed: int | None) -> StageOutput:
        """The last stage: final norm, head and loss (their dropout drawn from ``reseed(seed, "head")``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ ties and HF names
    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """Tie key (HF name of the shared weight) -> this stage's copy, for weights other stages also hold.

        ``tie_groups`` lists the stages holding each; PipelineEngine keeps the copies in step (aqpipe/pipeline/ties.py).
        A weight shared only inside this stage is not listed.
        """
        return {key: self.get_parameter(local) for key, local in self._tie_keys.items()}

    def tied_lookups(self) -> dict[str, tuple[str, ...]]:
        """Tie key -> the batch fields whose values are the rows this stage reads of that weight, for the tied
        weights it uses only as a lookup table (an embedding, on a stage without the head): it needs just those
        rows each step."""
        if self.is_last:
            return {}
        return {key: fields for key, fields in self.family.lookups.items() if key in self._tie_keys}

    def hf_parameter_names(self) -> dict[str, str]:
        """Local parameter name -> HF name of the weight it holds (a tied weight by its first name)."""
        return dict(self._origin)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and persistent buffers under their names in the unpartitioned HF model; with LoRA
        adapters (aqpipe/pipeline/lora.py), each folded into its base weight: the merged model."""
        return merged_state_dict(self) if has_adapters(self) else dict(self.state_dict())

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
