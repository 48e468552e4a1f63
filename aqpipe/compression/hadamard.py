"""A seeded randomized Hadamard rotation: spreads an activation's outliers before it is quantized.

Min-max quantization spends its 2**bits levels on a group's range, so one outlier channel (GPT-2's
hidden states have a few, tens of times the others) leaves every other value a handful of levels.
Rotating each block of n values by H D / sqrt(n) (H the n x n Walsh-Hadamard matrix, D a fixed
diagonal of random signs) mixes every value into all n outputs: the rotated block is close to
Gaussian whatever the outliers, its range a few standard deviations. The rotation is orthonormal and
its own inverse up to D, so decoding is D H y / sqrt(n), and the quantization error keeps its norm.

No state crosses the wire or the steps: both sides draw D from the seed they share. Blocks are the
largest power of two dividing the row (at most MAX_BLOCK); each costs n log2 n additions.
"""
from __future__ import annotations

import math

import torch

MAX_BLOCK = 256  # wider blocks spread outliers further but cost more additions per value


def block_size(width: int, limit: int = MAX_BLOCK) -> int:
    """The rotation's block: the largest power of two that divides `width`, at most `limit`."""
    if width < 1:
        raise ValueError(f"width={width}: expected a positive row width")
    return min(width & -width, limit)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """D: n float32 signs (+1 or -1), from `seed` alone, so both sides of a boundary draw the same."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (n,), generator=g).float().mul_(2).sub_(1)


def _walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x over the last dimension (a power of two), unnormalized: log2 n butterfly passes."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """H D x / sqrt(n) on each block of len(signs) values of x's last dimension, as float32."""
    n = signs.numel()
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // n, n) * signs.to(x.device)
    return (_walsh_hadamard(blocks) / math.sqrt(n)).reshape(x.shape)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The inverse of `rotate`: D H y / sqrt(n) per block, as float32."""
    n = signs.numel()
    blocks = _walsh_hadamard(y.float().reshape(*y.shape[:-1], y.shape[-1] // n, n)) / math.sqrt(n)
    return (blocks * signs.to(y.device)).reshape(y.shape)
