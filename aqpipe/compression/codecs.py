"""Dense codecs: what crosses a pipeline boundary when no per-sample state is kept, forward and backward.

One codec instance lives on each side of a boundary; the sender calls `encode`, the receiver `decode`.

Modes:
  none    the tensor as is (the FP32 baseline);
  direct  Q(a) (the DirectQ baseline);
  hadamard  Q(R a), decoded as R^T deQ(...): a seeded randomized Hadamard rotation R first spreads
          outliers across each block (hadamard.py), so min-max groups lose less; no buffer, no
          state between steps (for buffers that do not fit, or samples seen once).
AQ-SGD, the codec that keeps a row per sample, is built from these and a buffer: aqsgd.py. A boundary subspace (k
coefficients a token in a basis both sides hold, both directions): subspace.py. `forward_codec` (there)
builds either kind from one set of options.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .hadamard import block_size, random_signs, rotate, unrotate
from .quantizer import (QuantizedTensor, check_bits, check_finite, check_float, check_scale_dtype,
                        dequantize, quantize)

DENSE_MODES = ("none", "direct", "hadamard")
FORWARD_MODES = (*DENSE_MODES, "aqsgd", "subspace")  # subspace: subspace.py, with its gradient codec
BACKWARD_MODES = (*DENSE_MODES, "subspace")
FIRST_VISIT_MODES = DENSE_MODES  # cache-free codecs for AQ-SGD's whole rows
# keys saved before adaptive codecs and first-visit codecs take the values those versions had (transient_visit: as
# first_visit, check_config)
_EARLIER_DEFAULTS = {"adaptive": False, "first_visit": "none", "first_visit_bits": None, "first_visit_base": "none",
                     "scale_dtype": "float32", "feedback": False}


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


def check_payload(message: Message, expected: int, why: str) -> None:
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
    warmup_refresh = False  # a warm-up step sends through the dense fallback (protocol.Codec)

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

    def dither_state(self) -> torch.Tensor:
        """The rounding dither's generator state (a rejected step puts it back: set_dither_state)."""
        return self.generator.get_state()

    def set_dither_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def primable(self) -> bool:
        """A dense codec keeps no per-sample rows to prime (protocol.Codec)."""
        return False

    def prime(self, rows: torch.Tensor) -> None:
        raise RuntimeError(f"prime: a {self.mode!r} codec keeps no per-sample rows")

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

    def check_input(self, x: torch.Tensor, what: str) -> None:
        """ValueError naming `what` where x holds a NaN/inf, unless checks are deferred (finite by the caller's
        word)."""
        if self._flags is None:
            check_finite(x, what)

    def _rotation(self, width: int, device: torch.device) -> torch.Tensor:
        key = (width, str(device))
        if key not in self._signs:
            self._signs[key] = random_signs(block_size(width), self.rotation_seed).to(device)
        return self._signs[key]

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """x quantized at this codec's bits and groups, rounded with its dither (its scales' finiteness kept as a flag
        where checks are deferred)."""
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
            self.check_input(x, type(self).__name__ + " input")  # before the rotation smears a NaN over its block
            signs = self._rotation(x.shape[-1], x.device)
            q = self.quantize(rotate(x.detach(), signs))
            return Message(q.to_bytes(), x.shape, x.dtype, decoded=unrotate(dequantize(q), signs).to(x.dtype))
        q = self.quantize(x)
        return Message(q.to_bytes(), x.shape, x.dtype, decoded=dequantize(q))

    def _dense_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        if self.mode == "none":
            return math.prod(shape) * dtype.itemsize
        return QuantizedTensor.wire_nbytes(shape, self.bits, self.group_size, self.scale_dtype)

    def _decode_dense(self, message: Message) -> torch.Tensor:
        shape = torch.Size(message.shape)
        check_payload(message, self._dense_nbytes(shape, message.dtype),
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

    def config(self) -> dict[str, Any]:
        """What a checkpoint's state must match to load here. Not the seeds: a run's own derive them from its seed,
        which its checkpoint's fingerprint holds, and a resumed codec takes its dither's state as saved."""
        config = {"mode": self.mode, "stochastic": self.stochastic, "adaptive": self.adaptive,
                  "scale_dtype": str(self.scale_dtype).removeprefix("torch.")}
        if not self.adaptive:
            config.update(bits=self.bits, group_size=self.group_size)
        return config

    def state_dict(self) -> dict[str, Any]:
        state = {"config": self.config(), "generator": self.generator.get_state()}
        if self.adaptive:
            state["bits"], state["group_size"] = self.bits, self.group_size
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_config(type(self).__name__, self.config(), state)
        self.load_state(state)

    def load_state(self, state: dict[str, Any]) -> None:
        """The dither's state and an adaptive codec's bits, from a state whose config was checked (by whoever holds
        this codec)."""
        self.generator.set_state(state["generator"])
        if self.adaptive:
            self.set_bits(state["bits"], state["group_size"])


def check_config(owner: str, mine: dict[str, Any], state: dict[str, Any]) -> None:
    """ValueError naming each setting where a codec's saved `state` differs from its `mine`."""
    theirs = {**_EARLIER_DEFAULTS, **state.get("config", {})}
    theirs.setdefault("transient_visit", theirs["first_visit"])  # before rows kept out had a codec of their own
    diff = [f"{k}: checkpoint {theirs.get(k)!r} vs codec {v!r}" for k, v in mine.items() if theirs.get(k) != v]
    if diff:
        raise ValueError(f"{owner} state does not match this codec: " + "; ".join(diff))


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


class DenseCodec(_Codec):
    """A boundary's activation or gradient, with no state between messages: `none` (as is), `direct` (Q(x)) or
    `hadamard` (Q(R x)). Takes a forward codec's sample ids and refresh and needs neither."""

    modes = DENSE_MODES
    buffer = None  # no per-sample rows

    def __init__(self, mode: str, bits: int | None = None, *, stochastic: bool = True, seed: int = 0,
                 group_size: int | None = None, rotation_seed: int = 0, adaptive: bool = False,
                 scale_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(mode, bits, stochastic, seed, group_size, rotation_seed, adaptive, scale_dtype)

    def encode(self, x: torch.Tensor, sample_ids: Any = None, *, refresh: bool = False) -> Message:
        return self._encode_dense(x)

    def decode(self, message: Message, sample_ids: Any = None, *, refresh: bool = False) -> torch.Tensor:
        return self._decode_dense(message)

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None,
                       *, refresh: bool = False) -> int:
        """The payload size `decode` expects: what a receiver allocates before it receives."""
        return self._dense_nbytes(torch.Size(shape), dtype)

    def end_step(self) -> None:
        """Nothing lands after a step: no buffer."""

    def take_change(self) -> tuple[float, float]:
        return 0.0, 0.0

    def undo_point(self, sample_ids: Any) -> Callable[[], None]:
        """Nothing to put back: no buffer."""
        return lambda: None


class ForwardCodec(DenseCodec):
    """The activation at a boundary, dense: none, direct or hadamard (AQ-SGD: aqsgd.AQSGDCodec)."""


class BackwardCodec(DenseCodec):
    """The gradient w.r.t. a boundary activation: none, direct or hadamard."""


def plain_codecs() -> tuple[ForwardCodec, BackwardCodec]:
    """Both directions of a wire as they are (mode none): a boundary's fallbacks (warm-up, evaluation), a tie sent
    uncompressed."""
    return ForwardCodec("none"), BackwardCodec("none")
