"""A last stage's causal-LM loss in chunks over the sequence, so that a micro-batch's full float32 logits never exist
at once: Llama 3's 128k vocabulary over 4 x 1024 tokens is 2 GB of them, and their gradient as much again.

Each chunk of positions runs the head, upcasts its logits and sums its cross-entropy, and only one chunk's logits
live at a time. In training, a plain Linear head's chunks make their gradients in the forward
(linear_cross_entropy.py: the head's matmuls the plain loop's count; every family's head in training); a head of
another type checkpoints each chunk, its logits recomputed in the backward instead of kept (the price: the head's
forward runs twice). The loss is HF's `ForCausalLMLoss`: labels shifted one left, -100 ignored, the mean over the
rest (0 where there is none). Where the whole micro-batch's logits fit in `CHUNK_BYTES` it is computed as HF
computes it, and the logits come back; chunked, they don't (a causal LM's step uses only the loss).

With the loss, from the same logits and without a gradient, what TRL logs beside it (`token_stats`): how many target
tokens the argmax predicts (mean_token_accuracy's numerator) and, outside autograd (evaluation), the sum of the
predicted distributions' entropies over the targets. They stay on the device, read with the loss.

`fused="liger"` (the trainer's --use_liger_kernel, HF's and TRL's flag): in training, Liger Kernel's fused linear
cross-entropy computes the loss and its gradients from the hidden states and the head's weight a block of rows at a
time, in one pass, so the logits never exist and the head runs once: what the chunks here do in torch ops, with
its softmax's gradient computed in place over each block's logits in one Triton kernel. It builds no logits, so
training rows count no token accuracy, as TRL's do with the same flag. Evaluation keeps the path above: its
entropies and accuracy need the logits.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers.loss.loss_utils import ForCausalLMLoss

from .linear_cross_entropy import IGNORE, LinearCrossEntropy, is_plain_linear

CHUNK_BYTES = 256 * 2**20  # the float32 logits a chunk may hold


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


def _targets(shifted: torch.Tensor) -> torch.Tensor:
    """The mean's divisor: the target count, on the device, at least 1. A micro-batch with no targets then has a
    loss of 0 and no gradient, as Liger's fused loss gives it (the step's per-token loss weighs it by its 0
    targets), not 0/0; with targets the loss is HF's mean bit for bit (its sum over the count)."""
    return (shifted != IGNORE).sum().clamp(min=1)


def _summed(head: Callable, hidden: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float | None,
            entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _logits(head, hidden, cap).float()
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, token_stats(logits, targets, entropy)


FUSED = (None, "liger")  # the loss's kernel in training: the chunks here, or Liger's fused linear cross-entropy


def fused_ready(fused: str | None, head: torch.nn.Module | None = None) -> None:
    """A ValueError naming what is missing where the `fused` loss cannot run: Liger's package (checked on every
    stage alike), a `head` that is a plain Linear (its weight and bias are all it computes with; a LoRA-wrapped one
    is more)."""
    if fused not in FUSED:
        raise ValueError(f"fused loss {fused!r}: expected one of {FUSED}")
    if fused is None:
        return
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        raise ValueError("--use_liger_kernel needs Liger Kernel: pip install liger-kernel (or aqpipe[liger])") from None
    if head is not None and type(head) is not torch.nn.Linear:
        raise ValueError(f"--use_liger_kernel fuses a plain Linear head with its loss; this stage's head is a "
                         f"{type(head).__name__} (an adapter on the head?)")


@torch.compiler.disable  # a compiled stage calls it as it is: fused already, and it reads a count on the host
def _liger_loss(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, cap: float | None
                ) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    targets = F.pad(labels.to(hidden.device), (0, 1), value=IGNORE)[:, 1:]
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, softcap=cap, reduction="mean")
    return loss(head.weight, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), head.bias)


def causal_lm_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor | None,
                   vocab_size: int, cap: float | None = None, chunk_bytes: int | None = None,
                   fused: str | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits, token_stats) of `head` over `hidden` (B, T, H) against `labels` (B, T); logits None where
    chunked or fused, token_stats None without labels or where fused; entropies in evaluation (no autograd) alone."""
    if fused == "liger" and labels is not None and torch.is_grad_enabled():
        return _liger_loss(head, hidden, labels, cap), None, None
    limit = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows, positions = hidden.shape[:2]
    entropy = not torch.is_grad_enabled()
    if labels is None or rows * positions * vocab_size * 4 <= limit:
        logits = _logits(head, hidden, cap)
        if labels is None:
            return None, logits, None
        labels = labels.to(logits.device)
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        loss = ForCausalLMLoss(logits, labels, vocab_size=vocab_size, num_items_in_batch=_targets(shifted))
        return loss, logits, token_stats(logits, shifted, entropy)
    targets = F.pad(labels.to(hidden.device), (0, 1), value=IGNORE)[:, 1:]
    step = max(1, limit // (rows * vocab_size * 4))
    if torch.is_grad_enabled() and is_plain_linear(head) and \
            any(t is not None and t.requires_grad for t in (hidden, head.weight, head.bias)):  # a matmul a chunk fewer
        total, stats = LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, cap, step, token_stats)
        return total / _targets(targets), None, stats
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    stats = torch.zeros(2, dtype=torch.float32, device=hidden.device)
    for start in range(0, positions, step):
        part = (head, hidden[:, start:start + step], targets[:, start:start + step], vocab_size, cap, entropy)
        if torch.is_grad_enabled():  # a head's dropout redraws alike
            loss, counted = checkpoint(_summed, *part, use_reentrant=False)
        else:
            loss, counted = _summed(*part)
        total, stats = total + loss, stats + counted
    return total / _targets(targets), None, stats
