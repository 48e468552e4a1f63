"""The chunked causal-LM loss of a plain Linear head with its gradients computed in the forward, chunk by chunk,
instead of recomputing each chunk's logits in the backward.

Checkpointed chunks (lm_loss.py) run the head's matmul under autograd for the logits, again for their recomputation
in the backward, then for each gradient asked: the hidden states' and, where the head trains, its weight's. The
loss's gradient is the softmax less the targets: computed right after a chunk's logits, it makes every gradient in
the same pass, and no logits outlive their chunk. A frozen head (LoRA's, QLoRA's) runs two matmuls a chunk where
checkpointed chunks run three; a trained one (a full fine-tune's, its tied embedding included) three where they run
four: the plain loop's count, without its logits. The backward scales what the forward made by the loss's gradient
(the step's per-token weighting).

The price of a trained head: its weight's gradient (vocabulary x width, in the compute dtype: bf16 under autocast, as
the plain loop's matmul gives it) is held from the micro-batch's forward to its backward, one per micro-batch in
flight on the last stage: one under 1F1B (the default), every micro-batch's under GPipe, and under zb1 until the
weight-gradient action runs. For Llama-3.2-1B's shape (128k x 2048) that is 0.5 GB; its logits in float32, which
chunks never hold, are 2 GB a micro-batch of 4 x 1024 tokens.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

IGNORE = -100  # the label no loss is computed for (HF's)


def is_plain_linear(head: Any) -> bool:
    """A torch Linear: its weight and bias are all the head computes with. Every family's head is one in training
    (LoRA adapts the blocks alone); a head of another type keeps lm_loss's checkpointed chunks."""
    return type(head) is torch.nn.Linear


class LinearCrossEntropy(torch.autograd.Function):
    """(the cross-entropy summed over the targets, token stats) of `weight`/`bias` over `hidden` (B, T, H), `step`
    positions a chunk; `targets` shifted, -100 where none; `cap` a softcap. The gradients of whichever of `hidden`,
    `weight` and `bias` require one are made in the forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, cap: float | None, step: int, stats_of: Any) -> tuple[torch.Tensor, ...]:
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        stats = torch.zeros(2, dtype=torch.float32, device=hidden.device)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)  # the gradients' own
        kind = hidden.device.type
        if torch.is_autocast_enabled(kind):  # the weight cast once, not twice a chunk (autocast caches no frozen one)
            weight = weight.to(torch.get_autocast_dtype(kind))
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_weight = torch.zeros_like(weight) if wants_weight else None  # the matmuls' dtype, summed over chunks
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device) if wants_bias else None
        for start in range(0, hidden.shape[1], step):
            part, wanted = hidden[:, start:start + step], targets[:, start:start + step]
            raw = F.linear(part, weight, bias)
            logits = (torch.tanh(raw / cap) * cap if cap is not None else raw).float()
            kept = (wanted != IGNORE).unsqueeze(-1)
            index = wanted.clamp(min=0).unsqueeze(-1)
            logp = torch.log_softmax(logits, dim=-1)
            total = total - torch.where(kept, logp.gather(-1, index), 0.0).sum()  # an ignored NaN drops out
            d_logits = logp.exp_().scatter_add_(-1, index, -kept.float()).masked_fill_(~kept, 0.0)  # softmax - target
            if cap is not None:  # through the softcap: 1 - tanh^2
                d_logits.mul_(1 - (logits / cap) ** 2)
            d_raw = d_logits.to(raw.dtype)
            if grad_hidden is not None:
                grad_hidden[:, start:start + step] = d_raw @ weight
            if grad_weight is not None:  # in place: no chunk's (vocabulary x width) product kept beside the sum
                grad_weight.addmm_(d_raw.flatten(0, 1).T, part.flatten(0, 1).to(weight.dtype))
            if grad_bias is not None:
                grad_bias += d_logits.sum(dim=(0, 1))
            stats = stats + stats_of(logits, wanted, False)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    def backward(ctx: Any, d_total: torch.Tensor, d_stats: torch.Tensor) -> tuple[Any, ...]:
        # On a copy: zb1 runs this backward twice (the input's gradient, then the weights'), from the same saves; one
        # copy, not a cast beside a product (two of the weight's size). The scale is not rounded to a bf16 gradient's
        # dtype: the product is, once.
        scaled = [None if g is None else g.to(dtype, copy=True).mul_(d_total)
                  for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return *scaled, None, None, None, None
