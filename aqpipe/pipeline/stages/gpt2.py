"""GPT-2 stages: GPT2LMHeadModel and GPT2ForSequenceClassification.

Per stage, as ``GPT2Model.forward`` does it (transformers 5): position ids are ``arange(T)[None]`` (a packed
sample's own, restarting with each sequence, where the batch has them); the causal +
padding mask is rebuilt from ``batch["attention_mask"]`` with ``masking_utils.create_causal_mask`` and the stage's
copy of the config (so ``sdpa`` may get ``None`` and use ``is_causal``, ``eager`` a materialised mask, exactly as
the unpartitioned model). No KV cache is used.
"""
from __future__ import annotations

from typing import Any

import torch

from ..seeding import reseed
from .base import Family, PipelineStage, StageOutput
from .heads import causal_mask, classify_last_token, position_ids
from .lm_loss import causal_lm_loss


class GPT2Stage(PipelineStage):
    """A slice of GPT2LMHeadModel / GPT2ForSequenceClassification (HF names: ``transformer.*``, ``lm_head`` /
    ``score``)."""

    @staticmethod
    def check(config: Any) -> str | None:
        return "GPT-2 with add_cross_attention=True" if getattr(config, "add_cross_attention", False) else None

    def embed(self, batch: dict[str, torch.Tensor], seed: int | None) -> torch.Tensor:
        tr = self.transformer
        inputs_embeds = tr.wte(batch["input_ids"])
        hidden = inputs_embeds + tr.wpe(position_ids(inputs_embeds, batch))
        token_type_ids = batch.get("token_type_ids")
        if token_type_ids is not None:
            hidden = hidden + tr.wte(token_type_ids)
        reseed(seed, "embed")
        return tr.drop(hidden)

    def block_arguments(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[int, Any]:
        positions = position_ids(hidden, batch)
        mask = causal_mask(self.config, hidden, batch, positions)
        kwargs = {"encoder_attention_mask": None, "use_cache": False, "position_ids": positions}
        return {i: ((None, mask, None), kwargs) for i in self.block_indices}

    def head(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], seed: int | None) -> StageOutput:
        hidden = self.transformer.ln_f(hidden)
        labels = batch.get("labels")
        if hasattr(self, "lm_head"):
            loss, logits, stats = causal_lm_loss(self.lm_head, hidden, labels, self.config.vocab_size,
                                                 fused=self.fused_loss)
            return StageOutput(loss=loss, logits=logits, token_stats=stats)
        return classify_last_token(self.score(hidden), batch["input_ids"], labels, self.config)


def family(head: str) -> Family:
    return Family(GPT2Stage, first=("transformer.wte", "transformer.wpe", "transformer.drop"), blocks="transformer.h",
                  last=("transformer.ln_f", head), head=(head,),
                  lookups={"transformer.wte.weight": ("input_ids", "token_type_ids")})


FAMILIES = {"GPT2LMHeadModel": lambda config: family("lm_head"),
            "GPT2ForSequenceClassification": lambda config: family("score")}
