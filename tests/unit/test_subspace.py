"""The boundary subspace codec: both sides hold one basis and decode bit for bit what the sender decoded, through
refreshes and a resume; a refresh's basis is in the message's bytes; the backward is the projected forward's
gradient."""
import pytest
import torch

from aqpipe.compression import Message, Subspace, subspace_codecs
from aqpipe.compression.subspace import refresh_step
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory
from tests.helpers.codec_states import reloaded

WIDTH, RANK, SHAPE = 64, 8, (2, 16, 64)  # a micro-batch of 2 samples x 16 tokens x width 64


def side(seed=1):
    return subspace_codecs(RANK, 3, 3, seed=seed, backward_seed=seed + 1)


def wire(message: Message) -> Message:
    return Message(message.payload.clone(), message.shape, message.dtype)


def activations(step: int, mb: int) -> torch.Tensor:
    """A residual stream with a few large directions and a small rest, drifting as a fine-tune's does."""
    g = torch.Generator().manual_seed(100 * step + mb)
    mix = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7))
    strength = torch.logspace(1, -2, WIDTH)
    return (torch.randn(*SHAPE, generator=g) * strength) @ mix * (1 + 0.01 * step)


def run_steps(sender, receiver, steps, first=0, log=None):
    """1F1B on 2 stages with 3 micro-batches: the receiver posts every receive at the step's start; forwards of
    later micro-batches go before backwards of earlier ones. Each decode must equal the sender's own copy."""
    (fwd_s, bwd_r), (fwd_r, bwd_s) = sender, receiver  # stage 0 sends activations, stage 1 gradients
    log = [] if log is None else log
    for step in range(first, first + steps):
        posted = [fwd_r.payload_nbytes(SHAPE, torch.float32) for _ in range(3)]
        sent = [fwd_s.encode(activations(step, mb)) for mb in range(3)]
        assert [m.nbytes for m in sent] == posted
        for mb in range(3):
            got = fwd_r.decode(wire(sent[mb]))
            assert torch.equal(got, sent[mb].decoded)
            g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(999 + step * 3 + mb))
            back = bwd_s.encode(g)
            assert torch.equal(bwd_r.decode(wire(back)), back.decoded)
            log.append((bytes(sent[mb].payload.numpy()), bytes(back.payload.numpy())))
        for codec in (fwd_s, fwd_r):
            codec.end_step()
    return log


def test_both_sides_decode_bit_for_bit_through_refreshes():
    log = run_steps(side(), side(), steps=9)
    firsts = [len(log[3 * step][0]) for step in range(9)]
    plain = len(log[1][0])
    basis = Subspace(RANK).basis_nbytes(WIDTH)
    assert basis == WIDTH * RANK * 2 + RANK * 4
    # steps 0, 1, 2, 4 and 8 carry a basis in their first message, in the bytes the wire counts
    assert firsts == [plain + basis if refresh_step(s) else plain for s in range(9)]
    assert [s for s in range(9) if refresh_step(s)] == [0, 1, 2, 4, 8]
    assert all(len(log[3 * s + mb][0]) == plain for s in range(9) for mb in (1, 2))


def test_below_one_value_per_element_and_near_exact_on_a_low_rank_stream():
    fwd, _ = subspace_codecs(RANK, 8, 8)
    x = torch.randn(4, 16, RANK) @ torch.randn(RANK, 256)  # exactly rank 8, width 256
    message = fwd.encode(x)
    assert float((message.decoded - x).norm() / x.norm()) < 0.02
    fwd.end_step()
    fwd.encode(x)  # step 1 also refreshes; step 2 does
    fwd.end_step()
    fwd.encode(x)
    fwd.end_step()
    plain = fwd.encode(x)  # step 3: coefficients only, 8 bits x 8 a token + a token's scales, 16 bytes
    assert plain.nbytes == 4 * 16 * (RANK + 8)  # 8 values at 8 bits and a token's min and step, float32
    assert plain.nbytes * 8 / x.numel() < 16 / 20  # bits an element: 20x below a bf16 wire


def test_a_refresh_takes_the_top_directions_of_every_row_sent_and_each_ones_root_mean_square():
    """The basis comes from the second moment summed over every message since the start, not the last one's; each
    direction's scale is its root mean square over all those rows (what whitening divides by)."""
    sub = Subspace(3)
    e = torch.eye(WIDTH)
    sign = torch.tensor([1.0, -1.0]).repeat(10).unsqueeze(1)  # 20 rows of +-1
    sub.observe(torch.cat([5 * sign * e[0], 3 * sign * e[1]]))  # a message in directions 0 and 1 (40 rows)
    sub.observe(torch.cat([2 * sign * e[2], 2 * sign[:4] * e[2]]))  # then one in direction 2 alone (24 rows)
    sub.refresh()
    for i in range(3):  # each direction lies in the basis (to bf16's rounding)
        assert float((e[i] @ sub.basis).norm()) == pytest.approx(1.0, abs=1e-2), i
    want = torch.tensor([20 * 25, 20 * 9, 24 * 4]).div(64).sqrt()  # over all 64 rows, the largest first
    torch.testing.assert_close(sub.scales, want, rtol=1e-6, atol=0)


def test_every_refresh_takes_the_top_singular_directions_of_all_rows_sent_so_far():
    """Over 9 steps of 3 messages whose main directions turn from step to step, each refresh (the first message of
    steps 0, 1, 2, 4, 8) adopts the top right singular vectors of every row sent until then, that message's
    included, with each one's root mean square: against numpy's SVD of the stacked rows in float64. Between
    refreshes the basis stays as it was."""
    import numpy as np

    fwd, _ = subspace_codecs(RANK, 8)
    sent, last = [], None
    for step in range(9):
        g = torch.Generator().manual_seed(step)
        turn = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=g))[0]  # this step's directions
        for mb in range(3):
            x = (torch.randn(*SHAPE, generator=g) * torch.logspace(1, -2, WIDTH)) @ turn.T
            fwd.encode(x)
            sent.append(x.reshape(-1, WIDTH).double().numpy())
            basis, scales = fwd.subspace.basis, fwd.subspace.scales
            if mb > 0 or step not in (0, 1, 2, 4, 8):  # the documented clock, written out
                assert torch.equal(basis, last[0]) and torch.equal(scales, last[1]), (step, mb)
                continue
            rows = np.concatenate(sent)
            _, singular, vt = np.linalg.svd(rows, full_matrices=False)
            want = torch.from_numpy(vt[:RANK].T).float()  # width x rank, up to each column's sign
            overlap = (basis.T @ want).abs()
            torch.testing.assert_close(overlap, torch.eye(RANK), atol=2e-2, rtol=0)  # bf16 basis
            torch.testing.assert_close(scales.double(), torch.from_numpy(singular[:RANK] / np.sqrt(len(rows))),
                                       rtol=1e-5, atol=0)
            last = (basis.clone(), scales.clone())
        fwd.end_step()


def test_the_backward_is_the_gradient_of_the_projected_forward():
    fwd, bwd = subspace_codecs(RANK, 8, 8, stochastic=False)
    fwd.encode(activations(0, 0))
    basis = fwd.subspace.basis
    g = torch.randn(SHAPE)
    projected = (g @ basis) @ basis.T  # d/dx of (x U) U^T, applied to g
    decoded = bwd.encode(g).decoded
    assert float((decoded - projected).norm() / projected.norm()) < 0.01
    outside = float((g - projected).norm() / g.norm())
    assert outside > 0.5  # most of a random gradient lies outside 8 of 64 directions, and is not sent
    assert float((decoded - g).norm() / g.norm()) == pytest.approx(outside, abs=0.01)


def test_a_resume_goes_on_as_the_uninterrupted_run():
    straight = run_steps(side(), side(), steps=7)
    sender, receiver = side(), side()
    first = run_steps(sender, receiver, steps=3)
    fresh = side(), side()  # new processes
    reloaded((*sender, *receiver), (*fresh[0], *fresh[1]))
    sender, receiver = fresh
    assert first + run_steps(sender, receiver, steps=4, first=3) == straight  # step 4's refresh included


def test_sides_whose_step_clocks_differ_fail_on_the_first_message_they_disagree_on():
    (fwd_s, _), (fwd_r, _) = side(), side()
    for step in range(3):  # the receiver misses an end_step after step 0: step 1 posts no basis where one comes
        fwd_r.payload_nbytes(SHAPE, torch.float32)
        message = fwd_s.encode(activations(step, 0))
        if step == 1:
            with pytest.raises(ValueError, match="payload has .* bytes"):
                fwd_r.decode(wire(message))
            return
        fwd_r.decode(wire(message))
        fwd_s.end_step()


def test_replicas_draw_their_own_dither_and_a_state_of_another_rank_is_refused():
    factory = [CodecFactory(CompressionConfig(forward="subspace", forward_bits=3, backward="subspace",
                                              backward_bits=3, subspace_rank=RANK), 42, r) for r in (0, 1)]
    codecs = [f.boundary(0, SHAPE[1:], {"forward": 3, "backward": 3}, 8) for f in factory]
    seeds = {c.generator.initial_seed() for pair in codecs for c in pair}
    assert len(seeds) == 4
    (fwd, bwd), _ = codecs
    assert fwd.subspace is bwd.subspace  # one basis for both directions of a side
    other, _ = subspace_codecs(RANK * 2, 3, 3)
    with pytest.raises(ValueError, match="rank"):
        other.load_state_dict(fwd.state_dict())


@pytest.mark.parametrize("settings, match", [
    ({"forward": "direct", "forward_bits": 4, "backward": "subspace", "backward_bits": 3}, "forward_compress subspace"),
    ({"forward": "subspace", "forward_bits": 3, "subspace_rank": 0}, "subspace_rank=0"),
    ({"forward": "subspace", "forward_bits": "auto"}, "forward_bits=auto"),
])
def test_bad_settings_are_refused_in_one_line(settings, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(**settings)


def test_a_rank_wider_than_the_boundary_is_refused_naming_both():
    fwd, _ = subspace_codecs(WIDTH + 1, 3)
    with pytest.raises(ValueError, match=f"subspace_rank={WIDTH + 1}: expected at most the boundary's width, {WIDTH}"):
        fwd.encode(torch.randn(SHAPE))


def test_the_factory_puts_a_tied_weights_gradients_in_a_basis_of_their_own_when_asked():
    from aqpipe.compression import BackwardCodec, QuantizedTensor, SubspaceCodec

    dense = CompressionConfig(forward="direct", forward_bits=4, backward="direct", backward_bits=4, tie_bits=2)
    _, grads = CodecFactory(dense, 1, 0).tie("embed", 1, (100, WIDTH), torch.float32)
    assert type(grads) is BackwardCodec
    ranked = CompressionConfig(forward="direct", forward_bits=4, backward="direct", backward_bits=4, tie_bits=2,
                               tie_rank=RANK)
    _, grads = CodecFactory(ranked, 1, 0).tie("embed", 1, (100, WIDTH), torch.float32)
    assert isinstance(grads, SubspaceCodec) and grads.subspace.rank == RANK and grads.bits == 2
    receiver = CodecFactory(ranked, 1, 0).tie("embed", 1, (100, WIDTH), torch.float32)[1]
    g = torch.randn(30, WIDTH) @ torch.randn(WIDTH, WIDTH)
    receiver.payload_nbytes(g.shape, g.dtype)
    message = grads.encode(g)
    assert torch.equal(receiver.decode(wire(message)), message.decoded)
    # the first step's message: the basis and 8 coefficients a row at 2 bits (a dense 2-bit row holds 64)
    assert message.nbytes == Subspace(RANK).basis_nbytes(WIDTH) + QuantizedTensor.wire_nbytes((30, RANK), 2)
