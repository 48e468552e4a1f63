"""An HF GPT2LMHeadModel as the layer list DeepSpeed's PipelineModule wants, with the model's own weights.

    specs, loss_fn, partition_method = gpt2_layer_specs(model, block_counts=[2, 2])
    module = PipelineModule(specs, num_stages=2, loss_fn=loss_fn, partition_method=partition_method)

Layers, in order: the embedding (wte + wpe + drop), one ``BlockRun`` per pipeline stage (that stage's
GPT2 blocks, in order), the final ``ln_f`` and the LM head. A head tied to ``wte`` (HF's
``tie_word_embeddings``) becomes a second ``TiedLayerSpec`` of the embedding, so DeepSpeed keeps one
``wte`` per holding stage and all-reduces its gradient, as our engine sums the copies' gradients.

Why one ``BlockRun`` per stage rather than one layer per block: DeepSpeed's own "parameters"
balancing minimises max-minus-min stage size and counts a tied layer differently, so it can split
the blocks differently from aqpipe/pipeline/partitioning.py. With exactly one BlockRun per stage,
``partition_method="type:BlockRun"`` has a single split of cost zero: each stage gets its run,
the embedding the first stage, ln_f and the head the last — our split, through DeepSpeed's public
API. Layer granularity changes nothing else for training (no activation checkpointing here).

Every spec holds the HF model's own submodules and deep-copies them when DeepSpeed builds the layer
on its stage, so the initial weights are the HF model's (which every rank builds from the same seed).
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, Sequence

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn
from transformers import GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask

TIE_KEY = "wte"
PARTITION_METHOD = "type:BlockRun"


class Embedding(nn.Module):
    """input_ids (B, T) -> wte(ids) + wpe(arange(T)), then dropout: GPT2Model's first lines."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        tr = model.transformer
        memo: dict[int, Any] = {}  # one memo: a module tied inside these copies stays tied
        self.wte, self.wpe, self.drop = (copy.deepcopy(m, memo) for m in (tr.wte, tr.wpe, tr.drop))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class BlockRun(nn.Module):
    """A stage's contiguous GPT2 blocks. The causal mask is rebuilt from the hidden state and the
    model's config, as pipeline/stages/gpt2.py does: for sdpa it is None (``is_causal``), for eager
    a materialised mask. The mask assumes no padding: aqpipe.data.lm_dataset's masks are all ones."""

    def __init__(self, model: GPT2LMHeadModel, block_indices: Sequence[int]) -> None:
        super().__init__()
        self.config = copy.deepcopy(model.config)
        self.block_indices = list(block_indices)
        self.h = nn.ModuleList(copy.deepcopy(model.transformer.h[i]) for i in self.block_indices)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)
        ones = torch.ones(batch, length, dtype=torch.long, device=hidden.device)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=ones,
                                  past_key_values=None, position_ids=positions)
        for block in self.h:
            hidden = block(hidden, None, mask, encoder_attention_mask=None, use_cache=False, position_ids=positions)
        return hidden

    def extra_repr(self) -> str:
        return f"blocks {self.block_indices}"


class FinalNorm(nn.Module):
    """ln_f, alone: with a tied head the head is the embedding layer's second use and cannot hold it."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.ln_f = copy.deepcopy(model.transformer.ln_f)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden)


class LMHead(nn.Module):
    """An untied LM head (tie_word_embeddings false): hidden -> logits with its own weight."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.lm_head = copy.deepcopy(model.lm_head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def tied_logits(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied head: hidden @ wte.weight^T (GPT2's lm_head has no bias)."""
    return nn.functional.linear(hidden, embedding.wte.weight)


def is_tied(model: GPT2LMHeadModel) -> bool:
    """Whether the LM head IS the embedding weight in this model (what HF did with tie_word_embeddings)."""
    return model.lm_head.weight is model.transformer.wte.weight


def gpt2_layer_specs(model: GPT2LMHeadModel, block_counts: Sequence[int]) -> tuple[list[Any], Callable, str]:
    """Layer specs, the loss function and the partition method that reproduce ``block_counts`` per stage."""
    if not isinstance(model, GPT2LMHeadModel):
        raise ValueError(f"expected a GPT2LMHeadModel, got {type(model).__name__}")
    if sum(block_counts) != len(model.transformer.h) or min(block_counts) < 1:
        raise ValueError(f"block counts {list(block_counts)} do not split {len(model.transformer.h)} blocks")
    tied = is_tied(model)
    first = TiedLayerSpec(TIE_KEY, Embedding, model, tied_weight_attr=["wte.weight"]) if tied \
        else LayerSpec(Embedding, model)
    specs: list[Any] = [first]
    start = 0
    for count in block_counts:
        specs.append(LayerSpec(BlockRun, model, range(start, start + count)))
        start += count
    specs.append(LayerSpec(FinalNorm, model))
    if tied:
        specs.append(TiedLayerSpec(TIE_KEY, Embedding, model, forward_fn=tied_logits, tied_weight_attr=["wte.weight"]))
    else:
        specs.append(LayerSpec(LMHead, model))
    return specs, causal_lm_loss(model), PARTITION_METHOD


def causal_lm_loss(model: GPT2LMHeadModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """HF's own causal-LM loss (labels shifted inside), as our last stage calls it."""
    return partial(_loss, model.loss_function, model.config.vocab_size)


def _loss(function: Callable, vocab_size: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return function(logits, labels, vocab_size=vocab_size)
