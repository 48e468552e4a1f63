"""The C kernels, the Triton kernels (in Triton's interpreter here: tests/conftest.py) and their torch twins give
the same bits; the packed format is a plain bit stream."""
import sys

import pytest
import torch

from aqpipe.compression import dequantize, kernels, quantize

BACKENDS = ["native", "triton", "torch"]


@pytest.fixture
def backend():
    yield lambda name: kernels.configure(backend=name, interpret=True)  # Triton's kernels on CPU tensors
    kernels.configure()  # the default for the tests after


def test_native_kernels_build_here():
    # CI machines have a C compiler: the fast path must not silently fall back.
    assert kernels.native_library() is not None, kernels.native_error()


def both(backend, x, bits, other="torch", **kw):
    out = {}
    for name in ("native", other):
        backend(name)
        q = quantize(x, bits, generator=torch.Generator().manual_seed(11), **kw)
        out[name] = (q, dequantize(q))
    return out["native"], out[other]


@pytest.mark.parametrize("other", ["torch", "triton"])
@pytest.mark.parametrize("bits", range(1, 9))
# 8, 64, 1024: Triton's one-pass kernel (whole groups in a program); 1100: wider than a Triton program's read
@pytest.mark.parametrize("group_size", [None, 1, 5, 8, 13, 64, 300, 1024, 1100])
@pytest.mark.parametrize("stochastic", [True, False])
def test_every_backend_gives_the_native_bits(backend, other, bits, group_size, stochastic):
    x = torch.randn(4, 9, 61, generator=torch.Generator().manual_seed(bits)) * 4
    (qn, yn), (qt, yt) = both(backend, x, bits, other, group_size=group_size, stochastic=stochastic)
    assert torch.equal(qn.codes, qt.codes)
    assert torch.equal(qn.mins, qt.mins) and torch.equal(qn.steps, qt.steps)
    assert torch.equal(yn, yt)


@pytest.mark.parametrize("stochastic", [True, False])
def test_triton_one_pass_gives_the_native_bits_for_rows_of_a_hidden_size(backend, stochastic):
    """Rows of 1600 (GPT2-XL's width) and 2048 (Llama-3.2-1B's), a ragged last group, a NaN group and a flat one."""
    for width in (1600, 2048):
        x = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(width))
        x[1, 2, 7] = float("nan")
        x[2, 0] = 0.25  # a span of 0: scale 0, every code 0
        for bits in (2, 4, 8):
            for kw in ({}, {"group_size": 64}, {"group_size": 2 * width - 64}):
                qs = {}
                for name in ("native", "triton"):
                    backend(name)
                    clean = x.clone()
                    clean[1, 2, 7] = 0.0
                    qs[name] = quantize(clean, bits, generator=torch.Generator().manual_seed(3),
                                        stochastic=stochastic, **kw)
                assert torch.equal(qs["native"].codes, qs["triton"].codes), (width, bits, kw)
                assert torch.equal(qs["native"].mins, qs["triton"].mins) and torch.equal(qs["native"].steps,
                                                                                         qs["triton"].steps)
    with pytest.raises(Exception, match="NaN|non-finite|finite"):
        backend("triton")
        quantize(x, 4, group_size=64)


def test_triton_decodes_onto_a_base_as_the_cpu_adds_after_decoding(backend):
    """AQ-SGD's m + change, in the dequantize kernel's pass: the same float32 sum as the C kernel's decode plus m."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    base = torch.randn(6, 300, generator=torch.Generator().manual_seed(6)) * 10
    backend("native")
    q = quantize(x, 3, group_size=64, generator=torch.Generator().manual_seed(7))
    expected = base + dequantize(q)
    backend("triton")
    assert torch.equal(dequantize(q, base=base), expected)
    with pytest.raises(ValueError, match=r"base: expected float32 of shape \(6, 300\)"):
        dequantize(q, base=base.T)


def test_triton_gives_the_native_bits_for_a_group_wider_than_its_programs_reduce(backend):
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(8))  # one group wider than triton_kernels.WIDE
    (qn, yn), (qt, yt) = both(backend, x, 2, "triton", group_size=70_001)
    assert torch.equal(qn.to_bytes(), qt.to_bytes()) and torch.equal(yn, yt)


def test_triton_takes_cuda_tensors_only_unless_interpreted():
    """A CPU tensor (c_Q's, a CPU stage's) under AQPIPE_KERNELS=triton on a GPU machine keeps the C kernels."""
    kernels.configure(backend="triton")
    try:
        assert kernels.backend_for(torch.zeros(4)) == "native"
        kernels.configure(backend="triton", interpret=True)
        assert kernels.backend_for(torch.zeros(4)) == "triton"
    finally:
        kernels.configure()


def test_threaded_native_path_matches_torch_on_a_large_tensor(backend):
    torch.set_num_threads(2)
    x = torch.randn(64, 1000, 37)  # groups of 37: thread chunks must start on whole bytes
    (qn, yn), (qt, yt) = both(backend, x, 3)
    assert torch.equal(qn.codes, qt.codes) and torch.equal(yn, yt)
    (qn, yn), (qt, yt) = both(backend, x, 5, group_size=100_003)
    assert torch.equal(qn.codes, qt.codes) and torch.equal(yn, yt)


@pytest.mark.parametrize("name", BACKENDS)
def test_packed_format_is_a_little_endian_bit_stream(backend, name):
    backend(name)
    # one group 0..3 at 2 bits: with nearest rounding the codes are exactly 0, 1, 2, 3, 3, 2, 1, 0, 1
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0, 1.0]])
    q = quantize(x, 2, stochastic=False)
    assert q.codes.tolist() == [0b11100100, 0b00011011, 0b01]
    x3 = torch.tensor([[0.0, 7.0, 1.0]])  # 3 bits: codes 0, 7, 1 -> bits 000 111 001
    assert quantize(x3, 3, stochastic=False).codes.tolist() == [0b01111000, 0b0]


@pytest.mark.parametrize("name", BACKENDS)
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
    with pytest.raises(ValueError, match="AQPIPE_KERNELS='gpu': expected one of auto, native, triton, torch"):
        backend("gpu")


def test_triton_asked_for_but_missing_is_one_line(backend, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "aqpipe.compression.triton_kernels", raising=False)
    backend("triton")  # configure() asks again whether Triton imports
    with pytest.raises(RuntimeError, match="AQPIPE_KERNELS=triton but Triton cannot be imported"):
        quantize(torch.randn(4, 8), 2)


def test_cpu_tensors_keep_the_c_kernels_under_auto(backend):
    backend("auto")
    assert kernels.backend_for(torch.zeros(4)) == "native"


def test_the_trainer_refuses_triton_kernels_on_a_machine_without_a_gpu(backend, monkeypatch):
    from aqpipe.environment import configure_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine that has one

    with pytest.raises(ValueError, match="AQPIPE_KERNELS=triton: Triton's kernels need a CUDA GPU"):
        configure_kernels({"AQPIPE_KERNELS": "triton"})
    configure_kernels({"AQPIPE_KERNELS": "triton", "TRITON_INTERPRET": "1"})  # the interpreter runs on CPUs
