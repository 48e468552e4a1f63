"""Helpers every algorithm shares: parameters and gradients as one flat vector, per-replica seeds.

Algorithms send one message per step over all of a stage's parameters, so they work on the
parameters flattened in `params` order and copy the result back in place.
"""
from __future__ import annotations

import torch

from aqpipe.compression import derive_seed


def worker_seed(seed: int, rank: int) -> int:
    """The seed of replica `rank`'s generator: distinct per replica (independent rounding noise), fixed per run,
    derived from the names, never summed (compression.derive_seed)."""
    return derive_seed(seed, "data_parallel", "replica", rank)


def flat_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    """The parameters' dtype when they share one, float32 otherwise (the vector that is averaged and sent)."""
    dtypes = {p.dtype for p in params}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def flatten(params: list[torch.nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
    """A copy of all parameters in one vector, on their device."""
    if not params:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([p.detach().reshape(-1).to(dtype) for p in params])


@torch.no_grad()
def assign(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy `flat` back into the parameters, in place (the optimizer keeps its references)."""
    start = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[start:start + n].view_as(p))
        start += n


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients in one vector (zeros where a parameter got none), for one collective per step."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def set_flat_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's gradient becomes its slice of `flat` (a copy)."""
    start = 0
    for p in params:
        n = p.numel()
        p.grad = flat[start:start + n].view_as(p).clone()
        start += n
