"""AQ-SGD's codec: each sample's activation as a quantized change from a buffer row both sides keep (paper 004).

A sample's first visit (and a refresh) has no row to change from: it travels whole, through the whole rows' codecs
(whole_rows.py: in full precision, the paper's, or cache-free as direct or hadamard, possibly as a change from the
boundary's running base), and both sides store what was decoded as m[ξ] (in the buffer's dtype, or quantized with
its bits), so later changes are taken against exactly what the receiver holds. A sample the buffer keeps out (never
read back) travels whole at every visit and is stored nowhere. Later visits send Q(a - m[ξ]); both sides set
m[ξ] += deQ(Q(a - m[ξ])) and the receiver computes with m[ξ]. In a one-epoch fine-tune every visit is a first visit.

The codec is its parts: `delta`, a direct codec whose bits, groups, dither and adaptivity are the changes'; the
`buffer` (buffers.py); and the whole rows. `aqsgd_codec` builds them from one set of options, and `forward_codec`
either kind of forward codec.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

from .buffers import BufferRangeError, SampleBuffer, positions
from .codecs import FORWARD_MODES, DenseCodec, ForwardCodec, Message, RowCodec, check_config, check_payload
from .quantizer import QuantizedTensor, check_float, dequantize
from .running_base import BASES, RunningBase
from .seeds import derive_seed
from .whole_rows import WholeRows


class AQSGDCodec:
    """AQ-SGD on one side of a boundary, from its parts (see the module doc); both sides must be built alike."""

    mode = "aqsgd"
    warmup_refresh = True  # a warm-up step sends every sample whole through it, refreshing its rows

    def __init__(self, delta: DenseCodec, buffer: SampleBuffer, whole: WholeRows) -> None:
        if delta.mode != "direct":
            raise ValueError(f"AQSGDCodec: the changes' codec must be direct, not {delta.mode!r}")
        self.delta, self.buffer, self.whole = delta, buffer, whole
        self._squares: tuple[Any, Any] = (0.0, 0.0)  # sum ||a - m||^2, sum ||a||^2 over changes sent (take_change)
        if delta.bits == 1:
            warnings.warn(
                "aqsgd at 1 bit: min-max quantization then errs by more than the change it sends "
                "(c_Q > 1; AQ-SGD's convergence theorem needs c_Q < 0.71), so buffer errors compound. "
                "Use 2 bits with a small group_size, or more bits (benchmarks/RESULTS.md has c_Q by setting).",
                stacklevel=3,
            )

    # the changes' settings, which the engine reads and auto bits sets
    bits = property(lambda self: self.delta.bits)
    group_size = property(lambda self: self.delta.group_size)
    adaptive = property(lambda self: self.delta.adaptive)
    generator = property(lambda self: self.delta.generator)

    def dither_state(self) -> torch.Tensor:
        """The changes' rounding dither (protocol.Codec)."""
        return self.delta.dither_state()

    def set_dither_state(self, state: torch.Tensor) -> None:
        self.delta.set_dither_state(state)

    def set_bits(self, bits: int, group_size: int | None) -> None:
        """The bits and group of the changes from now on (an adaptive codec; both sides alike)."""
        if not self.adaptive:
            raise RuntimeError(f"set_bits on a {self.mode!r} codec built without adaptive=True")
        self.delta.set_bits(bits, group_size)

    # ------------------------------------------------------------------ a message's parts
    def _split(self, sample_ids: Any, shape: torch.Size,
               refresh: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validated ids, and the masks of samples sent whole (first visit, refresh, kept out) and as changes."""
        buf = self.buffer
        if len(shape) < 1 or tuple(shape[1:]) != buf.sample_shape:
            raise ValueError(
                f"activation of shape {tuple(shape)}: expected (batch, *sample_shape) with "
                f"sample_shape={buf.sample_shape}"
            )
        ids = buf.check_ids(sample_ids, shape[0])
        whole = torch.ones_like(ids, dtype=torch.bool) if refresh else ~buf.has_row(ids)
        return ids, whole, ~whole

    def _changes_shape(self, n: int) -> torch.Size:
        return torch.Size((n, *self.buffer.sample_shape))

    def _nbytes(self, whole_ids: torch.Tensor, changes: int, dtype: torch.dtype, carries: Any = False) -> int:
        return self.whole.nbytes(whole_ids, dtype) + self._changes_nbytes(changes, carries)

    # ------------------------------------------------------------------ how the changes travel (a subclass may say)
    def _changes_nbytes(self, n: int, carries: Any) -> int:
        """The bytes of `n` samples' changes (`carries`: what `_post` said of the message; a subclass's clock)."""
        return self.delta.payload_nbytes(self._changes_shape(n), torch.float32)

    def _encode_changes(self, change: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The changes' bytes, and the rows both sides then hold (m plus the change as decoded)."""
        q = self.delta.quantize(change)
        return q.to_bytes(), dequantize(q, base=m)

    def _decode_changes(self, payload: torch.Tensor, n: int, m: torch.Tensor, carries: Any) -> torch.Tensor:
        q = QuantizedTensor.from_bytes(payload, self._changes_shape(n), torch.float32, self.delta.bits,
                                       self.delta.group_size, self.delta.scale_dtype)
        return dequantize(q, base=m)

    def _post(self, changes: int) -> Any:
        """The receiver posts a message of `changes` changes: what it carries beside rows and changes, by a
        subclass's clock."""
        return False

    def _take_posted(self, changes: int) -> Any:
        """The receiver decodes the next message: what `_post` said of it."""
        return False

    def _apply(self, ids: torch.Tensor, whole: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor,
               moved: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Both sides: store whole rows (of the samples the buffer keeps), and `moved` (m + change) for the others.

        Returns what the receiver computes with: whole rows as sent, m[ξ] for the others, as `dtype`.
        BufferRangeError, before anything is stored, when a row does not fit the buffer's dtype (deferred checks: the
        buffer's `land_writes` reports it instead)."""
        buf, device = self.buffer, moved.device
        whole_ids, delta_ids = ids[whole], ids[delta]
        changed = buf.prepare(delta_ids, moved)
        kept = buf.keeps(whole_ids)  # a sample kept out of the buffer (never read back) stores nothing
        if bool(kept.any()):
            kept_rows = rows if bool(kept.all()) else rows.index_select(0, positions(kept, device))
            buf.store(whole_ids[kept], buf.prepare(whole_ids[kept], kept_rows))
        buf.store(delta_ids, changed)
        if not whole_ids.numel():  # the steady state: every sample sent as a change
            return changed.held.to(dtype)
        if not delta_ids.numel():  # first visits
            return rows.to(dtype)
        out = torch.empty((ids.numel(), *buf.sample_shape), dtype=dtype, device=device)
        out.index_copy_(0, positions(whole, device), rows.to(dtype))
        out.index_copy_(0, positions(delta, device), changed.held.to(dtype))
        return out

    # ------------------------------------------------------------------ a message
    def encode(self, x: torch.Tensor, sample_ids: Any = None, *, refresh: bool = False) -> Message:
        """Encode micro-batch x (B, *sample_shape) of samples `sample_ids` (B dataset indices). `refresh` (both
        sides alike) sends every sample whole and resets its row: the warm-up epochs."""
        check_float(x)
        ids, whole, delta = self._split(sample_ids, x.shape, refresh)
        x = x.detach()
        self.delta.check_input(x, "activation")
        steady = not bool(whole.any())  # every sample sent as a change: no masks to apply (host bits, no sync)
        rows = x[:0] if steady else x.index_select(0, positions(whole, x.device))
        m = self.buffer.rows(ids[delta], x.device).float()
        moved = (x if steady else x.index_select(0, positions(delta, x.device))).float()
        change = moved - m
        self._squares = (self._squares[0] + torch.linalg.vector_norm(change).square(),
                         self._squares[1] + torch.linalg.vector_norm(moved).square())
        changes, held = self._encode_changes(change, m)
        payloads, whole_rows = self.whole.send(rows, ids[whole])  # what the receiver will compute with and store
        decoded = self._apply(ids, whole, delta, whole_rows, held, x.dtype)
        self.whole.fold(whole_rows)
        payload = torch.cat([*payloads, changes.to(x.device)])
        return Message(payload, x.shape, x.dtype, decoded=decoded)

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None,
                       *, refresh: bool = False) -> int:
        """The payload size `decode` expects, from this side's own state: what a receiver allocates."""
        ids, whole, delta = self._split(sample_ids, torch.Size(shape), refresh)
        changes = int(delta.sum())
        return self._nbytes(ids[whole], changes, dtype, self._post(changes))

    def decode(self, message: Message, sample_ids: Any = None, *, refresh: bool = False) -> torch.Tensor:
        """The tensor the receiving stage computes with: m[ξ] after this update."""
        ids, whole, delta = self._split(sample_ids, torch.Size(message.shape), refresh)
        whole_ids, changes = ids[whole], int(delta.sum())
        carries = self._take_posted(changes)
        check_payload(
            message, self._nbytes(whole_ids, changes, message.dtype, carries),
            f"for {whole_ids.numel()} whole and {changes} delta samples: the two sides' buffers disagree "
            "(a different sample order, a lost message, or refresh on one side only)",
        )
        payload = message.payload
        rows, row_bytes = self.whole.receive(payload, whole_ids, message.dtype)
        m = self.buffer.rows(ids[delta], payload.device).float()
        held = self._decode_changes(payload[row_bytes:], changes, m, carries)
        out = self._apply(ids, whole, delta, rows, held, message.dtype)
        self.whole.fold(rows)
        return out

    # ------------------------------------------------------------------ a step
    def defer_checks(self) -> None:
        """As a dense codec's (DenseCodec.defer_checks), and the buffer's writes wait for `end_step`."""
        for codec in (self.delta, *self.whole.codecs()):
            codec.defer_checks()
        self.buffer.defer()

    def take_checks(self) -> list[torch.Tensor]:
        return [flag for codec in (self.delta, *self.whole.codecs()) for flag in codec.take_checks()]

    def prime(self, rows: torch.Tensor) -> None:
        """Where both sides already hold every sample's row (`rows`, in id order: a tied weight both stages loaded
        from one checkpoint), store them as the buffer's rows, so each goes as a change from its first visit on
        instead of whole. Only into a buffer holding no row (`empty`: a resumed one holds its own)."""
        if not self.empty():
            raise RuntimeError("prime: the buffer already holds rows")
        ids = torch.arange(rows.shape[0])
        self.buffer.store(ids, self.buffer.prepare(ids, rows.detach()))

    def primable(self) -> bool:
        """Whether `prime` may store every row now: the buffer holds none (protocol.Codec)."""
        return self.empty()

    def empty(self) -> bool:
        """Whether the buffer holds no row yet (the same on both sides: their buffers are alike)."""
        return not bool(self.buffer.seen.any())

    def end_step(self) -> BufferRangeError | None:
        """After a step's schedule: the buffer's deferred writes landed; the first row its dtype could not hold (both
        sides find the same), for the caller to report and undo, or None."""
        return self.buffer.land_writes()

    def take_change(self) -> tuple[float, float]:
        """(sum of ||a - m||^2, sum of ||a||^2) over the changes encoded since the last call: the root of their ratio
        is the relative change AQ-SGD compresses. Its quantization error scales with it, so it must shrink as
        training settles for AQ-SGD to pay off (dropout's fresh masks keep it up)."""
        change, activation = self._squares
        self._squares = (0.0, 0.0)
        return float(change), float(activation)

    def undo_point(self, sample_ids: Any) -> Callable[[], None]:
        """A function that puts back the buffer rows of `sample_ids`, the whole rows' dither and the running base as
        they are now: how a step that must leave no trace (a NaN, an overflow) is undone."""
        rows = self.buffer.snapshot(self.buffer.check_ids(sample_ids))
        whole = self.whole.undo_point()

        def restore() -> None:
            self.buffer.restore(rows)
            whole()

        return restore

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict[str, Any]:
        buf = self.buffer
        return {**self.delta.config(), "mode": self.mode, "num_samples": buf.num_samples,
                "sample_shape": buf.sample_shape, "buffer_dtype": str(buf.dtype), "buffer_bits": buf.bits,
                **self.whole.config()}

    def state_dict(self) -> dict[str, Any]:
        """Config (checked on load), the changes' dither and adaptive bits, the buffer's rows, and the whole rows'
        codecs and base (the keys of the forward codec that held all of them before)."""
        return {**self.delta.state_dict(), "config": self.config(), "buffer": self.buffer.state_dict(),
                **self.whole.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_config(type(self).__name__, self.config(), state)
        self.delta.load_state(state)
        self.buffer.load_state_dict(state["buffer"])
        self.whole.load_state_dict(state)


def aqsgd_codec(bits: int, *, num_samples: int, sample_shape: tuple[int, ...], seed: int = 0,
                group_size: int | None = None, stochastic: bool = True, adaptive: bool = False,
                scale_dtype: torch.dtype = torch.float32, buffer_dtype: torch.dtype = torch.float16,
                buffer_bits: int | None = None, buffer_path: str | os.PathLike | None = None,
                buffer_keep: torch.Tensor | None = None, first_visit: str = "none", transient_visit: str | None = None,
                first_visit_bits: int | None = None, first_visit_group_size: int | None = None,
                first_visit_base: str = "none", rotation_seed: int = 0) -> AQSGDCodec:
    """An AQ-SGD codec (each part's own seed derived from `seed`):

    - the changes: `bits`, `group_size`, `stochastic`, `adaptive`, `scale_dtype`;
    - the buffer: `num_samples` (its rows' ids), `sample_shape` (one sample's activation, e.g. (seq_len, hidden)),
      `buffer_dtype`, `buffer_bits` (4 or 8: rows quantized), `buffer_path` (a file instead of memory; each side its
      own), `buffer_keep` (a bool per sample: the samples whose rows are kept; None: all);
    - the whole rows: `first_visit` (none, direct, hadamard: how a first visit travels), `transient_visit` (how the
      rows of samples kept out travel; None: as first visits), `first_visit_bits`, `first_visit_group_size`,
      `first_visit_base` (position: compressed rows as changes from the running base), `rotation_seed` (hadamard's
      signs, the same on both sides).
    """
    delta = DenseCodec("direct", bits, stochastic=stochastic, seed=seed, group_size=group_size, adaptive=adaptive,
                       scale_dtype=scale_dtype)
    buffer = SampleBuffer(num_samples, tuple(sample_shape), buffer_dtype, buffer_path, buffer_bits, buffer_keep)

    def row_codec(mode: str, part: str) -> RowCodec:  # whole rows take no bits in full precision
        return RowCodec(mode, None if mode == "none" else first_visit_bits, stochastic, derive_seed(seed, part),
                        first_visit_group_size, rotation_seed, scale_dtype=scale_dtype)

    first, transient_mode = row_codec(first_visit, "first_visit"), transient_visit
    # rows kept out draw the first visits' stream where those draw none (full precision): a run that keeps no row
    # then sends what one with that codec for every row sends
    transient = first if transient_mode in (None, first.mode) else \
        row_codec(transient_mode, "first_visit" if first.mode == "none" else "transient_visit")
    base = first_visit_base
    if base not in BASES:
        raise ValueError(f"first_visit_base={base!r}: expected one of {', '.join(BASES)}")
    if base != "none" and first.mode == transient.mode == "none":
        raise ValueError(f"first_visit_base={base!r}: expected a compressed first visit (first_visit direct or "
                         "hadamard), not none")
    running = RunningBase(tuple(sample_shape)) if base != "none" else None
    return AQSGDCodec(delta, buffer, WholeRows(first, transient, running, buffer))


def forward_codec(mode: str, bits: int | None = None, *, num_samples: int | None = None,
                  sample_shape: tuple[int, ...] | None = None, seed: int = 0, group_size: int | None = None,
                  stochastic: bool = True, adaptive: bool = False, scale_dtype: torch.dtype = torch.float32,
                  rotation_seed: int = 0, buffer_dtype: torch.dtype = torch.float16, buffer_bits: int | None = None,
                  buffer_path: str | os.PathLike | None = None, buffer_keep: torch.Tensor | None = None,
                  first_visit: str = "none", transient_visit: str | None = None, first_visit_bits: int | None = None,
                  first_visit_group_size: int | None = None,
                  first_visit_base: str = "none") -> ForwardCodec | AQSGDCodec:
    """A forward codec of `mode`: none, direct or hadamard (ForwardCodec, which reads the rounding's settings:
    `seed`, `group_size`, `stochastic`, `adaptive`, `scale_dtype`, `rotation_seed`; the buffer's and the whole rows'
    are aqsgd's alone), or aqsgd (`aqsgd_codec`, `num_samples` and `sample_shape` needed)."""
    if mode not in FORWARD_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(FORWARD_MODES)}")
    if mode == "subspace":
        raise ValueError("mode='subspace' is built with its gradient codec around one basis: subspace_codecs")
    if mode != "aqsgd":
        return ForwardCodec(mode, bits, stochastic=stochastic, seed=seed, group_size=group_size,
                            rotation_seed=rotation_seed, adaptive=adaptive, scale_dtype=scale_dtype)
    if num_samples is None or sample_shape is None:
        raise ValueError("mode='aqsgd' needs num_samples (dataset size) and sample_shape (one sample's activation)")
    if bits is None:
        raise ValueError("mode='aqsgd' needs bits (1 to 8)")
    return aqsgd_codec(bits, num_samples=num_samples, sample_shape=sample_shape, seed=seed, group_size=group_size,
                       stochastic=stochastic, adaptive=adaptive, scale_dtype=scale_dtype, buffer_dtype=buffer_dtype,
                       buffer_bits=buffer_bits, buffer_path=buffer_path, buffer_keep=buffer_keep,
                       first_visit=first_visit, transient_visit=transient_visit, first_visit_bits=first_visit_bits,
                       first_visit_group_size=first_visit_group_size, first_visit_base=first_visit_base,
                       rotation_seed=rotation_seed)


__all__ = ["AQSGDCodec", "aqsgd_codec", "forward_codec"]
