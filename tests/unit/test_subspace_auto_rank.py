"""Auto rank: each refresh's basis has the fewest directions that keep a stated share of the energy sent, within a
bound. The sender chooses it at the step before the refresh and sends it there, so both sides post each message at
its size; the rank and the bytes follow the data, both sides decode bit for bit, and a checkpoint carries it."""
import pytest
import torch

from aqpipe.compression import Message, QuantizedTensor, Subspace, subspace_codecs
from aqpipe.compression.subspace import RANK_BYTES, refresh_step
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory
from tests.helpers.codec_states import reloaded

WIDTH, MOST, SHAPE, MICRO = 64, 16, (2, 16, 64), 3
MIX = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)))[0]


def side(energy=0.99, seed=1):
    return subspace_codecs(MOST, 4, 4, energy=energy, seed=seed, backward_seed=seed + 1)


def wire(message: Message) -> Message:
    return Message(message.payload.clone(), message.shape, message.dtype)


def activations(step: int, mb: int) -> torch.Tensor:
    """Three strong directions until step 4; from step 4 on, ten."""
    g = torch.Generator().manual_seed(100 * step + mb)
    strong = 3 if step < 4 else 10
    strength = torch.cat([torch.full((strong,), 3.0), torch.full((WIDTH - strong,), 0.01)])
    return (torch.randn(*SHAPE, generator=g) * strength) @ MIX.T


def run(sender, receiver, steps, first=0, log=None):
    """The receiver posts each step's receives at its start (both directions), as the transport does; every decode
    equals the sender's own copy."""
    (fwd_s, bwd_r), (fwd_r, bwd_s) = sender, receiver
    log = [] if log is None else log
    for step in range(first, first + steps):
        posted = [fwd_r.payload_nbytes(SHAPE, torch.float32) for _ in range(MICRO)]
        posted_back = [bwd_r.payload_nbytes(SHAPE, torch.float32) for _ in range(MICRO)]
        for mb in range(MICRO):
            out = fwd_s.encode(activations(step, mb))
            assert out.nbytes == posted[mb], (step, mb)
            assert torch.equal(fwd_r.decode(wire(out)), out.decoded)
            back = bwd_s.encode(torch.randn(SHAPE, generator=torch.Generator().manual_seed(9 + step * 3 + mb)))
            assert back.nbytes == posted_back[mb], (step, mb)
            assert torch.equal(bwd_r.decode(wire(back)), back.decoded)
            log.append((fwd_s.subspace.rank, bytes(out.payload.numpy()), bytes(back.payload.numpy())))
        for codec in (*sender, *receiver):
            codec.end_step()
    return log


def test_the_rank_follows_the_data_and_both_sides_post_every_message_at_its_size():
    sender, receiver = side(), side()
    log = run(sender, receiver, 10)
    ranks = [log[MICRO * step][0] for step in range(10)]
    assert ranks[0] == MOST  # the first refresh's, before anything was measured
    assert all(3 <= r <= 4 for r in ranks[1:8])  # three directions hold 99% of the energy
    assert ranks[8] >= 9  # ten from step 4 on: taken at the next refresh, step 8
    for step in range(10):
        rank, fwd, back = log[MICRO * step]
        coefficients = len(log[MICRO * step + 1][1])  # a later message of the step: coefficients alone
        head = (Subspace(rank).basis_nbytes(WIDTH) if refresh_step(step) else 0) + \
            (RANK_BYTES if refresh_step(step + 1) else 0)
        assert len(fwd) == coefficients + head, step
    for step in (5, 9):  # the bytes of both directions follow the rank: a token's 4-bit coefficients and its range
        for direction in (1, 2):
            assert len(log[MICRO * step + 1][direction]) == QuantizedTensor.wire_nbytes((*SHAPE[:-1], ranks[step]), 4)


def test_a_fixed_rank_sends_no_rank_and_keeps_its_rank():
    fixed = subspace_codecs(MOST, 4, 4), subspace_codecs(MOST, 4, 4)
    log = run(*fixed, 9)
    assert {r for r, _, _ in log} == {MOST}
    assert len(log[MICRO * 3][1]) == len(log[MICRO * 3 + 1][1])  # step 3: no rank announced


def test_a_resume_between_the_announcement_and_the_refresh_goes_on_as_the_uninterrupted_run():
    straight = run(side(), side(), 10)
    sender, receiver = side(), side()
    first = run(sender, receiver, 8)  # step 7 announced step 8's rank
    fresh = side(), side()  # new processes
    states = reloaded((*sender, *receiver), (*fresh[0], *fresh[1]))
    sender, receiver = fresh
    assert first + run(sender, receiver, 2, first=8) == straight
    with pytest.raises(ValueError, match="energy"):
        side(energy=0.9)[0].load_state_dict(states[0])


def test_a_rank_outside_the_bound_is_refused_in_one_line():
    (fwd_s, _), (fwd_r, _) = side(), side()
    fwd_r.payload_nbytes(SHAPE, torch.float32)
    message = fwd_s.encode(activations(0, 0))
    payload = message.payload.clone()
    payload[:RANK_BYTES] = torch.tensor([MOST + 1], dtype=torch.int32).view(torch.uint8)  # the rank goes first
    with pytest.raises(ValueError, match=f"a subspace rank of {MOST + 1} arrived: expected 1 to {MOST}"):
        fwd_r.decode(Message(payload, message.shape, message.dtype))


def test_settings_take_auto_with_a_share_and_a_bound():
    config = CompressionConfig(forward="subspace", forward_bits=4, backward="subspace", backward_bits=4,
                               subspace_rank="auto", subspace_energy=0.95, subspace_max_rank=24)
    assert config.subspace() == (24, 0.95)
    forward, backward = CodecFactory(config, 1, 0).boundary(0, SHAPE[1:], {"forward": 4, "backward": 4}, 8)
    assert forward.subspace.most == 24 and forward.subspace.energy == 0.95 and backward.subspace is forward.subspace
    narrow, _ = CodecFactory(config, 1, 0).boundary(0, (16, 20), {"forward": 4, "backward": 4}, 8)
    assert narrow.subspace.most == 20  # the bound is at most the boundary's width
    for bad, match in (({"subspace_energy": 0}, "subspace_energy=0: expected a share in"),
                       ({"subspace_energy": 1.5}, "subspace_energy=1.5"),
                       ({"subspace_max_rank": 0}, "subspace_max_rank=0"),
                       ({"subspace_rank": "most"}, "subspace_rank='most'")):
        settings = {"forward": "subspace", "forward_bits": 4, "subspace_rank": "auto", **bad}
        with pytest.raises(ValueError, match=match):
            CompressionConfig(**settings)
