"""Weights several stages hold a copy of, kept in step by one owner and a few rows a step.

GPT2's LM head is its token embedding: stage 0 looks rows up, the last stage multiplies by the whole
matrix. DeBERTa's relative embeddings are used whole on every stage. The *owner* of a tie is the last
holder that uses the whole matrix; it alone steps the weight (its gradient is dense anyway). A
*follower* only needs, each step, the rows it will read: for a lookup (GPT2's embedding) the rows of
that step's tokens, which both sides know without sending ids, since every stage loads the same
micro-batches; for a whole-matrix use, every row. Each step:

    before the schedule:  owner --the rows the follower reads this step--> follower (into its copy)
    after backward:       follower --its gradient at those rows--> owner (added to the owner's)

so with a 50257-token vocabulary a step moves the ~740 rows of its tokens, not 2 x 50257 rows of
gradients. The messages are a boundary's (`transport.Boundary`, on a tag of their own): values as a
ForwardCodec keyed by row index, gradients as a BackwardCodec. `none` sends both exactly, and the
pipeline computes what the unpartitioned model does. `aqsgd` sends each row as its change since the
follower last received it, quantized, against a copy of the follower's rows that both sides keep
(the AQ-SGD buffer, float32): the follower's rows stay within one quantization step of the owner's
and the error never accumulates; gradients go quantized with stochastic rounding (unbiased).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch

from compression import BackwardCodec, ForwardCodec

from .transport import Boundary, Wire

TIE_TAG = 7  # p2p tag of tie messages, apart from boundary traffic between the same ranks
TIE_MODES = ("none", "aqsgd")


@dataclass(frozen=True)
class Tie:
    """The stages holding copies of one weight; `lookups[s]`: the batch fields whose values are the rows stage s
    reads (a lookup table, as an embedding); a holder not in `lookups` uses every row."""

    holders: tuple[int, ...]
    lookups: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.holders) < 2 or list(self.holders) != sorted(set(self.holders)):
            raise ValueError(f"tie holders {self.holders}: expected two or more distinct stages, sorted")
        if not set(self.lookups) <= set(self.holders):
            raise ValueError(f"tie lookups name stages {sorted(self.lookups)} outside the holders {self.holders}")

    @property
    def owner(self) -> int:
        """The stage that steps the weight: the last holder using every row (else the last holder)."""
        whole = [s for s in self.holders if s not in self.lookups]
        return (whole or list(self.holders))[-1]

    @property
    def followers(self) -> tuple[int, ...]:
        return tuple(s for s in self.holders if s != self.owner)

    def rows(self, stage: int, micro_batches: Sequence[dict[str, Any]], num_rows: int) -> torch.Tensor:
        """The sorted distinct rows `stage` reads in these micro-batches (CPU int64)."""
        fields = self.lookups.get(stage)
        if fields is None:
            return torch.arange(num_rows)
        ids = [mb[f].reshape(-1).to("cpu", torch.int64) for mb in micro_batches for f in fields
               if mb.get(f) is not None]
        return torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64)


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A view with one row per lookup index (a vector is one row)."""
    return t.view(t.shape[0], -1) if t.dim() > 1 else t.view(1, -1)


@dataclass
class _Link:
    """One follower's copy of one tie, seen from the owner or from that follower."""

    key: str
    tie: Tie
    param: torch.nn.Parameter
    follower: int  # the stage whose rows move
    owner: bool  # this side is the owner
    boundary: Boundary

    def rows(self, micro_batches: Sequence[dict[str, Any]]) -> torch.Tensor:
        return self.tie.rows(self.follower, micro_batches, as_matrix(self.param).shape[0])


def remember_rows(boundary: Boundary, ids: Any, undo: list[Callable[[], None]]) -> None:
    """Before the AQ-SGD buffer of `boundary` updates rows `ids`, note how to put them back."""
    buffer = boundary.forward.buffer
    if buffer is not None:
        undo.append(partial(buffer.restore, buffer.snapshot(buffer.check_ids(ids))))


def _header(rows: torch.Tensor) -> torch.Tensor:
    """16 bytes that precede a step's rows: their count and a digest of their ids. The follower checks it
    before it posts the rows' receive, whose size it computes itself: stages with different data would
    otherwise post a receive of the wrong size, which gloo answers by aborting the process."""
    digest = int.from_bytes(hashlib.sha256(rows.numpy().tobytes()).digest()[:7], "little")
    return torch.tensor([rows.numel(), digest], dtype=torch.int64).view(torch.uint8)


class TiedWeights:
    """This stage's side of every tie it holds: the row exchange before the schedule and the gradient
    exchange after it. Bytes are returned by each call; codecs are exposed for checkpoints."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], ties: Mapping[str, Tie], stage: int, wire: Wire,
                 rank_of: Callable[[int], int], *, mode: str = "none", bits: int | None = None,
                 stochastic: bool = True, seed: int = 0) -> None:
        if mode not in TIE_MODES:
            raise ValueError(f"tie mode {mode!r}: expected one of {', '.join(TIE_MODES)}")
        self.links: list[_Link] = []
        for index, key in enumerate(sorted(k for k, t in ties.items() if stage in t.holders)):
            tie, param = ties[key], params[key]
            peers = tie.followers if stage == tie.owner else (stage,)
            for follower in peers:
                peer = follower if stage == tie.owner else tie.owner
                link_seed = seed * 1000 + 500 + 10 * index + follower
                boundary = Boundary(wire, rank_of(peer), *self._codecs(param, mode, bits, stochastic, link_seed),
                                    ForwardCodec("none"), BackwardCodec("none"), tag=TIE_TAG, send_ids=False)
                self.links.append(_Link(key, tie, param, follower, stage == tie.owner, boundary))

    @staticmethod
    def _codecs(param: torch.Tensor, mode: str, bits: int | None, stochastic: bool,
                seed: int) -> tuple[ForwardCodec, BackwardCodec]:
        if mode == "none":
            return ForwardCodec("none"), BackwardCodec("none")
        num_rows, width = as_matrix(param).shape
        values = ForwardCodec("aqsgd", bits, num_samples=num_rows, sample_shape=(width,), buffer_dtype=param.dtype,
                              stochastic=stochastic, seed=seed)
        return values, BackwardCodec("direct", bits, stochastic=stochastic, seed=seed + 1)

    def codecs(self) -> dict[str, Any]:
        """Name -> stateful codec, for checkpoints and for undoing a rejected step."""
        out = {}
        for link in self.links:
            name = f"tie.{link.key}.{link.follower}"
            out[f"{name}.values"], out[f"{name}.grads"] = link.boundary.forward, link.boundary.backward
        return out

    def send_rows(self, micro_batches: Sequence[dict[str, Any]], phase: str,
                  undo: list[Callable[[], None]] | None = None) -> int:
        """Owner: send each follower the rows it reads in these micro-batches. Returns the bytes sent.
        `undo` (a step that may be rejected) collects how to put back what this changes."""
        sent = 0
        for link in self.links:
            if link.owner:
                rows = link.rows(micro_batches)
                header = _header(rows).to(link.param.device)
                link.boundary.wire.send(header, link.boundary.peer, tag=TIE_TAG)
                if undo is not None:
                    remember_rows(link.boundary, rows, undo)
                x = as_matrix(link.param.detach()).index_select(0, rows.to(link.param.device))
                sent += header.numel() + link.boundary.send_activation(x, rows, phase)
        return sent

    def receive_rows(self, micro_batches: Sequence[dict[str, Any]], phase: str,
                     undo: list[Callable[[], None]] | None = None) -> None:
        """Follower: write the rows the owner sent into this stage's copy (`undo` as in send_rows)."""
        for link in self.links:
            if not link.owner:
                rows = link.rows(micro_batches)
                matrix = as_matrix(link.param.data)
                header = link.boundary.wire.recv(16, link.boundary.peer, matrix.device, tag=TIE_TAG).cpu()
                if not torch.equal(header, _header(rows)):
                    count = int(header.view(torch.int64)[0])
                    raise RuntimeError(
                        f"tied weight {link.key!r}: its owner sends {count} rows for this step, this stage reads "
                        f"{rows.numel()} (or other ones): the stages' data orders differ (same dataset, seed and "
                        "batch sizes on every stage?)")
                posted = link.boundary.post_activation(torch.Size((rows.numel(), matrix.shape[1])), matrix.dtype,
                                                       rows, phase, matrix.device)
                index = rows.to(matrix.device)
                if undo is not None:
                    remember_rows(link.boundary, rows, undo)
                    undo.append(partial(matrix.index_copy_, 0, index, matrix.index_select(0, index)))
                matrix.index_copy_(0, index, link.boundary.take_activation(posted))

    def exchange_grads(self, micro_batches: Sequence[dict[str, Any]], phase: str) -> int:
        """Followers send their gradient at the rows they read and drop it (the owner steps the weight);
        the owner adds each follower's into its own. Returns the bytes this side sent."""
        sent, incoming = 0, []
        for link in self.links:
            rows = link.rows(micro_batches)
            width = as_matrix(link.param).shape[1]
            if link.owner:
                shape = torch.Size((rows.numel(), width))
                posted = link.boundary.post_grad(shape, link.param.dtype, phase, link.param.device)
                incoming.append((link, rows, posted))
                continue
            grad = link.param.grad
            g = (as_matrix(grad).index_select(0, rows.to(grad.device)) if grad is not None
                 else torch.zeros(rows.numel(), width, dtype=link.param.dtype, device=link.param.device))
            sent += link.boundary.send_grad(g, phase)
            link.param.grad = None
        for link, rows, posted in incoming:
            _add_rows(link.param, rows, link.boundary.take_grad(posted))
        return sent


def _add_rows(param: torch.nn.Parameter, rows: torch.Tensor, values: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    as_matrix(param.grad).index_add_(0, rows.to(param.device), values.to(param.grad.dtype))


__all__ = ["TIE_MODES", "TIE_TAG", "Tie", "TiedWeights", "as_matrix", "remember_rows"]
