"""A running base per position for AQ-SGD's first visits: what a cache-free codec cannot use.

A first visit has no buffer row to take a delta against, but the boundary has already carried other samples: the
mean decoded row at each position (token slot) of a sample is known to both sides. Position embeddings, the first
token's large hidden state and channels that are large everywhere all sit in that mean, and a min-max quantizer
spends its levels on them. So the first visit sends Q(a - b) and both sides decode b + deQ(...), where b is the
running mean of the rows decoded so far (a cumulative mean over the first `window` samples, then an exponential one
with weight 1/window a sample, so it follows the model as it trains). Both sides update b from the decoded rows
alone, with the same float32 arithmetic in the same order (no reduction whose order a device chooses), so their
bases stay bit-identical, on a CPU and a GPU alike.
"""
from __future__ import annotations

from typing import Any

import torch
from .fields import check_int

BASES = ("none", "position")
DEFAULT_WINDOW = 256  # samples: the mean's memory once it has seen that many


class RunningBase:
    """The per-position running mean of the rows sent whole, shape `sample_shape`, float32."""

    def __init__(self, sample_shape: tuple[int, ...], window: int = DEFAULT_WINDOW) -> None:
        check_int("window", window, 1, what="a positive number of samples")
        self.sample_shape, self.window = tuple(sample_shape), window
        self.mean = torch.zeros(self.sample_shape, dtype=torch.float32)
        self.count = 0  # rows folded in so far (the weight stops falling at `window`)

    def _on(self, device: torch.device) -> torch.Tensor:
        if self.mean.device != device:
            self.mean = self.mean.to(device)
        return self.mean

    def center(self, rows: torch.Tensor) -> torch.Tensor:
        """What the first-visit codec sends instead of `rows`: their difference to the base, in their dtype."""
        return (rows.float() - self._on(rows.device)).to(rows.dtype)

    def restore(self, decoded: torch.Tensor) -> torch.Tensor:
        """The rows the receiver computes with and both sides store: base + what was decoded, in its dtype."""
        return (decoded.float() + self._on(decoded.device)).to(decoded.dtype)

    def update(self, rows: torch.Tensor) -> None:
        """Fold the decoded rows of one message into the mean (both sides, after each message, in message order)."""
        n = rows.shape[0]
        if not n:
            return
        weight = n / min(self.count + n, self.window)
        mean = self._on(rows.device)
        # the rows summed one by one and divided by a tensor: IEEE adds and a division in a fixed order, the same
        # bits on a CPU and a GPU (a reduction's order, and CUDA's reciprocal for a Python divisor, are not)
        total = rows[0].float().clone()
        for row in rows[1:]:
            total += row.float()
        total /= torch.full_like(total, n)
        mean += (total - mean) * weight
        self.count += n

    def snapshot(self) -> tuple[torch.Tensor, int]:
        """The base as it is now, on its device (no host copy): for undoing a rejected step."""
        return self.mean.clone(), self.count

    def put_back(self, snapshot: tuple[torch.Tensor, int]) -> None:
        self.mean, self.count = snapshot[0].clone(), snapshot[1]

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.cpu().clone(), "count": self.count, "window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["mean"].shape) != self.sample_shape or state["window"] != self.window:
            raise ValueError(f"running base of shape {tuple(state['mean'].shape)}, window {state['window']}: "
                             f"expected {self.sample_shape}, window {self.window}")
        self.mean = state["mean"].to(self.mean.device, torch.float32).clone()
        self.count = int(state["count"])
