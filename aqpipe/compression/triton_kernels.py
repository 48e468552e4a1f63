"""The quantizer's GPU kernels in Triton: bit-identical to the C kernels and the torch twins (kernels.py).

One launch per quantize where a group fits a program (a multiple of 8 elements, at most FUSED_MAX: rows of a hidden
size, groups of 64 or 128): `_quantize_groups` reads ROWS whole groups once, reduces each to its range, computes its
scale in float64 as the torch twin does, and quantizes and packs from the same registers. The read of x is the
kernel's only large traffic, so it runs near copy bandwidth. Other group sizes take three launches:
- `_group_range`: each group's min and max (a NaN min where the group holds NaN or inf), ROWS groups a program,
  COLS columns at a time (groups of 64: 64 of them a program; rows of 4096: 4 loops of 1024); groups wider than
  WIDE take torch's reductions, which split a group over the GPU;
- the scales, `levels / span` in float64 rounded to float32, in torch ops on the per-group vectors (tiny): the same
  expression as the torch twin, so the same bits;
- `_quantize_pack`: per element (x - min) * inv + dither, clamped and truncated, then 8 codes at a time packed into
  `bits` bytes of the little-endian stream (code i holds bits [i*b, (i+1)*b)), the packing of native/quant.c.
`_dequantize` unpacks 8 codes a word and writes code * step + min, plus an optional base (AQ-SGD's m + change).

Kernels launch with `enable_fp_fusion=False`: a fused multiply-add rounds once where the CPU rounds twice, the
one float difference the kernels would otherwise have. The dither is the C kernel's counter hash in uint32
arithmetic, its key passed as int32 bit patterns. Under TRITON_INTERPRET=1 (set before this module is imported,
and `kernels.configure(interpret=True)`) the same kernels run on CPU tensors, which is how CI tests them.
Importing this module imports triton: kernels.py does so only when it is chosen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .group_math import group_ranges, group_steps, inverse_steps, packed_nbytes

BLOCK = 1024  # elements a program quantizes or decodes: 128 words of 8 codes
TILE = 4096  # elements a program reduces at a time: COLS of a group (at most 1024, looping over wider groups)
# in each of ROWS groups
WIDE = 1 << 16  # groups wider than this take their ranges from torch's split reductions
FUSED_MAX = 4096  # widest group `_quantize_groups` holds in one program's registers
FUSED_TILE = 2048  # elements a fused program holds: ROWS groups of COLS (a power of two >= the group size)
FUSED_WARPS = 4  # warps of a fused program (bench_quantize --sweep picked both on an H200)
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # inverse_steps()' clamp


def _int32(k: int) -> int:
    """A 32-bit key word as the int32 with its bits (one argument type for every key)."""
    return k - (1 << 32) if k >= 1 << 31 else k


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _dither(idx, k0, k1):
    """Uniform [0, 1) for element `idx` under key (k0, k1): dither() of native/quant.c."""
    i = idx.to(tl.uint32)  # the index modulo 2**32, as the C kernel's cast
    h = _mix32(i * 0x9E3779B9 + k0.to(tl.uint32)) ^ k1.to(tl.uint32)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _level(v, idx, k0, k1, levels, STOCHASTIC: tl.constexpr):
    """A scaled value, (x - min) * inv, plus the dither (or 0.5) and clamped to [0, levels]: its code, truncated."""
    if STOCHASTIC:
        v = v + _dither(idx, k0, k1)
    else:
        v = v + 0.5
    return tl.minimum(tl.maximum(v, 0.0), levels)


@triton.jit
def _group_range(x_ptr, mins_ptr, maxs_ptr, n, gs, groups, ROWS: tl.constexpr, COLS: tl.constexpr,
                 LOOPS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < groups
    lo = tl.full([ROWS], float("inf"), tl.float32)
    hi = tl.full([ROWS], float("-inf"), tl.float32)
    bad = tl.zeros([ROWS], tl.int32)
    for loop in range(LOOPS):  # a constexpr trip count: Triton 3.6's interpreter cannot loop to a runtime bound
        cols = loop * COLS + tl.arange(0, COLS)
        idx = rows[:, None] * gs + cols[None, :]
        m = live[:, None] & (cols[None, :] < gs) & (idx < n)
        v = tl.load(x_ptr + idx, mask=m, other=0.0)
        finite = tl.abs(v) < float("inf")  # false for NaN and inf
        bad = tl.maximum(bad, tl.max((m & ~finite).to(tl.int32), axis=1))
        lo = tl.minimum(lo, tl.min(tl.where(m, v, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(m, v, float("-inf")), axis=1))
    tl.store(mins_ptr + rows, tl.where(bad > 0, float("nan"), lo), mask=live)
    tl.store(maxs_ptr + rows, hi, mask=live)


@triton.jit(do_not_specialize=["k0", "k1"])
def _quantize_groups(x_ptr, mins_ptr, steps_ptr, out_ptr, n, gs, groups, nbytes, k0, k1, levels,
                     BITS: tl.constexpr, STOCHASTIC: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr,
                     LANES: tl.constexpr, WORD32: tl.constexpr):
    """ROWS whole groups of gs in one read, as [ROWS, WORDS, LANES] (a word: LANES codes): range, scale, codes and
    packing from registers. WORD32: a word is 32 bits of the stream (LANES = 32 / BITS), stored as one int32 into
    out_ptr viewed as int32 (gs * BITS a multiple of 32, so a row starts on a word); else a word is 8 codes, BITS
    bytes stored one byte at a time."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    word = tl.arange(0, WORDS)
    lane = tl.arange(0, LANES)
    col = word[None, :, None] * LANES + lane[None, None, :]
    idx = rows[:, None, None] * gs + col
    live = rows < groups
    m = live[:, None, None] & (col < gs) & (idx < n)
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    finite = tl.abs(x) < float("inf")  # false for NaN and inf
    bad = tl.max(tl.max((m & ~finite).to(tl.int32), axis=2), axis=1)
    lo = tl.where(bad > 0, float("nan"), tl.min(tl.min(tl.where(m, x, float("inf")), axis=2), axis=1))
    hi = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=2), axis=1)
    span = hi - lo
    tl.store(mins_ptr + rows, lo, mask=live)
    # group_steps(): span / levels, correctly rounded (as the float32 division: float64 holds the quotient exactly
    # enough that rounding it to float32 rounds once)
    tl.store(steps_ptr + rows, (span.to(tl.float64) / ((1 << BITS) - 1)).to(tl.float32), mask=live)
    # inverse_steps(): levels / span in float64, rounded once; 0 for an empty or bad span
    ratio = tl.minimum(((1 << BITS) - 1) / span.to(tl.float64), _FLOAT32_MAX).to(tl.float32)
    inv = tl.where(span > 0, ratio, 0.0)
    v = _level((x - lo[:, None, None]) * inv[:, None, None], idx, k0, k1, levels, STOCHASTIC)
    if WORD32:
        codes = tl.where(m, v.to(tl.int32), 0).to(tl.uint32)  # v >= 0: truncation is the floor, as the C cast
        packed = tl.sum(codes << (lane * BITS).to(tl.uint32)[None, None, :], axis=2)  # disjoint bits: an or
        pos = rows[:, None] * (gs // LANES) + word[None, :]
        first = rows[:, None] * gs + word[None, :] * LANES  # the word's first element
        tl.store(out_ptr + pos, packed.to(tl.int32, bitcast=True), mask=live[:, None] & (word[None, :] * LANES < gs)
                 & (first < n))
    else:
        codes = tl.where(m, v.to(tl.int32), 0).to(tl.int64)
        packed = tl.sum(codes << (lane[None, None, :] * BITS), axis=2)  # 8 codes: BITS bytes of the stream
        pos = (rows[:, None, None] * (gs // 8) + word[None, :, None]) * BITS + lane[None, None, :]
        out = (packed[:, :, None] >> (lane[None, None, :] * 8)) & 0xFF
        keep = (lane[None, None, :] < BITS) & (word[None, :, None] * 8 < gs) & live[:, None, None]
        tl.store(out_ptr + pos, out.to(tl.uint8), mask=keep & (pos < nbytes))


@triton.jit(do_not_specialize=["k0", "k1"])  # a key of 1 would become a constant; any other, a new variant
def _quantize_pack(x_ptr, mins_ptr, invs_ptr, out_ptr, n, gs, nbytes, k0, k1, levels, BITS: tl.constexpr,
                   STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    WORDS: tl.constexpr = BLOCK // 8
    word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    lane = tl.arange(0, 8)
    idx = word[:, None] * 8 + lane[None, :]
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    g = idx // gs
    v = (x - tl.load(mins_ptr + g, mask=m, other=0.0)) * tl.load(invs_ptr + g, mask=m, other=0.0)
    v = _level(v, idx, k0, k1, levels, STOCHASTIC)
    codes = tl.where(m, v.to(tl.int64), 0)  # v >= 0: truncation is the floor, as the C cast
    packed = tl.sum(codes << (lane[None, :] * BITS), axis=1)  # the codes' bits are disjoint: the sum is an or
    pos = word[:, None] * BITS + lane[None, :]
    out = (packed[:, None] >> (lane[None, :] * 8)) & 0xFF
    tl.store(out_ptr + pos, out.to(tl.uint8), mask=(lane[None, :] < BITS) & (pos < nbytes))


@triton.jit
def _dequantize(packed_ptr, mins_ptr, steps_ptr, base_ptr, out_ptr, n, gs, nbytes, BITS: tl.constexpr,
                HAS_BASE: tl.constexpr, BLOCK: tl.constexpr):
    WORDS: tl.constexpr = BLOCK // 8
    word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    lane = tl.arange(0, 8)
    pos = word[:, None] * BITS + lane[None, :]
    raw = tl.load(packed_ptr + pos, mask=(lane[None, :] < BITS) & (pos < nbytes), other=0).to(tl.int64)
    packed = tl.sum(raw << (lane[None, :] * 8), axis=1)
    idx = word[:, None] * 8 + lane[None, :]
    m = idx < n
    codes = (packed[:, None] >> (lane[None, :] * BITS)) & ((1 << BITS) - 1)
    g = idx // gs
    v = codes.to(tl.float32) * tl.load(steps_ptr + g, mask=m, other=0.0)
    v = v + tl.load(mins_ptr + g, mask=m, other=0.0)
    if HAS_BASE:
        v = tl.load(base_ptr + idx, mask=m, other=0.0) + v
    tl.store(out_ptr + idx, v, mask=m)


def quantize_flat(flat: torch.Tensor, gs: int, bits: int, key: tuple[int, int] | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.quantize_flat on Triton: (packed codes, mins, steps)."""
    n = flat.numel()
    groups = -(-n // gs)
    nbytes = packed_nbytes(n, bits)
    levels = (1 << bits) - 1
    k0, k1 = (_int32(k) for k in key) if key is not None else (0, 0)
    if gs % 8 == 0 and gs <= FUSED_MAX:
        mins = torch.empty(groups, dtype=torch.float32, device=flat.device)
        steps = torch.empty_like(mins)
        cols = triton.next_power_of_2(gs)
        word32 = 32 % bits == 0 and gs * bits % 32 == 0
        lanes = 32 // bits if word32 else 8
        # 32-bit words store into an int32 view of a buffer rounded up to whole words
        out = torch.empty(-(-nbytes // 4) * 4 if word32 else nbytes, dtype=torch.uint8, device=flat.device)
        packed = out[:nbytes]
        out = out.view(torch.int32) if word32 else out
        rows = max(1, FUSED_TILE // cols)
        _quantize_groups[(triton.cdiv(groups, rows),)](flat, mins, steps, out, n, gs, groups, nbytes, k0, k1,
                                                        float(levels), BITS=bits, STOCHASTIC=key is not None,
                                                        ROWS=rows, WORDS=cols // lanes, LANES=lanes, WORD32=word32,
                                                        enable_fp_fusion=False, num_warps=FUSED_WARPS)
        return packed, mins, steps
    if gs > WIDE:  # a few wide groups: one program each would read them serially; torch's reductions split them
        mins, maxs = group_ranges(flat, gs)
    else:
        mins = torch.empty(groups, dtype=torch.float32, device=flat.device)
        maxs = torch.empty_like(mins)
        cols = min(1024, triton.next_power_of_2(gs))
        _group_range[(triton.cdiv(groups, TILE // cols),)](flat, mins, maxs, n, gs, groups, ROWS=TILE // cols,
                                                            COLS=cols, LOOPS=triton.cdiv(gs, cols))
    packed = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    invs = inverse_steps(mins, maxs, bits)  # the other implementations' own expression: the same scales
    _quantize_pack[(triton.cdiv(n, BLOCK),)](flat, mins, invs, packed, n, gs, nbytes, k0, k1, float(levels),
                                              BITS=bits, STOCHASTIC=key is not None, BLOCK=BLOCK,
                                              enable_fp_fusion=False)
    return packed, mins, group_steps(mins, maxs, bits)


def dequantize_flat(packed: torch.Tensor, n: int, gs: int, bits: int, mins: torch.Tensor, steps: torch.Tensor,
                    base: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.dequantize_flat on Triton: n float32 values, plus `base` (flat float32) where given."""
    out = torch.empty(n, dtype=torch.float32, device=packed.device)
    _dequantize[(triton.cdiv(n, BLOCK),)](packed.contiguous(), mins, steps, base if base is not None else out, out,
                                          n, gs, packed.numel(), BITS=bits, HAS_BASE=base is not None, BLOCK=BLOCK,
                                          enable_fp_fusion=False)
    return out
