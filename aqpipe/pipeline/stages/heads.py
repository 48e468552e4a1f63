"""What several families' stages compute alike: the causal mask, and a classifier reading the last real token."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import masking_utils
from transformers.loss.loss_utils import ForSequenceClassificationLoss

from .base import StageOutput

# transformers 5.x names the cache argument of its mask builders `cache` (earlier releases: `past_key_values`)
_CACHE = "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"
MASKS = {"full_attention": masking_utils.create_causal_mask,
         "sliding_attention": masking_utils.create_sliding_window_causal_mask}


def position_ids(hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A packed sample's own position ids (each sequence from 0, so HF's mask builders attend within each one
    alone), else 0..T-1."""
    given = batch.get("position_ids")
    if given is not None:
        return given.to(hidden.device)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def causal_mask(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                kind: str = "full_attention") -> Any:
    """The mask HF's model builds for its layers of `kind` (the padding mask folded in; None where the attention
    implementation needs none), from the stage's own activations: every stage rebuilds it from the batch."""
    if attention_mask is not None:
        attention_mask = attention_mask.to(hidden.device)
    return MASKS[kind](config=config, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids,
                       **{_CACHE: None})


def classify_last_token(logits: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None,
                        config: Any) -> StageOutput:
    """HF's decoder classification head (GPT2, Llama, Qwen, ...): the logits at each row's last non-pad token, the
    loss by the config's problem type (`ForSequenceClassificationLoss`)."""
    batch_size = input_ids.shape[0]
    pad = config.pad_token_id
    if pad is None and batch_size != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    if pad is None:
        last: Any = -1
    else:
        non_pad = (input_ids != pad).to(logits.device, torch.int32)
        last = (torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32) * non_pad).argmax(-1)
    pooled = logits[torch.arange(batch_size, device=logits.device), last]
    loss = None if labels is None else ForSequenceClassificationLoss(labels, pooled, config)
    return StageOutput(loss=loss, logits=pooled)
