"""GPT-2 stages: GPT2LMHeadModel and GPT2ForSequenceClassification.

Per stage, as ``GPT2Model.forward`` does it (transformers 5): position ids are ``arange(T)[None]``; the causal +
padding mask is rebuilt from ``batch["attention_mask"]`` with ``masking_utils.create_causal_mask`` and the stage's
copy of the config (so ``sdpa`` may get ``None`` and use ``is_causal``, ``eager`` a materialised mask, exactly as
the unpartitioned model). No KV cache is used (HF's forward builds an empty one by default; the values are the same).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

from ..seeding import reseed
from .base import FamilyAdapter, PipelineStage, StageOutput, container, deep_copier, numel


class GPT2Stage(PipelineStage):
    """A slice of GPT2LMHeadModel / GPT2ForSequenceClassification.

    HF names: ``transformer.*``, ``lm_head`` / ``score``."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, block_indices: list[int],
                 activation_checkpointing: bool = False) -> None:
        memo, dc = deep_copier(model)
        super().__init__(memo[id(model.config)], stage_index, num_stages, block_indices, activation_checkpointing)
        self.head_type = "lm" if isinstance(model, GPT2LMHeadModel) else "cls"
        tr = model.transformer
        first, last = self.is_first, self.is_last
        self.transformer = container(
            wte=dc(tr.wte) if first else None,
            wpe=dc(tr.wpe) if first else None,
            drop=dc(tr.drop) if first else None,
            h=nn.ModuleDict({str(i): dc(tr.h[i]) for i in block_indices}),
            ln_f=dc(tr.ln_f) if last else None,
        )
        if last and self.head_type == "lm":
            # Deep-copied with this stage's memo: tied to wte when this stage also holds wte, a separate copy otherwise.
            self.lm_head = dc(model.lm_head)
            self.loss_function = ForCausalLMLoss  # what GPT2LMHeadModel computes (its loss_type is unset: HF warns)
        elif last:
            self.score = dc(model.score)
            self.num_labels = model.num_labels
        self._finish(model, memo)

    def tied_lookups(self) -> dict[str, tuple[str, ...]]:
        """Without the LM head, this stage's copy of the tied token embedding is read only at the batch's
        token ids (``token_type_ids`` index the same table, as in HF's GPT2Model)."""
        key = "transformer.wte.weight"
        return {key: ("input_ids", "token_type_ids")} if key in self.tied_parameters() and not self.is_last else {}

    def forward(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor],
                seed: int | None = None) -> torch.Tensor | StageOutput:
        input_ids = batch["input_ids"]
        attention_mask = batch.get("attention_mask")
        tr = self.transformer
        input_shape = input_ids.size()
        if self.is_first:
            if hidden is not None:
                raise ValueError("the first stage takes hidden=None and reads batch['input_ids']")
            input_ids = input_ids.view(-1, input_shape[-1])
            inputs_embeds = tr.wte(input_ids)
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
            hidden = inputs_embeds + tr.wpe(position_ids).to(inputs_embeds.device)
        else:
            if hidden is None:
                raise ValueError(f"stage {self.stage_index} needs the boundary activation, got None")
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        batch_size = hidden.shape[0]

        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.to(hidden.device).view(batch_size, -1)
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
            past_key_values=None, position_ids=position_ids,
        )

        if self.is_first:
            token_type_ids = batch.get("token_type_ids")
            if token_type_ids is not None:
                hidden = hidden + tr.wte(token_type_ids.view(-1, input_shape[-1]))
            reseed(seed, "embed")
            hidden = tr.drop(hidden)

        for i in self.block_indices:
            hidden = self._call_block(i, seed, tr.h[str(i)], hidden, None, causal_mask, None,
                                      encoder_attention_mask=None, use_cache=False, position_ids=position_ids)
        if not self.is_last:
            return hidden

        hidden = tr.ln_f(hidden)
        labels = batch.get("labels")
        if self.head_type == "lm":
            logits = self.lm_head(hidden)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels.to(logits.device), vocab_size=self.config.vocab_size)
            return StageOutput(loss=loss, logits=logits)
        return self._classify(hidden, input_ids, labels)

    def _classify(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None) -> StageOutput:
        """GPT2ForSequenceClassification's head: last non-pad token, then HF's problem-type loss."""
        logits = self.score(hidden)
        batch_size = input_ids.shape[0]
        pad = self.config.pad_token_id
        if pad is None and batch_size != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        if pad is None:
            last_non_pad_token: Any = -1
        else:
            non_pad_mask = (input_ids != pad).to(logits.device, torch.int32)
            token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]

        loss = None
        if labels is not None:
            labels = labels.to(pooled_logits.device)
            cfg = self.config
            if cfg.problem_type is None:
                if self.num_labels == 1:
                    cfg.problem_type = "regression"
                elif self.num_labels > 1 and (labels.dtype == torch.long or labels.dtype == torch.int):
                    cfg.problem_type = "single_label_classification"
                else:
                    cfg.problem_type = "multi_label_classification"
            if cfg.problem_type == "regression":
                if self.num_labels == 1:
                    loss = MSELoss()(pooled_logits.squeeze(), labels.squeeze())
                else:
                    loss = MSELoss()(pooled_logits, labels)
            elif cfg.problem_type == "single_label_classification":
                loss = CrossEntropyLoss()(pooled_logits.view(-1, self.num_labels), labels.view(-1))
            elif cfg.problem_type == "multi_label_classification":
                loss = BCEWithLogitsLoss()(pooled_logits, labels)
        return StageOutput(loss=loss, logits=pooled_logits)


class GPT2Adapter(FamilyAdapter):
    supported = (GPT2LMHeadModel, GPT2ForSequenceClassification)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer.h)

    def first_extra_numel(self, model: nn.Module) -> int:
        return numel(model.transformer.wte, model.transformer.wpe)

    def last_extra_numel(self, model: nn.Module) -> int:
        # The LM head counts in full even when tied: the last stage holds (and multiplies by) its own copy.
        head = model.lm_head if isinstance(model, GPT2LMHeadModel) else model.score
        return numel(model.transformer.ln_f) + numel(head)

    def check(self, model: nn.Module) -> None:
        if getattr(model.config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported by the partitioner")

    def build(self, model: nn.Module, stage_index: int, num_stages: int, block_indices: list[int],
              activation_checkpointing: bool) -> PipelineStage:
        return GPT2Stage(model, stage_index, num_stages, block_indices, activation_checkpointing)
