"""Top-k and random-k sparsification, composable with the quantizer (Qsparse's Q ∘ Comp_k).

A `SparseTensor` keeps k flat positions of a dense tensor and their values, either
as a plain tensor or, after `.quantize(bits)`, as a `QuantizedTensor`. `nbytes` is
what a transport sends: 4-byte indices (8 when the tensor has more than 2**32
elements) plus the values' bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quantizer import QuantizedTensor, check_finite, check_float, dequantize, quantize
from .fields import is_int


@dataclass(frozen=True)
class SparseTensor:
    indices: torch.Tensor  # int64 positions into the flattened tensor
    values: torch.Tensor | QuantizedTensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def k(self) -> int:
        return self.indices.numel()

    @property
    def index_nbytes(self) -> int:
        return self.k * (4 if math.prod(self.shape) <= 1 << 32 else 8)

    @property
    def nbytes(self) -> int:
        values = self.values
        value_bytes = values.nbytes if isinstance(values, QuantizedTensor) else values.numel() * values.element_size()
        return self.index_nbytes + value_bytes

    def quantize(self, bits: int, *, stochastic: bool = True,
                 generator: torch.Generator | None = None) -> "SparseTensor":
        """Q ∘ Comp_k: the kept values quantized as one group."""
        if isinstance(self.values, QuantizedTensor):
            raise ValueError("values are already quantized")
        q = quantize(self.values, bits, stochastic=stochastic, generator=generator)
        return SparseTensor(self.indices, q, self.shape, self.dtype)

    def dense_values(self) -> torch.Tensor:
        return dequantize(self.values) if isinstance(self.values, QuantizedTensor) else self.values

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(math.prod(self.shape), dtype=self.dtype, device=self.indices.device)
        out[self.indices] = self.dense_values().to(self.dtype)
        return out.view(self.shape)


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    check_float(x)
    if not is_int(k) or not 0 <= k <= x.numel():
        raise ValueError(f"k={k!r}: expected an integer from 0 to x.numel()={x.numel()}")
    check_finite(x)
    return x.detach().reshape(-1)


def topk(x: torch.Tensor, k: int) -> SparseTensor:
    """The k entries of largest magnitude."""
    flat = _check(x, k)
    indices = torch.topk(flat.abs(), k, sorted=False).indices
    return SparseTensor(indices, flat[indices], x.shape, x.dtype)


def randk(x: torch.Tensor, k: int, generator: torch.Generator | None = None) -> SparseTensor:
    """k entries chosen uniformly without replacement (unscaled, as Qsparse uses them with error memory)."""
    flat = _check(x, k)
    device = generator.device if generator is not None else flat.device
    indices = torch.randperm(flat.numel(), generator=generator, device=device)[:k].to(flat.device)
    return SparseTensor(indices, flat[indices], x.shape, x.dtype)
