"""Weights several stages hold a copy of, kept in step by one owner and a few rows a step.

GPT2's LM head is its token embedding: stage 0 looks rows up, the last stage multiplies by the whole
matrix. DeBERTa's relative embeddings are used whole on every stage. The *owner* of a tie is the last
holder that uses the whole matrix; it alone steps the weight (its gradient is dense anyway). A
*follower* only needs, each step, the rows it will read: for a lookup (GPT2's embedding) the rows of
that step's tokens, which both sides know without sending ids, since every stage loads the same
micro-batches; for a whole-matrix use, every row. Each step:

    before micro-batch k's forward:  owner --the rows first read in k--> follower (into its copy)
    after micro-batch k's backward:  follower --the gradient of the rows last read in k--> owner

so with a 50257-token vocabulary a step moves the ~740 rows of its tokens, not 2 x 50257 rows of
gradients. Both exchanges sit on the step's critical path (the next step's rows depend on this step's
update); streaming them with the schedule (micro-batches are backwarded in order) lets the follower
start on its first micro-batch's rows and the owner receive most gradients while stage 0 still computes.

The messages are a boundary's (`transport.Boundary`, on a tag of their own): values as a ForwardCodec
keyed by row index, gradients as a BackwardCodec. `none` sends both exactly, and the
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

from aqpipe.compression import plain_codecs
from aqpipe.compression.buffers import to_device

from .participants import StepPart, StepStart
from .step_guard import finite_or_zeros
from .transport import Boundary, Wire

TIE_TAG = 7  # p2p tag of tie messages, apart from boundary traffic between the same ranks
TIE_BYTES = "tie_bytes"  # the wire (StepCounters field) every tie message counts on
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

    def rows(self, stage: int, micro_batches: Sequence[dict[str, Any]], num_rows: int) -> "StepRows":
        """The sorted distinct rows `stage` reads in these micro-batches, and per micro-batch those it reads there
        first and last (CPU int64)."""
        fields = self.lookups.get(stage)
        m = len(micro_batches)
        if fields is None:
            every, none = torch.arange(num_rows), torch.zeros(0, dtype=torch.int64)
            return StepRows(every, [every] + [none] * (m - 1), [none] * (m - 1) + [every])
        per = []
        for mb in micro_batches:
            ids = [mb[f].reshape(-1).to("cpu", torch.int64) for f in fields if mb.get(f) is not None]
            per.append(torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64))
        every = torch.unique(torch.cat(per))
        first, last = torch.full_like(every, m), torch.full_like(every, -1)
        for k, ids in enumerate(per):
            at = torch.searchsorted(every, ids)
            first[at] = torch.minimum(first[at], torch.tensor(k))
            last[at] = k
        return StepRows(every, [every[first == k] for k in range(m)], [every[last == k] for k in range(m)])


@dataclass(frozen=True)
class StepRows:
    """A follower's rows in one step: all of them, and per micro-batch the ones first and last read there."""

    every: torch.Tensor
    first: list[torch.Tensor]
    last: list[torch.Tensor]


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

    step: StepRows | None = None  # this step's rows
    first_at: list[torch.Tensor] = field(default_factory=list)  # step.first on the weight's device, copied once
    last_at: list[torch.Tensor] = field(default_factory=list)  # step.last likewise
    agreed: bool = False  # whether the two sides have compared their copies (prime)
    incoming: list[Any] = field(default_factory=list)  # posted receives, in the order they were posted
    next_mb: int = 0  # follower: the next micro-batch whose rows are due
    next_back: int = 0  # follower: the next micro-batch whose backward sends gradients

    def start_step(self, micro_batches: Sequence[dict[str, Any]]) -> None:
        """This step's rows, read from the host's batches, and their indices on the weight's device, sent there once
        without the host waiting (an index a GPU op reads from host memory would wait for the GPU each time)."""
        self.step = self.tie.rows(self.follower, micro_batches, as_matrix(self.param).shape[0])
        self.first_at = [to_device(r, self.param.device) for r in self.step.first]
        self.last_at = [to_device(r, self.param.device) for r in self.step.last]
        self.incoming, self.next_mb, self.next_back = [], 0, 0


def _header(rows: torch.Tensor) -> torch.Tensor:
    """16 bytes that precede a step's rows: their count and a digest of their ids. The follower checks it
    before it posts the rows' receive, whose size it computes itself: stages with different data would
    otherwise post a receive of the wrong size, which gloo answers by aborting the process."""
    digest = int.from_bytes(hashlib.sha256(rows.numpy().tobytes()).digest()[:7], "little")
    return torch.tensor([rows.numel(), digest], dtype=torch.int64).view(torch.uint8)


class TiedWeights:
    """This stage's side of every tie it holds, a step participant (participants.py): `begin` before the schedule,
    `before_forward` and `after_backward` with each micro-batch, `finish` after it. Calls that send return their
    bytes; `codecs` exposes the stateful codecs for checkpoints."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], ties: Mapping[str, Tie], stage: int, wire: Wire,
                 rank_of: Callable[[int], int], *, channel: Callable[[int, int], object | None] = lambda a, b: None,
                 codecs: Callable[[str, int, tuple[int, int], torch.dtype], tuple[Any, Any]] | None = None) -> None:
        """`channel(src, dst)`: the group that carries this tie's messages from stage src to stage dst;
        `codecs(key, follower, matrix shape, dtype)`: a link's (rows, gradients) codecs (CodecFactory.tie; None:
        both in full precision)."""
        self.links: list[_Link] = []
        # a follower's flags, one a message, whether the rows it sent were finite (zeros went instead where not):
        # the rows it sends are every row its copy's gradient can hold, so the engine need not scan the whole copy.
        # 0-dim bools on the device, read by the engine with the step's gradient norm (no sync in the schedule)
        self.finite_flags: list[torch.Tensor] = []
        for key in sorted(k for k, t in ties.items() if stage in t.holders):
            tie, param = ties[key], params[key]
            peers = tie.followers if stage == tie.owner else (stage,)
            for follower in peers:
                peer = follower if stage == tie.owner else tie.owner
                link = codecs(key, follower, tuple(as_matrix(param).shape), param.dtype) if codecs is not None else \
                    plain_codecs()
                boundary = Boundary(wire, rank_of(peer), *link, *plain_codecs(),
                                    sends_activations=stage == tie.owner, tag=TIE_TAG, send_ids=False,
                                    outgoing=channel(stage, peer), incoming=channel(peer, stage),
                                    counters=(TIE_BYTES, TIE_BYTES))
                self.links.append(_Link(key, tie, param, follower, stage == tie.owner, boundary))

    def codecs(self) -> dict[str, Any]:
        """Name -> stateful codec, for checkpoints and for undoing a rejected step."""
        out = {}
        for link in self.links:
            name = f"tie.{link.key}.{link.follower}"
            out[f"{name}.values"], out[f"{name}.grads"] = link.boundary.forward, link.boundary.backward
        return out

    # ------------------------------------------------------------------ a step participant (participants.py)
    def begin(self, start: StepStart) -> None:
        """Before the schedule. Owner: send each follower a header and, per micro-batch, the rows first read there,
        and post the receives of the follower's gradients. Follower: check the header, post the rows' receives.
        `start.undo` (a step that may be rejected) collects how to put back what this changes. Every message counts
        on the tie's wire."""
        micro_batches, phase, training, undo = start.micro_batches, start.phase, start.training, start.undo
        self.finite_flags = []
        for link in self.links:
            link.start_step(micro_batches)
            matrix, boundary = as_matrix(link.param.detach()), link.boundary
            if phase == "train" and not link.agreed:
                _prime(link, matrix)
            if link.owner:
                header = _header(link.step.every)  # from the host: the transport stages it
                boundary.send_raw(header, TIE_BYTES)
                for rows, at in zip(link.step.first, link.first_at):
                    if rows.numel():
                        if undo is not None:
                            undo.append(boundary.forward.undo_point(rows))
                        boundary.send_activation(matrix.index_select(0, at), rows, phase)
                        self.finite_flags += [torch.isfinite(v) for v in boundary.take_checks()]
                if training:
                    link.incoming = [boundary.post_grad(torch.Size((rows.numel(), matrix.shape[1])), matrix.dtype,
                                                        phase, matrix.device) if rows.numel() else None
                                     for rows in link.step.last]
                continue
            header = boundary.recv_raw(16, torch.device("cpu"))  # read here: on the host, as gloo lands it
            if not torch.equal(header, _header(link.step.every)):
                count = int(header.view(torch.int64)[0])
                raise RuntimeError(
                    f"tied weight {link.key!r}: its owner sends {count} rows for this step, this stage reads "
                    f"{link.step.every.numel()} (or other ones): the stages' data orders differ (same dataset, seed "
                    "and batch sizes on every stage?)")
            link.incoming = [boundary.post_activation(torch.Size((rows.numel(), matrix.shape[1])), matrix.dtype, rows,
                                                      phase, matrix.device) if rows.numel() else None
                             for rows in link.step.first]

    def before_forward(self, mb: int, undo: list[Callable[[], None]] | None = None) -> None:
        """Follower: write the rows first read in micro-batches up to `mb` into this stage's copy."""
        for link in self.links:
            if link.owner:
                continue
            matrix = as_matrix(link.param.data)
            while link.next_mb <= mb:
                rows, index, posted = (link.step.first[link.next_mb], link.first_at[link.next_mb],
                                       link.incoming[link.next_mb])
                link.next_mb += 1
                if posted is None:
                    continue
                if undo is not None:
                    undo.append(link.boundary.forward.undo_point(rows))
                    undo.append(partial(matrix.index_copy_, 0, index, matrix.index_select(0, index)))
                matrix.index_copy_(0, index, link.boundary.take_activation(posted))

    def after_backward(self, mb: int, phase: str) -> None:
        """Follower: send the gradient of the rows last read in micro-batch `mb` (final now: micro-batches are
        backwarded in order), zeros where it is not finite (the step is then rejected)."""
        for link in self.links:
            if link.owner:
                continue
            if mb != link.next_back:
                raise RuntimeError(f"tied weight {link.key!r}: micro-batch {mb} backwarded before {link.next_back}; "
                                   "its rows' gradients stream in micro-batch order")
            link.next_back += 1
            rows, grad = link.step.last[mb], link.param.grad
            if not rows.numel():
                continue
            g = (as_matrix(grad).index_select(0, link.last_at[mb]) if grad is not None
                 else torch.zeros(rows.numel(), as_matrix(link.param).shape[1], dtype=link.param.dtype,
                                  device=link.param.device))
            g, ok = finite_or_zeros(g)  # where not finite, zeros go; the engine rejects the step on the parameter grad
            self.finite_flags.append(ok)
            link.boundary.send_grad(g, phase)
            self.finite_flags += [torch.isfinite(v) for v in link.boundary.take_checks()]  # its encoding's too

    def finish(self) -> StepPart:
        """After the schedule. Owner: wait for every follower's gradient and add it to its own (a step the engine
        rejects clears every gradient); its gradient is whole from here. Follower: drop its gradient (the owner steps
        the weight; what the rows it sent held is in the flags). Then every link's codecs end the step (AQ-SGD rows
        land, a subspace gradient codec's step clock): the first overflow of rows this stage sent (an owner's)."""
        for link in self.links:
            if link.owner:
                for at, posted in zip(link.last_at, link.incoming):
                    if posted is not None:
                        _add_rows(link.param, at, link.boundary.take_grad(posted))
            else:
                link.param.grad = None
            link.incoming = []
        found = [link.boundary.land() for link in self.links]
        return StepPart(overflow=next((f for f in found if f is not None), None), finite_flags=self.finite_flags)


def _digest(matrix: torch.Tensor) -> torch.Tensor:
    data = matrix.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return torch.tensor([int.from_bytes(hashlib.sha256(data).digest()[:7], "little")], dtype=torch.int64)


def _prime(link: _Link, matrix: torch.Tensor) -> None:
    """Before a link's first training step: the two sides exchange a digest of their copies, and where the copies are
    the same (both stages loaded one checkpoint) both store every row as AQ-SGD's buffer rows, so no row ever
    travels whole: a fine-tune's first visits of 50257 rows at full precision were most of a tie's bytes. Copies that
    differ (a model built from scratch on each stage) keep whole first visits. A buffer that holds rows (a resumed
    run's, on both sides alike) is left as it is, and nothing is sent."""
    link.agreed = True
    codec, boundary = link.boundary.forward, link.boundary
    if not codec.primable():
        return
    mine = _digest(matrix).view(torch.uint8)  # from the host, compared there
    boundary.send_raw(mine, TIE_BYTES)
    theirs = boundary.recv_raw(8, torch.device("cpu"))
    boundary.wire.flush()
    if torch.equal(mine, theirs):
        codec.prime(matrix)


def _add_rows(param: torch.nn.Parameter, rows: torch.Tensor, values: torch.Tensor) -> None:
    """`values` added to the gradient's `rows` (indices on the parameter's device)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    as_matrix(param.grad).index_add_(0, rows, values.to(param.grad.dtype))


__all__ = ["TIE_MODES", "TIE_TAG", "Tie", "TiedWeights", "as_matrix"]
