"""What every implementation of the quantizer shares (kernels.py's C and torch paths, triton_kernels.py): groups as
views, the packed size, each group's range with tensor ops, and the scale every implementation multiplies by. A
leaf of the package, so the Triton kernels and the dispatcher that loads them import it and not each other."""
from __future__ import annotations

import torch

_FLOAT32_MAX = torch.finfo(torch.float32).max


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def group_views(flat: torch.Tensor, gs: int) -> list[torch.Tensor]:
    """The full groups as one (G, gs) view, and the partial last group as (1, r) if any."""
    full = flat.numel() // gs
    parts = [flat[: full * gs].view(full, gs)] if full else []
    if flat.numel() > full * gs:
        parts.append(flat[full * gs :].view(1, -1))
    return parts


def group_ranges(flat: torch.Tensor, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (min, max), with tensor ops; a group holding NaN or inf gets min = NaN."""
    parts = group_views(flat, gs)
    mins = torch.empty(sum(p.shape[0] for p in parts), dtype=torch.float32, device=flat.device)
    maxs = torch.empty_like(mins)
    start = 0
    for p in parts:
        lo, hi = torch.aminmax(p, dim=1)
        mins[start : start + p.shape[0]] = torch.where(torch.isfinite(p).all(dim=1), lo, torch.nan)
        maxs[start : start + p.shape[0]] = hi
        start += p.shape[0]
    return mins, maxs


def group_steps(mins: torch.Tensor, maxs: torch.Tensor, bits: int) -> torch.Tensor:
    """(max - min) / levels per group in float32: the step a code decodes by (not finite where the group was).
    A tensor divisor: with a Python number CUDA multiplies by its float32 reciprocal, a last-bit difference from
    the CPU's division in about a third of the groups."""
    span = maxs - mins
    return span / torch.full_like(span, (1 << bits) - 1)


def inverse_steps(mins: torch.Tensor, maxs: torch.Tensor, bits: int) -> torch.Tensor:
    """levels / span per group, divided in float64 and rounded once to float32 (0 for an empty or bad span): the
    scale every implementation multiplies by."""
    span = maxs - mins
    levels = torch.full_like(span, (1 << bits) - 1, dtype=torch.float64)
    ratio = (levels / span.double()).clamp(max=_FLOAT32_MAX).float()
    return torch.where(span > 0, ratio, torch.zeros_like(span))  # NaN span (bad group) -> 0


def bfloat16_down(v: torch.Tensor) -> torch.Tensor:
    """The largest bfloat16 value <= each float32 of `v` (as float32): bfloat16 is float32's top 16 bits, so a cut
    of the low 16 rounds toward zero, which is down for a positive value and, one step further out, for a negative
    one. NaN and inf stay."""
    bits = v.contiguous().view(torch.int32)
    cut = bits & ~0xFFFF
    out = torch.where((v < 0) & (cut != bits), cut + 0x10000, cut).view(torch.float32)
    return torch.where(torch.isfinite(v), out, v)


def bfloat16_up(v: torch.Tensor) -> torch.Tensor:
    """The least bfloat16 value >= each float32 of `v` (as float32)."""
    return -bfloat16_down(-v)


def bfloat16_scales(mins: torch.Tensor, maxs: torch.Tensor,
                    bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, a min and a step that bfloat16 holds exactly and whose levels still cover [min, max]: the min
    rounded down, the step (max - that min) / levels rounded up; and the step's inverse, clamped as `inverse_steps`
    clamps (0 for a zero step). Codes taken against them stay unbiased, and a message carries 2 + 2 bytes a group
    instead of 4 + 4."""
    low = bfloat16_down(mins)
    step = bfloat16_up(group_steps(low, maxs, bits))
    inverse = torch.where(step > 0, (1.0 / step).clamp(max=_FLOAT32_MAX), torch.zeros_like(step))
    return low, step, inverse
