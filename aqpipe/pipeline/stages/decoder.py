"""Decoders of the Llama lineage: Llama, Qwen2, Qwen3, Mistral, Gemma 3 (text), Phi-3; causal LM and classification.

transformers declares their parts itself: the config class's ``base_model_pp_plan`` names the embeddings, the layers
and the final norm of the base model, and the family adapter is derived from it. Per stage, as the base model's
``forward`` does it (transformers 5, ``modeling_llama.py`` / ``modeling_qwen3.py``): position ids ``arange(T)[None]``
(a packed sample's own, restarting with each sequence); one mask per attention kind its layers use
(``config.layer_types``: full or sliding window; without them, sliding everywhere when ``config.sliding_window`` is
set), rebuilt from ``batch["attention_mask"]``; the rotary ``(cos, sin)`` computed once by the stage's own copy of
``rotary_emb`` (Gemma 3: per layer kind) and handed to every decoder layer. The head: the LM head (tied to the
embeddings where ``tie_word_embeddings``; Gemma 3's final soft-capping), or the classifier at each row's last non-pad
token.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .base import Family, PipelineStage, StageOutput
from .heads import causal_mask, classify_last_token, position_ids
from .lm_loss import causal_lm_loss


def layer_types(config: Any, per_layer: bool) -> list[str]:
    """Each layer's attention kind, as the base model reads it: from `config.layer_types` (Qwen2, Qwen3, Gemma 3),
    or for all layers alike from `config.sliding_window` (Llama, Mistral and Phi-3, which ignore `layer_types`)."""
    types = getattr(config, "layer_types", None)
    if per_layer and types:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


class DecoderStage(PipelineStage):
    """A slice of a ``*ForCausalLM`` / ``*ForSequenceClassification`` of the Llama lineage (HF names: ``model.*``,
    ``lm_head`` / ``score``)."""

    @staticmethod
    def check(config: Any) -> str | None:
        if getattr(config, "use_bidirectional_attention", False):
            return f"{config.model_type} with use_bidirectional_attention=True"
        return None

    def __init__(self, model: nn.Module, family: Family, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, family, *args, **kwargs)
        kinds = layer_types(self.config, family.options["per_layer_kinds"])
        self.kinds = {i: kinds[i] for i in self.block_indices}
        rotary = self.get_submodule(family.every[0])
        self.rotary_per_kind = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma 3

    def embed(self, batch: dict[str, torch.Tensor], seed: int | None) -> torch.Tensor:
        return self.get_submodule(self.family.first[0])(batch["input_ids"])

    def block_arguments(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[int, Any]:
        positions = position_ids(hidden, batch)
        rotary = self.get_submodule(self.family.every[0])
        kinds = dict.fromkeys(self.kinds.values())
        masks = {kind: causal_mask(self.config, hidden, batch, positions, kind) for kind in kinds}
        if self.rotary_per_kind:
            cos_sin = {kind: rotary(hidden, positions, kind) for kind in kinds}
        else:
            cos_sin = dict.fromkeys(kinds, rotary(hidden, positions))
        return {i: ((), {"attention_mask": masks[kind], "position_embeddings": cos_sin[kind],
                         "position_ids": positions}) for i, kind in self.kinds.items()}

    def head(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], seed: int | None) -> StageOutput:
        hidden = self.get_submodule(self.family.last[0])(hidden)
        labels = batch.get("labels")
        if hasattr(self, "lm_head"):
            loss, logits, stats = causal_lm_loss(self.lm_head, hidden, labels, self.config.vocab_size,
                                                 getattr(self.config, "final_logit_softcapping", None),
                                                 fused=self.fused_loss)
            return StageOutput(loss=loss, logits=logits, token_stats=stats)
        return classify_last_token(self.score(hidden), batch["input_ids"], labels, self.config)


def family(head: str, per_layer_kinds: bool) -> Any:
    """The adapter of a class of the lineage, from its config class's `base_model_pp_plan` (embeddings, layers,
    norm, in the base model `model`) and its head; `per_layer_kinds`: whether its layers read their attention kind
    from `config.layer_types`."""

    def derive(config: Any) -> Family:
        embed, layers, norm = type(config).base_model_pp_plan
        return Family(DecoderStage, first=(f"model.{embed}",), blocks=f"model.{layers}", last=(f"model.{norm}", head),
                      head=(head,), every=("model.rotary_emb",), lookups={f"model.{embed}.weight": ("input_ids",)},
                      options={"per_layer_kinds": per_layer_kinds})

    return derive


PER_LAYER_KINDS = {"Llama": False, "Mistral": False, "Phi3": False, "Qwen2": True, "Qwen3": True, "Gemma3": True}
FAMILIES = {
    **{f"{name}ForCausalLM": family("lm_head", kinds) for name, kinds in PER_LAYER_KINDS.items()},
    **{f"{name}ForSequenceClassification": family("score", kinds) for name, kinds in PER_LAYER_KINDS.items()
       if name != "Gemma3"},
    "Gemma3TextForSequenceClassification": family("score", True),
}
