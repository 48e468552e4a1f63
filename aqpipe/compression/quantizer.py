"""k-bit min-max quantization with stochastic rounding, packed densely into bytes.

Per group (a row of the last dimension, or `group_size` consecutive elements of the
flattened tensor) the range [min, max] is cut into 2**bits - 1 steps; each element
becomes the code of one of the two levels around it, chosen with probability
proportional to closeness (unbiased), or the nearest one. What a transport sends is
`QuantizedTensor.to_bytes()`: per-group mins and steps (float32, or bfloat16 with `scale_dtype`), then the codes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import kernels
from .fields import check_int
from .group_math import group_ranges

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what a group's min and step travel as


def check_scale_dtype(scale_dtype: torch.dtype) -> torch.dtype:
    if scale_dtype not in SCALE_DTYPES.values():
        raise ValueError(f"scale_dtype={scale_dtype}: expected one of {', '.join(SCALE_DTYPES)}")
    return scale_dtype


def check_bits(bits: int, name: str = "bits") -> int:
    """`bits` if it is an integer from 1 to 8; else ValueError naming it as `name` (a flag, a field)."""
    return check_int(name, bits, 1, 8)


def check_float(x: torch.Tensor, what: str = "x") -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}.dtype={x.dtype}: expected one of float32, float16, bfloat16")


def check_finite(x: torch.Tensor, what: str = "x") -> None:
    """Raise ValueError naming how many elements of x are NaN/inf and where the first is."""
    if bool(torch.isfinite(x).all()):
        return
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    nans = int(torch.isnan(x).sum())
    first = int(bad.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape)) if x.dim() else ()
    raise ValueError(
        f"{what} has {count} non-finite value(s) of {x.numel()} ({nans} NaN, {count - nans} inf), "
        f"the first at index {index}; refusing to encode it"
    )


def _group_size(shape: torch.Size, group_size: int | None) -> int:
    if group_size is None:
        return shape[-1] if len(shape) else 1
    check_int("group_size", group_size, 1, what="a positive integer or None (a row of the last dimension)")
    return group_size


def _num_groups(numel: int, gs: int) -> int:
    return 0 if numel == 0 else -(-numel // gs)


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized tensor: packed codes plus a min and a step per group (float32 values; with `scale_dtype` bfloat16,
    ones bfloat16 holds exactly, and so sent)."""

    codes: torch.Tensor  # uint8, packed_nbytes(numel, bits) bytes
    mins: torch.Tensor  # float32, one per group
    steps: torch.Tensor  # float32, one per group
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int | None = None
    scale_dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exactly the bytes of `to_bytes()`: what a transport sends."""
        return self.codes.numel() + self.scale_dtype.itemsize * (self.mins.numel() + self.steps.numel())

    @staticmethod
    def wire_nbytes(shape: torch.Size | tuple[int, ...], bits: int, group_size: int | None = None,
                    scale_dtype: torch.dtype = torch.float32) -> int:
        """The size of `to_bytes()` for a tensor of `shape`, known before any data (for receive buffers)."""
        shape = torch.Size(shape)
        n = math.prod(shape)
        groups = _num_groups(n, _group_size(shape, group_size))
        return kernels.packed_nbytes(n, check_bits(bits)) + 2 * check_scale_dtype(scale_dtype).itemsize * groups

    def finite(self) -> torch.Tensor:
        """Whether every group's step is finite (its values were finite and their range fits float32), as a 0-dim
        bool on the codes' device: what `quantize(check=False)` leaves to its caller, read with no host sync."""
        return torch.isfinite(self.largest_step())

    def largest_step(self) -> torch.Tensor:
        """The largest group step, 0-dim on the codes' device: NaN or inf exactly where `finite()` is false. One
        reduction where `finite()` takes two: the value a pipeline's codecs leave for their step's one read."""
        return self.steps.amax() if self.steps.numel() else self.steps.new_zeros(())

    def to_bytes(self) -> torch.Tensor:
        """One flat uint8 tensor: mins, steps (`scale_dtype`, native byte order), then the codes."""
        scales = [v.to(self.scale_dtype).view(torch.uint8) for v in (self.mins, self.steps)]
        return torch.cat([*scales, self.codes])

    @classmethod
    def from_bytes(
        cls, buf: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, bits: int,
        group_size: int | None = None, scale_dtype: torch.dtype = torch.float32,
    ) -> "QuantizedTensor":
        """Rebuild from `to_bytes()` output; the metadata travels out of band (both sides know it)."""
        shape = torch.Size(shape)
        expected = cls.wire_nbytes(shape, bits, group_size, scale_dtype)
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"buf: expected a 1-D uint8 tensor, got {buf.dim()}-D {buf.dtype}")
        if buf.numel() != expected:
            raise ValueError(
                f"buf has {buf.numel()} bytes; a {bits}-bit tensor of shape {tuple(shape)} "
                f"(group_size={group_size}, {str(scale_dtype).removeprefix('torch.')} scales) needs {expected}"
            )
        groups = _num_groups(math.prod(shape), _group_size(shape, group_size))
        width = scale_dtype.itemsize * groups
        scales = buf[: 2 * width].clone()  # clone: the scales' views need their dtype's alignment
        return cls(
            codes=buf[2 * width :], mins=scales[:width].view(scale_dtype).float(),
            steps=scales[width:].view(scale_dtype).float(), shape=shape, dtype=dtype, bits=bits,
            group_size=group_size, scale_dtype=scale_dtype,
        )


def quantize(
    x: torch.Tensor, bits: int, *, stochastic: bool = True, group_size: int | None = None,
    generator: torch.Generator | None = None, check: bool = True, scale_dtype: torch.dtype = torch.float32,
) -> QuantizedTensor:
    """Quantize x to `bits` bits per element with min-max scaling per group.

    Every element decodes within one step, (max - min) / (2**bits - 1), of its value;
    stochastic rounding makes the decoded value unbiased. `generator` (or torch's
    default one) supplies the dither key, so a seeded generator reproduces the codes.
    `check=False` skips the one host read (a ValueError for NaN/inf or a range beyond float32): the caller reads
    `finite()` later, with other values (a pipeline step reads all its flags at once), and throws the codes away
    when it is false. `scale_dtype` bfloat16: each group's min and step are ones bfloat16 holds (the min rounded
    down, the step up, so the levels still cover the group and rounding stays unbiased) and travel in 4 bytes, not 8.
    The rounded-down min costs a group far from zero and narrow resolution: its step is at least about
    |min| / 256 / levels, where float32 scales decode a constant group exactly.
    """
    check_bits(bits)
    check_scale_dtype(scale_dtype)
    check_float(x)
    gs = _group_size(x.shape, group_size)
    flat = x.detach().reshape(-1).to(torch.float32).contiguous()
    key = _dither_key(generator, x.device) if stochastic else None
    packed, mins, steps = kernels.quantize_flat(flat, gs, bits, key, scale_dtype)
    # the one host read of a quantize: a step is not finite where its group holds NaN/inf (its min is NaN) or spans
    # more than float32 holds
    if check and mins.numel() and not bool(torch.isfinite(steps).all()):
        if not bool(torch.isfinite(mins).all()):
            check_finite(x)
        g = int((~torch.isfinite(steps)).nonzero()[0, 0])
        lo, hi = (float(v[g]) for v in group_ranges(flat, gs))
        raise ValueError(f"group {g} spans [{lo}, {hi}], wider than float32 can hold")
    return QuantizedTensor(packed, mins, steps, x.shape, x.dtype, bits, group_size, scale_dtype)


def error_constant(bits: int, width: int, group_size: int | None = None, rows: int = 256) -> float:
    """c_Q = E ||x - Q(x)|| / ||x|| over seeded Gaussian rows of `width` (groups: a row, or `group_size`),
    stochastic rounding: the constant AQ-SGD's convergence theorem bounds (c_Q < sqrt(1/2)). Deterministic,
    so every process computes the same value."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(bits))
    y = dequantize(quantize(x, bits, group_size=group_size, generator=torch.Generator().manual_seed(0)))
    return float(((y - x).norm(dim=1) / x.norm(dim=1)).mean())


def dequantize(q: QuantizedTensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """The decoded tensor, in q's shape and dtype; with `base` (float32, q's shape), base + the decoded tensor in
    float32, as AQ-SGD's receiver sets m += change (one pass on a GPU)."""
    gs = _group_size(q.shape, q.group_size)
    if base is not None:
        if base.dtype != torch.float32 or base.shape != q.shape:
            raise ValueError(f"base: expected float32 of shape {tuple(q.shape)}, got {base.dtype} {tuple(base.shape)}")
        base = base.reshape(-1).contiguous()
    flat = kernels.dequantize_flat(q.codes, q.numel, gs, q.bits, q.mins, q.steps, base)
    return flat.view(q.shape) if base is not None else flat.view(q.shape).to(q.dtype)


def _dither_key(generator: torch.Generator | None, device: torch.device) -> tuple[int, int]:
    """Two 32-bit words from the generator: the only randomness the quantizer consumes."""
    gen_device = generator.device if generator is not None else "cpu"
    k = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, generator=generator, device=gen_device)
    return int(k[0]), int(k[1])
