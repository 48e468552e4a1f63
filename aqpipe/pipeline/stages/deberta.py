"""DeBERTa (v1) and DeBERTa-v2/v3 sequence-classification stages.

Per stage, as ``DebertaModel.forward`` / ``DebertaEncoder.forward`` (and the v2 ones) do it:

- the attention mask: ``batch["attention_mask"]`` (all ones, as HF, when absent), expanded to the pairwise
  ``(B, 1, T, T)`` mask ``m[:, None, None, :] * m[:, None, :, None]`` (HF's ``get_attention_mask``);
- the relative positions: HF's own ``build_relative_position(hidden, hidden)`` (v2: with the encoder's
  ``position_buckets`` and ``max_relative_positions``, i.e. log buckets);
- the relative embeddings: the stage's copy of ``encoder.rel_embeddings`` (v2: passed through its copy of the encoder
  ``LayerNorm`` when ``norm_rel_ebd`` contains ``layer_norm``). Every stage holds copies: tied across stages;
- v2's ``ConvLayer`` (``conv_kernel_size > 0``) runs after layer 0 on the embedding output, so it lives on stage 0.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import DebertaV2ForSequenceClassification
from transformers.models.deberta import modeling_deberta as hf_v1
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf_v2

from ..seeding import reseed
from .base import Family, PipelineStage, StageOutput


def pairwise_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """HF DeBERTa's ``Encoder.get_attention_mask`` (identical in v1 and v2)."""
    if attention_mask.dim() <= 2:
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        attention_mask = extended_attention_mask * extended_attention_mask.squeeze(-2).unsqueeze(-1)
    elif attention_mask.dim() == 3:
        attention_mask = attention_mask.unsqueeze(1)
    return attention_mask


class DebertaStage(PipelineStage):
    """A slice of DebertaForSequenceClassification or DebertaV2ForSequenceClassification (HF names: ``deberta.*``,
    ``pooler.*``, ``classifier.*``)."""

    @staticmethod
    def check(config: Any) -> str | None:
        steps = getattr(config, "z_steps", 0) or 0
        return f"DeBERTa with z_steps={steps} (> 1)" if steps > 1 else None

    def __init__(self, model: nn.Module, family: Family, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, family, *args, **kwargs)
        enc = model.deberta.encoder
        self.v2 = isinstance(model, DebertaV2ForSequenceClassification)
        self.relative_attention = bool(enc.relative_attention)
        if self.relative_attention and self.v2:
            self.position_buckets = enc.position_buckets
            self.max_relative_positions = enc.max_relative_positions
        self.norm_rel_ebd = list(getattr(enc, "norm_rel_ebd", []))
        self.has_conv = self.is_first and getattr(enc, "conv", None) is not None

    def _rel_embeddings(self) -> torch.Tensor | None:
        if not self.relative_attention:
            return None
        enc = self.deberta.encoder
        rel = enc.rel_embeddings.weight
        if self.v2 and "layer_norm" in self.norm_rel_ebd:
            rel = enc.LayerNorm(rel)
        return rel

    def _relative_pos(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if not self.relative_attention:
            return None
        if self.v2:
            return hf_v2.build_relative_position(hidden, hidden, bucket_size=self.position_buckets,
                                                 max_position=self.max_relative_positions)
        return hf_v1.build_relative_position(hidden, hidden)

    @staticmethod
    def _attention_mask(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        mask = batch.get("attention_mask")
        return (torch.ones(batch["input_ids"].size(), device=device) if mask is None else mask).to(device)

    def embed(self, batch: dict[str, torch.Tensor], seed: int | None) -> torch.Tensor:
        input_ids = batch["input_ids"]
        token_type_ids = batch.get("token_type_ids")
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_ids.size(), dtype=torch.long, device=input_ids.device)
        reseed(seed, "embed")
        return self.deberta.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=None,
                                       mask=self._attention_mask(batch, input_ids.device), inputs_embeds=None)

    def block_arguments(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The blocks' shared arguments, and for v2's conv after layer 0 (stage 0) the embedding output (`hidden`
        here, before any block) and the input mask."""
        attention_mask = self._attention_mask(batch, hidden.device)
        conv = None
        if self.has_conv:
            conv = (hidden, attention_mask if attention_mask.dim() <= 2 else attention_mask.sum(-2) > 0)
        return {"args": (pairwise_attention_mask(attention_mask), None, self._relative_pos(hidden),
                         self._rel_embeddings(), False), "conv": conv}

    def run_block(self, index: int, seed: int | None, block: nn.Module, hidden: torch.Tensor, arguments: Any
                  ) -> torch.Tensor:
        """A DeBERTa layer returns (hidden, attention); v2's conv runs after layer 0 on the embedding output."""
        hidden, _ = self._call_block(index, seed, block, hidden, *arguments["args"])
        if index == 0 and arguments["conv"] is not None:
            embedded, input_mask = arguments["conv"]
            hidden = self.deberta.encoder.conv(embedded, hidden, input_mask)
        return hidden

    def head(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], seed: int | None) -> StageOutput:
        reseed(seed, "head")
        return self._classify(hidden, batch.get("labels"))

    def _classify(self, encoder_layer: torch.Tensor, labels: torch.Tensor | None) -> StageOutput:
        """Deberta(V2)ForSequenceClassification's head and loss (identical in v1 and v2), line for line but one:
        HF takes the mean over the labelled rows (label >= 0) by gathering them at `nonzero`'s indices, a size the
        host reads back from the GPU every micro-batch (and where a compiled stage's graph breaks). A mask takes the
        same mean on the device."""
        pooled_output = self.pooler(encoder_layer)
        pooled_output = self.dropout(pooled_output)
        logits = self.classifier(pooled_output)
        num_labels = self.config.num_labels

        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            problem_type = self.config.problem_type
            if problem_type is None:
                if num_labels == 1:
                    logits = logits.view(-1).to(labels.dtype)
                    loss = nn.MSELoss()(logits, labels.view(-1))
                elif labels.dim() == 1 or labels.size(-1) == 1:
                    labeled = labels.view(-1) >= 0  # before the cast, as HF's (-0.5 is no label); none: a loss of 0
                    losses = CrossEntropyLoss(reduction="none")(logits.view(-1, num_labels).float(),
                                                                labels.view(-1).long().clamp(min=0))
                    loss = torch.where(labeled, losses, 0.0).sum() / labeled.sum().clamp(min=1)
                else:
                    loss = -((nn.LogSoftmax(-1)(logits) * labels).sum(-1)).mean()
            elif problem_type == "regression":
                if num_labels == 1:
                    loss = MSELoss()(logits.squeeze(), labels.squeeze())
                else:
                    loss = MSELoss()(logits, labels)
            elif problem_type == "single_label_classification":
                loss = CrossEntropyLoss()(logits.view(-1, num_labels), labels.view(-1))
            elif problem_type == "multi_label_classification":
                loss = BCEWithLogitsLoss()(logits, labels)
        return StageOutput(loss=loss, logits=logits)


def family(config: Any) -> Family:
    """Stage 0: the embeddings and v2's conv layer (it runs after layer 0); every stage: the relative embeddings
    (and v2's LayerNorm over them), which every layer reads whole."""
    return Family(DebertaStage, first=("deberta.embeddings", "deberta.encoder.conv"), blocks="deberta.encoder.layer",
                  last=("pooler", "dropout", "classifier"), head=("pooler", "classifier"),
                  every=("deberta.encoder.rel_embeddings", "deberta.encoder.LayerNorm"))


FAMILIES = {"DebertaForSequenceClassification": family, "DebertaV2ForSequenceClassification": family}
