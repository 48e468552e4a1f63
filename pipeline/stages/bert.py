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

    def forward(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor],
                seed: int | None = None) -> torch.Tensor | StageOutput:
        base = self.get_submodule(self.family.blocks.split(".")[0])  # bert / roberta
        if self.is_first:
            if hidden is not None:
                raise ValueError("the first stage takes hidden=None and reads batch['input_ids']")
            reseed(seed, "embed")
            hidden = base.embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))
        elif hidden is None:
            raise ValueError(f"stage {self.stage_index} needs the boundary activation, got None")
        attention_mask = batch.get("attention_mask")
        mask = masking_utils.create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden,
            attention_mask=None if attention_mask is None else attention_mask.to(hidden.device))
        for i, layer in self.blocks():
            hidden = self._call_block(i, seed, layer, hidden, mask)
        if not self.is_last:
            return hidden
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
