"""The chunked causal-LM loss where the head is frozen (LoRA, QLoRA: the tied embedding trains no more), with the
hidden states' gradient computed in the forward, chunk by chunk, instead of recomputing each chunk's logits in the
backward.

Checkpointed chunks (lm_loss.py) run three of the head's matmuls a chunk under autograd: the logits, their
recomputation in the backward, and the hidden states' gradient. With a frozen head there is no weight gradient to
wait for, and the loss's gradient is the softmax less the targets: computed right after the logits, it makes the
hidden states' gradient in the same pass, two matmuls a chunk, and no logits outlive their chunk. The backward
scales that gradient by the loss's (the step's per-token weighting). At Llama 3's 128k vocabulary the head is a
third of a 1B model's LoRA step in FLOPs, so the matmul saved is about a tenth of the step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

IGNORE = -100


def is_frozen_linear(head: Any) -> bool:
    """A plain Linear whose weight (and bias) train not: the heads this loss computes."""
    return type(head) is torch.nn.Linear and not head.weight.requires_grad and \
        (head.bias is None or not head.bias.requires_grad)


class FrozenHeadLoss(torch.autograd.Function):
    """(the cross-entropy summed over the targets, token stats) of `weight`/`bias` over `hidden` (B, T, H), `step`
    positions a chunk; `targets` shifted, -100 where none; `cap` a softcap. Its gradient: `hidden`'s alone."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, cap: float | None, step: int, stats_of: Any) -> tuple[torch.Tensor, ...]:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        stats = torch.zeros(2, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden)
        kind = hidden.device.type
        if torch.is_autocast_enabled(kind):  # the weight cast once, not twice a chunk (autocast caches no frozen one)
            weight = weight.to(torch.get_autocast_dtype(kind))
        for start in range(0, hidden.shape[1], step):
            part, wanted = hidden[:, start:start + step], targets[:, start:start + step]
            raw = F.linear(part, weight, bias)
            logits = (torch.tanh(raw / cap) * cap if cap is not None else raw).float()
            kept = (wanted != IGNORE).unsqueeze(-1)
            index = wanted.clamp(min=0).unsqueeze(-1)
            logp = torch.log_softmax(logits, dim=-1)
            total = total - torch.where(kept, logp.gather(-1, index), 0.0).sum()  # an ignored NaN drops out
            d_logits = torch.where(kept, logp.exp_().scatter_add_(-1, index, -kept.float()), 0.0)  # softmax - target
            if cap is not None:  # through the softcap: 1 - tanh^2
                d_logits.mul_(1 - (logits / cap) ** 2)
            grad[:, start:start + step] = d_logits.to(raw.dtype) @ weight
            stats = stats + stats_of(logits, wanted, False)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    def backward(ctx: Any, d_total: torch.Tensor, d_stats: torch.Tensor) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return grad * d_total, None, None, None, None, None, None  # the scale not rounded to a bf16 gradient's
