"""What several families' stages compute alike: the causal mask, and a classifier reading the last real token."""
from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from transformers import masking_utils
from transformers.loss.loss_utils import ForSequenceClassificationLoss

from .base import StageOutput

# transformers 5.x names the cache argument of its mask builders `cache` (earlier releases: `past_key_values`)
_CACHE = "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"
MASKS = {"full_attention": masking_utils.create_causal_mask,
         "sliding_attention": masking_utils.create_sliding_window_causal_mask}
# whether the builders take the facts a staged batch carries (transformers 5): else they read them off the batch
_TOLD = hasattr(masking_utils, "packed_sequence_mask_function") and all(
    {"allow_is_causal_skip", "and_mask_function"} <= set(inspect.signature(f).parameters) for f in MASKS.values())


def position_ids(hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A packed sample's own position ids (each sequence from 0, so HF's mask builders attend within each one
    alone), else 0..T-1."""
    given = batch.get("position_ids")
    if given is not None:
        return given.to(hidden.device)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def causal_mask(config: Any, hidden: torch.Tensor, batch: dict[str, torch.Tensor], position_ids: torch.Tensor,
                kind: str = "full_attention") -> Any:
    """The mask HF's model builds for its layers of `kind` (the padding mask folded in; None where the attention
    implementation needs none), from the stage's own activations: every stage rebuilds it from the batch.

    transformers decides the mask's form by reading the batch's values (is any token padding? do the position ids
    restart?), a host sync per call on a GPU. A batch staged by the step (micro_batch.StagedBatch) carries those facts,
    read on the host, and the builder is told them instead: the same mask, no sync."""
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(hidden.device)
    build = partial(MASKS[kind], config=config, inputs_embeds=hidden, **{_CACHE: None})
    facts = getattr(batch, "facts", None)
    if facts is None or not _TOLD:
        return build(attention_mask=attention_mask, position_ids=position_ids)
    if facts.padded:  # transformers skips the mask only where no token is padding: never here
        return build(attention_mask=attention_mask, position_ids=position_ids, allow_is_causal_skip=False)
    if facts.packed:  # its packed-sequence mask, from sequence numbers it would otherwise check on the host
        sequences = packed_sequences(position_ids.expand(hidden.shape[0], -1))
        return build(attention_mask=None, position_ids=None,
                     and_mask_function=masking_utils.packed_sequence_mask_function(sequences))
    return build(attention_mask=None, position_ids=None)  # causal alone: what an all-ones mask comes to


def packed_sequences(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence number within its row (a new sequence wherever the position does not go up by one), as
    transformers numbers packed sequences, without its check whether any row is packed."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


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
