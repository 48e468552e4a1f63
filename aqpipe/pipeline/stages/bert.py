"""BERT and RoBERTa sequence-classification stages.

Per stage, as ``BertModel.forward`` does it (transformers 5): the embeddings (word, position, token type; RoBERTa
numbers positions from its padding index) on stage 0; on every stage the bidirectional padding mask rebuilt from
``batch["attention_mask"]`` with ``masking_utils.create_bidirectional_mask``; the last stage BERT's pooler, dropout
and classifier, or RoBERTa's classification head (first token, dense, tanh, projection).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import masking_utils
from transformers.loss.loss_utils import ForSequenceClassificationLoss

from ..seeding import reseed
from .base import Family, PipelineStage, StageOutput


class BertStage(PipelineStage):
    """A slice of BertForSequenceClassification (``bert.*``, ``classifier``) or RobertaForSequenceClassification
    (``roberta.*``, ``classifier.*``)."""

    @staticmethod
    def check(config: Any) -> str | None:
        return f"{config.model_type} as a decoder (is_decoder=True)" if getattr(config, "is_decoder", False) else None

    def _base(self) -> torch.nn.Module:
        return self.get_submodule(self.family.blocks.split(".")[0])  # bert / roberta

    def embed(self, batch: dict[str, torch.Tensor], seed: int | None) -> torch.Tensor:
        reseed(seed, "embed")
        return self._base().embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))

    def block_arguments(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[int, Any]:
        attention_mask = batch.get("attention_mask")
        mask = masking_utils.create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden,
            attention_mask=None if attention_mask is None else attention_mask.to(hidden.device))
        return {i: ((mask,), {}) for i in self.block_indices}

    def head(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], seed: int | None) -> StageOutput:
        base = self._base()
        reseed(seed, "head")
        if hasattr(base, "pooler"):  # BERT: pooler, dropout, classifier
            logits = self.classifier(self.dropout(base.pooler(hidden)))
        else:  # RoBERTa: its head pools the first token itself
            logits = self.classifier(hidden)
        labels = batch.get("labels")
        loss = None if labels is None else ForSequenceClassificationLoss(labels, logits, self.config)
        return StageOutput(loss=loss, logits=logits)


FAMILIES = {
    "BertForSequenceClassification": lambda config: Family(
        BertStage, first=("bert.embeddings",), blocks="bert.encoder.layer",
        last=("bert.pooler", "dropout", "classifier"), head=("bert.pooler", "classifier")),
    "RobertaForSequenceClassification": lambda config: Family(
        BertStage, first=("roberta.embeddings",), blocks="roberta.encoder.layer", last=("classifier",),
        head=("classifier",)),
}
