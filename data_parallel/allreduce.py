"""Full-precision gradient averaging across replicas: the baseline every other algorithm beats on bytes."""
from __future__ import annotations

import torch

from .base import Algorithm, register


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients in one vector (zeros where a parameter got none), for one collective per step."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def set_flat_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    start = 0
    for p in params:
        n = p.numel()
        p.grad = flat[start:start + n].view_as(p).clone()
        start += n


@register
class AllReduce(Algorithm):
    """g <- mean over replicas of g: R replicas at batch B/R each step like one replica at batch B."""

    name = "allreduce"
    OPTIONS = ()

    def after_backward(self) -> None:
        if self.comm.size > 1 and self.params:
            set_flat_grads(self.params, self.comm.allreduce_mean_(flat_grads(self.params)))
