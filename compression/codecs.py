"""Boundary codecs: what crosses a pipeline boundary, forward and backward.

One codec instance lives on each side of a boundary; the sender calls `encode`,
the receiver `decode`, and both sides' state (AQ-SGD's buffers) evolves the same.

Forward modes:
  none    the activation as is (the FP32 baseline);
  direct  Q(a) (the DirectQ baseline);
  hadamard  Q(R a), decoded as R^T deQ(...): a seeded randomized Hadamard rotation R first spreads
          outliers across each block (hadamard.py), so min-max groups lose less; no buffer, no
          state between steps (for buffers that do not fit, or samples seen once);
  aqsgd   AQ-SGD: a sample's first visit (and a refresh) sends a whole, through the `first_visit`
          codec: in full precision (its own dtype; `none`, the paper's), or cache-free as `direct` or
          `hadamard` at `first_visit_bits`; the receiver computes with what it decoded and both sides
          store that decoded value as m[ξ] (in the buffer dtype, or quantized with buffer_bits), so
          later deltas are taken against exactly what the receiver holds; a sample the buffer keeps
          out (never read back) is sent whole at every visit, through the `transient_visit` codec
          (default: the `first_visit` one), and stored nowhere;
          later visits send Q(a - m[ξ]), both sides set m[ξ] += deQ(Q(a - m[ξ])) and the
          receiver computes with m[ξ]. In a one-epoch fine-tune every visit is a first visit.
Backward modes: none, direct (Q of the gradient w.r.t. the boundary activation), hadamard (the same
after the rotation).
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .buffers import BufferRangeError, SampleBuffer, positions
from .hadamard import block_size, random_signs, rotate, unrotate
from .quantizer import (QuantizedTensor, check_bits, check_finite, check_float, check_scale_dtype,
                        dequantize, quantize)
from .running_base import BASES, RunningBase
from .whole_rows import WholeRows

FORWARD_MODES = ("none", "direct", "hadamard", "aqsgd")
BACKWARD_MODES = ("none", "direct", "hadamard")
FIRST_VISIT_MODES = ("none", "direct", "hadamard")  # cache-free codecs for AQ-SGD's whole rows
_FIRST_VISIT_SEED = 1 << 20  # offsets the first-visit codec's dither from the delta quantizer's
_EARLIER_DEFAULTS = {"adaptive": False, "first_visit": "none", "first_visit_bits": None, "first_visit_base": "none",
                     "scale_dtype": "float32"}  # transient_visit: as first_visit (_check_config)


@dataclass(frozen=True)
class Message:
    """What one encode sends: `payload` (flat uint8) crosses the wire, nothing else does.

    `shape` and `dtype` describe the tensor it encodes; a receiver knows them from the
    schedule (or a small header) and rebuilds the Message around the bytes it received.
    `decoded` is the sender's own copy of what the receiver will decode, never sent.
    """

    payload: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    decoded: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _from_raw(buf: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return buf.clone().view(dtype).view(shape)  # clone: the view needs the dtype's alignment


def _check_payload(message: Message, expected: int, why: str) -> None:
    if message.payload.dtype != torch.uint8 or message.payload.dim() != 1:
        raise ValueError(f"payload: expected a 1-D uint8 tensor, got {message.payload.dim()}-D {message.payload.dtype}")
    if message.nbytes != expected:
        raise ValueError(f"payload has {message.nbytes} bytes, expected {expected} {why}")


class _Codec:
    """The `none`, `direct` and `hadamard` modes shared by both directions.

    `rotation_seed` draws hadamard's random signs: both sides of a boundary must pass the same
    (`seed` only drives the sender's rounding dither, so the two sides' may differ). An `adaptive` codec's
    bits and group size are state, not configuration: `set_bits` changes them (both sides between the same
    two messages) and a checkpoint carries the current ones. `scale_dtype` (float32 or bfloat16): what each group's
    min and step travel as (quantizer.quantize).
    """

    modes: tuple[str, ...] = ()

    def __init__(self, mode: str, bits: int | None, stochastic: bool, seed: int, group_size: int | None,
                 rotation_seed: int = 0, adaptive: bool = False, scale_dtype: torch.dtype = torch.float32) -> None:
        if mode not in self.modes:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(self.modes)}")
        if mode != "none" and bits is None:
            raise ValueError(f"mode={mode!r} needs bits (1 to 8)")
        self.mode, self.bits = mode, None if bits is None else check_bits(bits)
        self.stochastic, self.group_size = bool(stochastic), group_size
        self.generator = torch.Generator().manual_seed(int(seed))
        self.rotation_seed = int(rotation_seed)
        self.adaptive = bool(adaptive) and mode != "none"
        self.scale_dtype = check_scale_dtype(scale_dtype)
        self._signs: dict[tuple[int, str], torch.Tensor] = {}  # (row width, device) -> the rotation's signs
        self._flags: list[torch.Tensor] | None = None  # deferred checks (defer_checks); None: each read at once

    def defer_checks(self) -> None:
        """For a caller that encodes only finite values (a pipeline step sends zeros for a NaN) and reads its flags
        together (once, after its schedule): from now on, whether each message's scales are finite (a group's range
        fits float32) stays on the device as a value (`take_checks`) instead of a ValueError read per message, and
        the input is not scanned again. A value that is not finite: the message decodes to garbage, so the caller's step
        must be rejected and undone."""
        self._flags = []

    def take_checks(self) -> list[torch.Tensor]:
        """One 0-dim float per quantized message encoded since the last call, finite where all was well (its largest
        group step: NaN or inf where a group held NaN/inf or spanned more than float32); [] when not deferred."""
        flags = self._flags or []
        if self._flags is not None:
            self._flags = []
        return flags

    def _check_finite(self, x: torch.Tensor, what: str) -> None:
        if self._flags is None:  # deferred: finite by the caller's word
            check_finite(x, what)

    def _rotation(self, width: int, device: torch.device) -> torch.Tensor:
        key = (width, str(device))
        if key not in self._signs:
            self._signs[key] = random_signs(block_size(width), self.rotation_seed).to(device)
        return self._signs[key]

    def _quantize(self, x: torch.Tensor) -> QuantizedTensor:
        q = quantize(x, self.bits, stochastic=self.stochastic, group_size=self.group_size, generator=self.generator,
                     check=self._flags is None, scale_dtype=self.scale_dtype)
        if self._flags is not None:
            self._flags.append(q.largest_step())
        return q

    def _encode_dense(self, x: torch.Tensor) -> Message:
        check_float(x)
        if self.mode == "none":  # raw bytes, no scale a NaN could spoil: NaN/inf are the sender's guard's to stop
            return Message(_raw_bytes(x), x.shape, x.dtype, decoded=x.detach())
        if self.mode == "hadamard":
            self._check_finite(x, type(self).__name__ + " input")  # before the rotation smears a NaN over its block
            signs = self._rotation(x.shape[-1], x.device)
            q = self._quantize(rotate(x.detach(), signs))
            return Message(q.to_bytes(), x.shape, x.dtype, decoded=unrotate(dequantize(q), signs).to(x.dtype))
        q = self._quantize(x)
        return Message(q.to_bytes(), x.shape, x.dtype, decoded=dequantize(q))

    def _dense_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        if self.mode == "none":
            return math.prod(shape) * dtype.itemsize
        return QuantizedTensor.wire_nbytes(shape, self.bits, self.group_size, self.scale_dtype)

    def _decode_dense(self, message: Message) -> torch.Tensor:
        shape = torch.Size(message.shape)
        _check_payload(message, self._dense_nbytes(shape, message.dtype),
                       f"for mode {self.mode!r} and shape {tuple(shape)}")
        if self.mode == "none":
            return _from_raw(message.payload, shape, message.dtype)
        if self.mode == "hadamard":
            q = QuantizedTensor.from_bytes(message.payload, shape, torch.float32, self.bits, self.group_size,
                                           self.scale_dtype)
            return unrotate(dequantize(q), self._rotation(shape[-1], message.payload.device)).to(message.dtype)
        q = QuantizedTensor.from_bytes(message.payload, shape, message.dtype, self.bits, self.group_size,
                                       self.scale_dtype)
        return dequantize(q)

    def set_bits(self, bits: int, group_size: int | None) -> None:
        """The bits and group of the messages from now on (an adaptive codec; both sides alike)."""
        if not self.adaptive:
            raise RuntimeError(f"set_bits on a {self.mode!r} codec built without adaptive=True")
        self.bits, self.group_size = check_bits(bits), group_size

    def _config(self) -> dict[str, Any]:
        config = {"mode": self.mode, "stochastic": self.stochastic, "adaptive": self.adaptive,
                  "scale_dtype": str(self.scale_dtype).removeprefix("torch.")}
        if not self.adaptive:
            config.update(bits=self.bits, group_size=self.group_size)
        if self.mode == "hadamard":
            config["rotation_seed"] = self.rotation_seed
        return config

    def _check_config(self, state: dict[str, Any]) -> None:
        # keys saved before adaptive codecs and first-visit codecs take the values those versions had
        mine, theirs = self._config(), {**_EARLIER_DEFAULTS, **state.get("config", {})}
        theirs.setdefault("transient_visit", theirs["first_visit"])  # before rows kept out had a codec of their own
        diff = [f"{k}: checkpoint {theirs.get(k)!r} vs codec {v!r}" for k, v in mine.items() if theirs.get(k) != v]
        if diff:
            raise ValueError(f"{type(self).__name__} state does not match this codec: " + "; ".join(diff))

    def state_dict(self) -> dict[str, Any]:
        state = {"config": self._config(), "generator": self.generator.get_state()}
        if self.adaptive:
            state["bits"], state["group_size"] = self.bits, self.group_size
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_config(state)
        self.generator.set_state(state["generator"])
        if self.adaptive:
            self.set_bits(state["bits"], state["group_size"])


class RowCodec(_Codec):
    """A cache-free codec for the rows AQ-SGD sends whole (first visits, refreshes): `none`, `direct` or
    `hadamard`; its decoded rows become both sides' buffer rows."""

    modes = FIRST_VISIT_MODES

    def nbytes(self, n: int, sample_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return self._dense_nbytes(torch.Size((n, *sample_shape)), dtype) if n else 0

    def encode(self, rows: torch.Tensor) -> Message:
        if not rows.shape[0]:
            return Message(rows.new_empty(0, dtype=torch.uint8), rows.shape, rows.dtype, decoded=rows)
        return self._encode_dense(rows)

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not shape[0]:
            return torch.empty(shape, dtype=dtype, device=payload.device)
        return self._decode_dense(Message(payload, shape, dtype))


class BackwardCodec(_Codec):
    """Gradient w.r.t. a boundary activation: `none` (as is), `direct` (Q(g)) or `hadamard` (Q(R g))."""

    modes = BACKWARD_MODES

    def __init__(self, mode: str, bits: int | None = None, *, stochastic: bool = True, seed: int = 0,
                 group_size: int | None = None, rotation_seed: int = 0, adaptive: bool = False,
                 scale_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(mode, bits, stochastic, seed, group_size, rotation_seed, adaptive, scale_dtype)

    def encode(self, g: torch.Tensor, sample_ids: Any = None) -> Message:
        """`sample_ids` is accepted for symmetry with ForwardCodec; gradients are not buffered."""
        return self._encode_dense(g)

    def decode(self, message: Message, sample_ids: Any = None) -> torch.Tensor:
        return self._decode_dense(message)

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None) -> int:
        """The payload size `decode` expects: what a receiver allocates before it receives."""
        return self._dense_nbytes(torch.Size(shape), dtype)


class ForwardCodec(_Codec):
    """Activation at a boundary: `none`, `direct`, `hadamard` or `aqsgd` (see the module docstring).

    With `aqsgd`, `num_samples` (dataset size) and `sample_shape` (one sample's activation,
    e.g. (seq_len, hidden)) size the buffer; `buffer_path` puts it in a file instead of RAM
    (each side needs its own file); `buffer_bits` (4 or 8) holds its rows quantized (buffers.py); `buffer_keep`
    (a bool per sample; None: all) names the samples whose rows are kept: the others, never read back, are sent
    whole at every visit and stored nowhere (both sides must pass the same).
    `refresh=True` in encode/decode (both sides alike)
    sends every sample of the micro-batch whole and resets its row: the warm-up epochs.
    `first_visit` (none, direct, hadamard; `first_visit_bits`, `first_visit_group_size`) is how rows
    sent whole travel: `none` in full precision, else cache-free, the decoded rows stored on both sides.
    `transient_visit` (None: as `first_visit`) is how the rows of samples kept out of the buffer travel: they
    are never a later change's base, so `none` for first visits and `hadamard` for these sends a kept sample's
    base exactly and the rest as cheaply as a one-epoch run. `first_visit_base` serves the compressed ones.
    """

    modes = FORWARD_MODES

    def __init__(
        self, mode: str, bits: int | None = None, *, num_samples: int | None = None,
        sample_shape: tuple[int, ...] | None = None, buffer_dtype: torch.dtype = torch.float16,
        buffer_path: str | os.PathLike | None = None, stochastic: bool = True, seed: int = 0,
        group_size: int | None = None, buffer_bits: int | None = None, rotation_seed: int = 0,
        adaptive: bool = False, first_visit: str = "none", first_visit_bits: int | None = None,
        first_visit_group_size: int | None = None, first_visit_base: str = "none",
        scale_dtype: torch.dtype = torch.float32, buffer_keep: torch.Tensor | None = None,
        transient_visit: str | None = None,
    ) -> None:
        super().__init__(mode, bits, stochastic, seed, group_size, rotation_seed, adaptive, scale_dtype)
        self.buffer: SampleBuffer | None = None
        self.whole: WholeRows | None = None  # how rows sent whole travel (first visits, samples kept out)
        self._squares: tuple[Any, Any] = (0.0, 0.0)  # sum ||a - m||^2, sum ||a||^2 over changes sent (take_change)
        if mode == "aqsgd":
            if num_samples is None or sample_shape is None:
                raise ValueError("mode='aqsgd' needs num_samples (dataset size) "
                                 "and sample_shape (one sample's activation)")
            self.buffer = SampleBuffer(num_samples, tuple(sample_shape), buffer_dtype, buffer_path, buffer_bits,
                                       buffer_keep)

            def row_codec(row_mode: str, offset: int) -> RowCodec:  # whole rows take no bits in full precision
                return RowCodec(row_mode, None if row_mode == "none" else first_visit_bits, stochastic,
                                int(seed) + offset, first_visit_group_size, rotation_seed, scale_dtype=scale_dtype)

            first = row_codec(first_visit, _FIRST_VISIT_SEED)
            # the transient codec's dither is the first visits' own stream where those draw none (full precision)
            transient = first if transient_visit in (None, first_visit) else \
                row_codec(transient_visit, _FIRST_VISIT_SEED * (1 if first_visit == "none" else 2))
            if first_visit_base not in BASES:
                raise ValueError(f"first_visit_base={first_visit_base!r}: expected one of {', '.join(BASES)}")
            if first_visit_base != "none" and first.mode == transient.mode == "none":
                raise ValueError(f"first_visit_base={first_visit_base!r}: expected a compressed first visit "
                                 "(first_visit direct or hadamard), not none")
            base = RunningBase(tuple(sample_shape)) if first_visit_base != "none" else None
            self.whole = WholeRows(first, transient, base, self.buffer)
            if self.bits == 1:
                warnings.warn(
                    "aqsgd at 1 bit: min-max quantization then errs by more than the change it sends "
                    "(c_Q > 1; AQ-SGD's convergence theorem needs c_Q < 0.71), so buffer errors compound. "
                    "Use 2 bits with a small group_size, or more bits (benchmarks/RESULTS.md has c_Q by setting).",
                    stacklevel=2,
                )

    # ------------------------------------------------------------------ aqsgd internals
    def _split(self, sample_ids: Any, shape: torch.Size,
               refresh: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validated ids, and the masks of samples sent whole (first visit / refresh) and as deltas."""
        buf = self.buffer
        if len(shape) < 1 or tuple(shape[1:]) != buf.sample_shape:
            raise ValueError(
                f"activation of shape {tuple(shape)}: expected (batch, *sample_shape) with "
                f"sample_shape={buf.sample_shape}"
            )
        ids = buf.check_ids(sample_ids, shape[0])
        whole = torch.ones_like(ids, dtype=torch.bool) if refresh else ~buf.has_row(ids)
        return ids, whole, ~whole

    def _delta_shape(self, n: int) -> torch.Size:
        return torch.Size((n, *self.buffer.sample_shape))

    def _aqsgd_nbytes(self, whole_ids: torch.Tensor, n_delta: int, dtype: torch.dtype) -> int:
        return self.whole.nbytes(whole_ids, dtype) + QuantizedTensor.wire_nbytes(
            self._delta_shape(n_delta), self.bits, self.group_size, self.scale_dtype)

    def _apply(self, ids: torch.Tensor, whole: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor,
               moved: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Both sides: store whole rows, and `moved` (m + change) for the others.

        Returns what the receiver computes with: whole rows as sent, m[ξ] for the others, as `dtype`.
        BufferRangeError, before anything is stored, when a row does not fit the buffer's dtype (deferred checks: the
        buffer's `settle` reports it instead)."""
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

    # ------------------------------------------------------------------ public API
    def encode(self, x: torch.Tensor, sample_ids: Any = None, *, refresh: bool = False) -> Message:
        """Encode micro-batch x (B, *sample_shape) of samples `sample_ids` (B dataset indices)."""
        if self.mode != "aqsgd":
            return self._encode_dense(x)
        check_float(x)
        ids, whole, delta = self._split(sample_ids, x.shape, refresh)
        x = x.detach()
        self._check_finite(x, "activation")
        steady = not bool(whole.any())  # every sample sent as a change: no masks to apply (host bits, no sync)
        rows = x[:0] if steady else x.index_select(0, positions(whole, x.device))
        m = self.buffer.rows(ids[delta], x.device).float()
        moved = (x if steady else x.index_select(0, positions(delta, x.device))).float()
        change = moved - m
        self._squares = (self._squares[0] + torch.linalg.vector_norm(change).square(),
                         self._squares[1] + torch.linalg.vector_norm(moved).square())
        q = self._quantize(change)
        payloads, whole_rows = self.whole.send(rows, ids[whole])  # what the receiver will compute with and store
        decoded = self._apply(ids, whole, delta, whole_rows, dequantize(q, base=m), x.dtype)
        self.whole.fold(whole_rows)
        payload = torch.cat([*payloads, q.to_bytes().to(x.device)])
        return Message(payload, x.shape, x.dtype, decoded=decoded)

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None,
                       *, refresh: bool = False) -> int:
        """The payload size `decode` expects, from this side's own state: what a receiver allocates."""
        shape = torch.Size(shape)
        if self.mode != "aqsgd":
            return self._dense_nbytes(shape, dtype)
        ids, whole, delta = self._split(sample_ids, shape, refresh)
        return self._aqsgd_nbytes(ids[whole], int(delta.sum()), dtype)

    def decode(self, message: Message, sample_ids: Any = None, *, refresh: bool = False) -> torch.Tensor:
        """The tensor the receiving stage computes with (for aqsgd: m[ξ] after this update)."""
        if self.mode != "aqsgd":
            return self._decode_dense(message)
        shape = torch.Size(message.shape)
        ids, whole, delta = self._split(sample_ids, shape, refresh)
        whole_ids, n_delta = ids[whole], int(delta.sum())
        _check_payload(
            message, self._aqsgd_nbytes(whole_ids, n_delta, message.dtype),
            f"for {whole_ids.numel()} whole and {n_delta} delta samples: the two sides' buffers disagree "
            "(a different sample order, a lost message, or refresh on one side only)",
        )
        payload = message.payload
        rows, row_bytes = self.whole.receive(payload, whole_ids, message.dtype)
        q = QuantizedTensor.from_bytes(payload[row_bytes:], self._delta_shape(n_delta), torch.float32,
                                       self.bits, self.group_size, self.scale_dtype)
        m = self.buffer.rows(ids[delta], payload.device).float()
        out = self._apply(ids, whole, delta, rows, dequantize(q, base=m), message.dtype)
        self.whole.fold(rows)
        return out

    def defer_checks(self) -> None:
        """As the other codecs', and the buffer's writes wait for `settle` (SampleBuffer.defer)."""
        super().defer_checks()
        for codec in self._row_codecs():
            codec.defer_checks()
        if self.buffer is not None:
            self.buffer.defer()

    def settle(self) -> BufferRangeError | None:
        """After a step's schedule: the buffer's deferred writes landed; the first row its dtype could not hold (both
        sides find the same), for the caller to report and undo, or None."""
        return self.buffer.settle() if self.buffer is not None else None

    def take_checks(self) -> list[torch.Tensor]:
        return super().take_checks() + [flag for codec in self._row_codecs() for flag in codec.take_checks()]

    def _row_codecs(self) -> list[RowCodec]:
        return [] if self.whole is None else self.whole.codecs()

    def take_change(self) -> tuple[float, float]:
        """(sum of ||a - m||^2, sum of ||a||^2) over the changes encoded since the last call: the root of their ratio
        is the relative change AQ-SGD compresses. Its quantization error scales with it, so it must shrink as
        training settles for AQ-SGD to pay off (dropout's fresh masks keep it up)."""
        change, activation = self._squares
        self._squares = (0.0, 0.0)
        return float(change), float(activation)

    def undo_point(self, sample_ids: Any) -> Callable[[], None]:
        """A function that puts back the buffer rows and seen bits of `sample_ids`, the whole-row codecs' dither and
        the running base as they are now: how a step that must leave no trace (a NaN, an overflow) is undone.
        Nothing to put back without a buffer."""
        if self.buffer is None:
            return lambda: None
        rows = self.buffer.snapshot(self.buffer.check_ids(sample_ids))
        whole = self.whole.undo_point()

        def restore() -> None:
            self.buffer.restore(rows)
            whole()

        return restore

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict[str, Any]:
        config = super()._config()
        if self.buffer is not None:
            config.update(num_samples=self.buffer.num_samples, sample_shape=self.buffer.sample_shape,
                          buffer_dtype=str(self.buffer.dtype), buffer_bits=self.buffer.bits, **self.whole.config())
        return config

    def state_dict(self) -> dict[str, Any]:
        """Config (checked on load), the dither generators, and for aqsgd the buffer's rows and the whole rows' codecs
        and base."""
        state = super().state_dict()
        if self.buffer is not None:
            state.update(buffer=self.buffer.state_dict(), **self.whole.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.buffer is not None:
            self.buffer.load_state_dict(state["buffer"])
            self.whole.load_state_dict(state)
