"""Sparsifiers: the right entries, exact byte counts, composition with the quantizer."""
import pytest
import torch

from aqpipe.compression import QuantizedTensor, dequantize, randk, topk


def test_topk_keeps_the_largest_magnitudes():
    x = torch.tensor([[0.1, -5.0, 2.0], [0.0, 3.0, -0.2]])
    s = topk(x, 3)
    assert sorted(s.indices.tolist()) == [1, 2, 4]
    dense = s.to_dense()
    assert torch.equal(dense, torch.tensor([[0.0, -5.0, 2.0], [0.0, 3.0, 0.0]]))
    assert s.nbytes == 3 * 4 + 3 * 4


def test_randk_is_reproducible_distinct_and_covers_uniformly():
    x = torch.randn(50)
    a = randk(x, 10, generator=torch.Generator().manual_seed(1))
    b = randk(x, 10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.indices, b.indices)
    assert a.indices.unique().numel() == 10
    assert torch.equal(a.to_dense()[a.indices], x[a.indices])
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(50)
    for _ in range(2000):
        counts[randk(x, 10, generator=g).indices] += 1
    assert bool(((counts / 2000 - 0.2).abs() < 0.05).all())


def test_quantized_sparse_values_q_of_comp_k():
    x = torch.randn(1000)
    s = topk(x, 100).quantize(4, generator=torch.Generator().manual_seed(0))
    assert isinstance(s.values, QuantizedTensor)
    assert s.nbytes == 100 * 4 + s.values.nbytes == 400 + 50 + 8
    kept = topk(x, 100).values
    step = float(kept.max() - kept.min()) / 15
    assert float((dequantize(s.values) - kept).abs().max()) <= step * 1.0001
    dense = s.to_dense()
    assert int((dense != 0).sum()) <= 100 and dense.shape == x.shape


@pytest.mark.parametrize("k", [-1, 11, 2.5, True])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match=r"k=.*expected an integer from 0 to x.numel\(\)=10"):
        topk(torch.randn(10), k)


def test_nan_is_refused():
    x = torch.randn(10)
    x[4] = float("nan")
    with pytest.raises(ValueError, match="first at index"):
        randk(x, 3)
