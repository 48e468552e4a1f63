"""bfloat16 scales (quantizer.quantize(scale_dtype=torch.bfloat16)): each group's min and step are values bfloat16
holds, chosen so the levels still cover the group (min rounded down, step up), so stochastic rounding stays
unbiased; they travel as 4 bytes a group instead of 8, and both sides of a codec decode the same values."""
import pytest
import torch

from aqpipe.compression import BackwardCodec, forward_codec, QuantizedTensor, dequantize, quantize
from aqpipe.compression.group_math import bfloat16_down, bfloat16_up

BF16 = torch.bfloat16


def test_rounding_down_and_up_land_on_the_nearest_bfloat16_on_each_side():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-30, 30, (20000,), generator=g).float()
    v = torch.cat([v, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.0e38, -3.0e38])])
    down, up = bfloat16_down(v), bfloat16_up(v)
    assert (down <= v).all() and (up >= v).all()
    assert torch.equal(down.to(BF16).float(), down) and torch.equal(up.to(BF16).float(), up)
    nearest = v.to(BF16).float()  # one of the two...
    assert ((nearest == down) | (nearest == up)).all()
    below = down.to(BF16)  # ...and nothing bfloat16 holds lies between them: up is down or the next value above it
    above = torch.nextafter(below, torch.full_like(below, float("inf"))).float()
    assert ((up == down) | (up == above)).all()
    special = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert torch.equal(bfloat16_down(special)[1:], special[1:]) and bfloat16_down(special)[0].isnan()


@pytest.mark.parametrize("bits,group", [(2, 64), (3, None), (4, None), (8, 32)])
def test_scales_are_bfloat16_values_and_every_element_decodes_within_a_step(bits, group):
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits)) * 5 + 2
    q = quantize(x, bits, group_size=group, generator=torch.Generator().manual_seed(0), scale_dtype=BF16)
    assert torch.equal(q.mins.to(BF16).float(), q.mins) and torch.equal(q.steps.to(BF16).float(), q.steps)
    wire = q.to_bytes()
    groups = q.mins.numel()
    assert wire.numel() == q.nbytes == QuantizedTensor.wire_nbytes(x.shape, bits, group, BF16)
    assert wire.numel() == QuantizedTensor.wire_nbytes(x.shape, bits, group) - 4 * groups
    back = QuantizedTensor.from_bytes(wire, x.shape, x.dtype, bits, group, BF16)
    assert torch.equal(dequantize(back), dequantize(q))
    steps = q.steps.repeat_interleave(group or 256).view(x.shape)
    assert ((dequantize(q) - x).abs() <= steps * (1 + 1e-6)).all()


def test_rounding_stays_unbiased_where_a_min_far_from_zero_moves_a_whole_step():
    """bfloat16 values near 1000 are 4 apart: a group in [1002.5, 1003.5] rounded to the nearest (1004) would decode
    nothing below it, half a unit off on average; rounded down (1000) its levels still cover it."""
    x = torch.linspace(1002.5, 1003.5, 64).view(1, 64)
    g = torch.Generator().manual_seed(0)
    mean = sum(dequantize(quantize(x, 3, generator=g, scale_dtype=BF16)) for _ in range(400)) / 400
    assert (mean - x).abs().max() < 0.1


def test_the_error_matches_float32_scales_at_3_and_4_bits():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    for bits in (3, 4):
        err = {d: float((dequantize(quantize(x, bits, generator=torch.Generator().manual_seed(2), scale_dtype=d))
                         - x).norm() / x.norm()) for d in (torch.float32, BF16)}
        assert err[BF16] < err[torch.float32] * 1.03, (bits, err)


def test_codecs_with_bfloat16_scales_send_fewer_bytes_and_both_sides_agree():
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(4)
    sizes = {}
    for dtype in (torch.float32, BF16):
        kw = dict(num_samples=4, sample_shape=(8, 64), first_visit="hadamard", first_visit_bits=3, scale_dtype=dtype)
        sender, receiver = forward_codec("aqsgd", 2, **kw), forward_codec("aqsgd", 2, **kw)
        for step in range(3):  # a first visit, then changes
            msg = sender.encode(x + step, ids)
            assert msg.nbytes == receiver.payload_nbytes(x.shape, x.dtype, ids)
            assert torch.equal(receiver.decode(msg, ids), msg.decoded)
        assert torch.equal(sender.buffer.rows(ids, "cpu"), receiver.buffer.rows(ids, "cpu"))
        sizes[dtype] = msg.nbytes
        back = BackwardCodec("direct", 4, scale_dtype=dtype)
        msg = back.encode(x)
        assert torch.equal(back.decode(msg), msg.decoded)
    assert sizes[BF16] == sizes[torch.float32] - 4 * 4 * 8  # a change per token: 4 of its 8 scale bytes saved


def test_a_checkpoint_names_a_different_scale_dtype_and_earlier_ones_load_as_float32():
    codec = BackwardCodec("direct", 4, scale_dtype=BF16)
    state = BackwardCodec("direct", 4).state_dict()
    with pytest.raises(ValueError, match="scale_dtype: checkpoint 'float32' vs codec 'bfloat16'"):
        codec.load_state_dict(state)
    del state["config"]["scale_dtype"]  # saved before the setting
    BackwardCodec("direct", 4).load_state_dict(state)
    with pytest.raises(ValueError, match="scale_dtype=torch.float16: expected one of float32, bfloat16"):
        quantize(torch.ones(4), 4, scale_dtype=torch.float16)


@pytest.mark.parametrize("gs", [256, 64, 7])
@pytest.mark.parametrize("stochastic", [True, False])
def test_the_c_kernels_and_tensor_ops_give_the_same_codes_and_scales(gs, stochastic):
    """Two implementations of bfloat16 scales (Triton's kernels lack them; a GPU tensor takes tensor ops)."""
    from aqpipe.compression import kernels

    flat = torch.randn(3000, generator=torch.Generator().manual_seed(gs)) * 40 - 7
    flat[:64] = 0.0  # a constant group (zero span)
    flat[64:128] = -flat[64:128].abs() - 1e6  # a negative one far from zero
    flat[128:192] = torch.randn(64) * 1e-38  # a span so small its step's inverse would overflow float32
    flat[192:256] = 3.0e38 * torch.rand(64)  # near float32's top
    flat = flat.contiguous()
    key = (12345, 678) if stochastic else None
    if kernels.native_error():
        pytest.fail(f"the C kernels do not build here: {kernels.native_error()}")
    out = {}
    try:
        for backend in ("native", "torch"):
            kernels.configure(backend)
            out[backend] = [kernels.quantize_flat(flat, gs, bits, key, BF16) for bits in (2, 3, 4, 8)]
    finally:
        kernels.configure("auto")
    for native, torch_ops in zip(out["native"], out["torch"]):
        assert all(torch.equal(a, b) for a, b in zip(native, torch_ops))
