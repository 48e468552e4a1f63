"""The quantizer's contract: sizes, error bound, unbiasedness, edge cases, bad input."""
import math

import pytest
import torch

from aqpipe.compression import QuantizedTensor, dequantize, quantize


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def group_steps(x: torch.Tensor, bits: int, group_size=None) -> torch.Tensor:
    """Reference step per element: (max - min) / (2**bits - 1) of its group."""
    flat = x.detach().reshape(-1).float()
    gs = group_size or (x.shape[-1] if x.dim() else 1)
    steps = torch.empty_like(flat)
    for a in range(0, flat.numel(), gs):
        g = flat[a : a + gs]
        steps[a : a + gs] = (g.max() - g.min()) / (2**bits - 1)
    return steps.view(x.shape)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("stochastic", [True, False])
def test_error_within_one_step(bits, stochastic):
    x = torch.randn(6, 5, 37, generator=gen(bits)) * 3 + 1
    q = quantize(x, bits, stochastic=stochastic, generator=gen())
    y = dequantize(q)
    step = group_steps(x, bits)
    bound = step if stochastic else step / 2
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(((y - x).abs() <= bound * (1 + 1e-5) + 1e-6).all())


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
def test_nbytes_is_exactly_the_wire_size(bits):
    x = torch.randn(3, 7, 11)
    q = quantize(x, bits, generator=gen())
    codes = math.ceil(x.numel() * bits / 8)
    groups = 3 * 7
    assert q.nbytes == codes + 8 * groups == q.to_bytes().numel()
    assert QuantizedTensor.wire_nbytes(x.shape, bits) == q.nbytes


def test_two_bits_is_at_most_a_fifteenth_of_fp32():
    x = torch.randn(4, 128, 1600)
    q = quantize(x, 2, generator=gen())
    assert q.nbytes <= x.numel() * 4 / 15


def test_dense_packing_three_bits_is_eight_codes_in_three_bytes():
    q = quantize(torch.randn(2, 8), 3, generator=gen())
    assert q.codes.numel() == 6


def test_stochastic_rounding_is_unbiased():
    x = torch.randn(4, 64, generator=gen(1))
    g = gen(2)
    trials = 4000
    mean = sum(dequantize(quantize(x, 2, generator=g)) for _ in range(trials)) / trials
    step = group_steps(x, 2)
    # each draw errs by at most one step with variance <= step^2/4: the mean's sd <= step / (2 sqrt(trials))
    tolerance = 5 * step / (2 * math.sqrt(trials))
    assert bool(((mean - x).abs() <= tolerance + 1e-6).all())


def test_nearest_rounding_is_biased_where_stochastic_is_not():
    x = torch.full((1, 64), 0.3)
    x[0, 0], x[0, 1] = 0.0, 1.0  # levels at 0, 1/3, 2/3, 1 for 2 bits: 0.3 rounds to 1/3
    near = dequantize(quantize(x, 2, stochastic=False))
    assert torch.allclose(near[0, 2:], torch.full((62,), 1 / 3))
    g = gen(5)
    mean = sum(dequantize(quantize(x, 2, generator=g)) for _ in range(2000)) / 2000
    assert abs(mean[0, 2:].mean().item() - 0.3) < 0.003


def test_generator_makes_it_reproducible():
    x = torch.randn(8, 33)
    a = quantize(x, 3, generator=gen(7))
    b = quantize(x, 3, generator=gen(7))
    c = quantize(x, 3, generator=gen(8))
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)


def test_constant_groups_decode_exactly():
    x = torch.tensor([[2.5] * 10, [-1.0] * 10, [0.0] * 10])
    for bits in (1, 4, 8):
        y = dequantize(quantize(x, bits, generator=gen()))
        assert torch.equal(y, x)
        assert not torch.isnan(y).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_dtypes(dtype):
    x = torch.randn(4, 40).to(dtype)
    q = quantize(x, 4, generator=gen())
    y = dequantize(q)
    assert y.dtype == dtype and y.shape == x.shape
    step = group_steps(x, 4)
    ulp = x.float().abs().max() * torch.finfo(dtype).eps
    assert bool(((y.float() - x.float()).abs() <= step + ulp).all())


def test_non_contiguous_input_matches_its_contiguous_copy():
    base = torch.randn(16, 24)
    x = base.t()[::2]  # non-contiguous, strided
    assert not x.is_contiguous()
    a = dequantize(quantize(x, 3, generator=gen(1)))
    b = dequantize(quantize(x.contiguous(), 3, generator=gen(1)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5), ()])
def test_empty_and_scalar_inputs(shape):
    x = torch.randn(shape)
    q = quantize(x, 2, generator=gen())
    y = dequantize(q)
    assert y.shape == x.shape
    if x.numel():
        assert torch.equal(y, x)  # a lone element is its own constant group
    assert q.to_bytes().numel() == q.nbytes == QuantizedTensor.wire_nbytes(shape, 2)


@pytest.mark.parametrize("group_size", [1, 7, 64, 1000])
def test_group_size_groups_consecutive_elements(group_size):
    x = torch.randn(5, 41) * torch.linspace(0.1, 10, 41)
    q = quantize(x, 3, group_size=group_size, generator=gen())
    assert q.mins.numel() == math.ceil(x.numel() / group_size)
    y = dequantize(q)
    assert bool(((y - x).abs() <= group_steps(x, 3, group_size) * (1 + 1e-5) + 1e-6).all())


def test_bytes_round_trip():
    x = torch.randn(3, 9, 13)
    q = quantize(x, 5, generator=gen())
    buf = q.to_bytes()
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    r = QuantizedTensor.from_bytes(buf, x.shape, x.dtype, 5)
    assert torch.equal(dequantize(r), dequantize(q))
    r = QuantizedTensor.from_bytes(quantize(x, 2, group_size=10, generator=gen()).to_bytes(), x.shape, x.dtype, 2, 10)
    assert r.mins.numel() == math.ceil(x.numel() / 10)


def test_from_bytes_rejects_a_wrong_size():
    q = quantize(torch.randn(4, 8), 2, generator=gen())
    with pytest.raises(ValueError, match=r"has 39 bytes.*needs 40"):
        QuantizedTensor.from_bytes(q.to_bytes()[:-1], (4, 8), torch.float32, 2)


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, True, "4"])
def test_bits_out_of_range(bits):
    with pytest.raises(ValueError, match=r"bits=.*expected an integer from 1 to 8"):
        quantize(torch.randn(4), bits)


@pytest.mark.parametrize("bad,count,nans", [(float("nan"), 2, 2), (float("inf"), 2, 0)])
def test_non_finite_input_is_refused_with_count_and_place(bad, count, nans):
    x = torch.randn(3, 4, 5)
    x[1, 2, 3] = bad
    x[2, 0, 0] = bad
    with pytest.raises(ValueError,
                       match=rf"{count} non-finite value\(s\) of 60 \({nans} NaN.*first at index \(1, 2, 3\)"):
        quantize(x, 4)


def test_huge_range_is_refused_not_decoded_to_nan():
    x = torch.tensor([[-3e38, 3e38]])
    with pytest.raises(ValueError, match="wider than float32"):
        quantize(x, 4)


@pytest.mark.parametrize("x", [torch.tensor([[-3e38, 3e38], [1.0, 2.0]]), torch.tensor([[1.0, 2.0], [float("nan"), 0]]),
                               torch.tensor([[1.0, 2.0], [float("inf"), 0]])], ids=["range", "nan", "inf"])
def test_an_unchecked_quantize_leaves_its_verdict_as_a_flag(x):
    """check=False reads nothing on the host: its caller reads `finite()` with its other flags."""
    q = quantize(x, 4, check=False)
    assert not bool(q.finite()) and q.finite().dim() == 0
    assert not bool(torch.isfinite(q.largest_step())) and q.largest_step().dim() == 0
    fine = quantize(torch.tensor([[1.0, 2.0], [0.0, 0.0]]), 4, check=False)  # a group of zeros: step 0, still fine
    assert bool(fine.finite()) and float(fine.largest_step()) == pytest.approx(1 / 15)


def test_integer_input_and_bad_group_size_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        quantize(torch.arange(10), 4)
    with pytest.raises(ValueError, match="group_size=0"):
        quantize(torch.randn(10), 4, group_size=0)
