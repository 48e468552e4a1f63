"""The C kernels and their torch twins give the same bits; the packed format is a plain bit stream."""
import pytest
import torch

from compression import dequantize, kernels, quantize


@pytest.fixture
def backend():
    yield lambda name: kernels.configure(backend=name)
    kernels.configure()  # the default for the tests after


def test_native_kernels_build_here():
    # CI machines have a C compiler: the fast path must not silently fall back.
    assert kernels.native_library() is not None, kernels.native_error()


def both(backend, x, bits, **kw):
    out = {}
    for name in ("native", "torch"):
        backend(name)
        q = quantize(x, bits, generator=torch.Generator().manual_seed(11), **kw)
        out[name] = (q, dequantize(q))
    return out["native"], out["torch"]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group_size", [None, 1, 5, 8, 13, 300])
@pytest.mark.parametrize("stochastic", [True, False])
def test_native_and_torch_are_bit_identical(backend, bits, group_size, stochastic):
    x = torch.randn(4, 9, 29, generator=torch.Generator().manual_seed(bits)) * 4
    (qn, yn), (qt, yt) = both(backend, x, bits, group_size=group_size, stochastic=stochastic)
    assert torch.equal(qn.codes, qt.codes)
    assert torch.equal(qn.mins, qt.mins) and torch.equal(qn.steps, qt.steps)
    assert torch.equal(yn, yt)


def test_threaded_native_path_matches_torch_on_a_large_tensor(backend):
    torch.set_num_threads(2)
    x = torch.randn(64, 1000, 37)  # groups of 37: thread chunks must start on whole bytes
    (qn, yn), (qt, yt) = both(backend, x, 3)
    assert torch.equal(qn.codes, qt.codes) and torch.equal(yn, yt)
    (qn, yn), (qt, yt) = both(backend, x, 5, group_size=100_003)
    assert torch.equal(qn.codes, qt.codes) and torch.equal(yn, yt)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_packed_format_is_a_little_endian_bit_stream(backend, name):
    backend(name)
    # one group 0..3 at 2 bits: with nearest rounding the codes are exactly 0, 1, 2, 3, 3, 2, 1, 0, 1
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0, 1.0]])
    q = quantize(x, 2, stochastic=False)
    assert q.codes.tolist() == [0b11100100, 0b00011011, 0b01]
    x3 = torch.tensor([[0.0, 7.0, 1.0]])  # 3 bits: codes 0, 7, 1 -> bits 000 111 001
    assert quantize(x3, 3, stochastic=False).codes.tolist() == [0b01111000, 0b0]


@pytest.mark.parametrize("name", ["native", "torch"])
def test_non_finite_is_found_by_both(backend, name):
    backend(name)
    x = torch.randn(5, 20)
    x[3, 7] = float("-inf")
    with pytest.raises(ValueError, match=r"first at index \(3, 7\)"):
        quantize(x, 4)


def test_dither_is_uniform_and_key_dependent():
    u = kernels.dither(200_000, (123, 456))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.005).all())
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01  # neighbours decorrelated
    assert not torch.equal(u, kernels.dither(200_000, (124, 456)))


def test_unknown_backend_is_refused(backend):
    with pytest.raises(ValueError, match="AQPIPE_KERNELS='gpu': expected one of auto, native, torch"):
        backend("gpu")
