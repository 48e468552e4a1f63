"""A last stage's causal-LM loss in chunks over the sequence, so that a micro-batch's full float32 logits never exist
at once: Llama 3's 128k vocabulary over 4 x 1024 tokens is 2 GB of them, and their gradient as much again.

Each chunk of positions runs the head, upcasts its logits and sums its cross-entropy; under autograd the chunk is
checkpointed, so its logits are recomputed in backward instead of kept, and only one chunk's live at a time (the
price: the head's forward runs twice where chunked). The loss is HF's `ForCausalLMLoss`: labels shifted one left,
-100 ignored, the mean over the rest. Where the whole micro-batch's logits fit in `CHUNK_BYTES` it is computed as HF
computes it, and the logits come back; chunked, they don't (a causal LM's step uses only the loss).

With the loss, from the same logits and without a gradient, what TRL logs beside it (`token_stats`): how many target
tokens the argmax predicts (mean_token_accuracy's numerator) and, outside autograd (evaluation), the sum of the
predicted distributions' entropies over the targets. They stay on the device, read with the loss.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers.loss.loss_utils import ForCausalLMLoss

CHUNK_BYTES = 256 * 2**20  # the float32 logits a chunk may hold
IGNORE = -100


def _logits(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, cap: float | None) -> torch.Tensor:
    logits = head(hidden)
    return torch.tanh(logits / cap) * cap if cap is not None else logits


@torch.no_grad()
def token_stats(logits: torch.Tensor, targets: torch.Tensor, entropy: bool) -> torch.Tensor:
    """[the targets the argmax predicts, the sum of the predicted distributions' entropies over the targets (0 when
    not asked)], float32 on the logits' device; `targets` already shifted (-100 where none)."""
    kept = targets != IGNORE
    correct = ((logits.argmax(dim=-1) == targets) & kept).sum().float()
    if not entropy:
        return torch.stack([correct, torch.zeros_like(correct)])
    logp = torch.log_softmax(logits.float(), dim=-1)  # every position, masked after: a boolean index would wait
    return torch.stack([correct, (-(logp.exp() * logp).sum(dim=-1) * kept).sum()])  # for the GPU (its count)


def _summed(head: Callable, hidden: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float | None,
            entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _logits(head, hidden, cap).float()
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, token_stats(logits, targets, entropy)


def causal_lm_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor | None,
                   vocab_size: int, cap: float | None = None, chunk_bytes: int | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits, token_stats) of `head` over `hidden` (B, T, H) against `labels` (B, T); logits None where
    chunked, token_stats None without labels; entropies in evaluation (no autograd) alone."""
    limit = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows, positions = hidden.shape[:2]
    entropy = not torch.is_grad_enabled()
    if labels is None or rows * positions * vocab_size * 4 <= limit:
        logits = _logits(head, hidden, cap)
        if labels is None:
            return None, logits, None
        labels = labels.to(logits.device)
        loss = ForCausalLMLoss(logits, labels, vocab_size=vocab_size)
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        return loss, logits, token_stats(logits, shifted, entropy)
    targets = F.pad(labels.to(hidden.device), (0, 1), value=IGNORE)[:, 1:]
    step = max(1, limit // (rows * vocab_size * 4))
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    stats = torch.zeros(2, dtype=torch.float32, device=hidden.device)
    for start in range(0, positions, step):
        part = (head, hidden[:, start:start + step], targets[:, start:start + step], vocab_size, cap, entropy)
        if torch.is_grad_enabled():  # a head's dropout redraws alike
            loss, counted = checkpoint(_summed, *part, use_reentrant=False)
        else:
            loss, counted = _summed(*part)
        total, stats = total + loss, stats + counted
    return total / (targets != IGNORE).sum(), None, stats
