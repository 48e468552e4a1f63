"""A subspace backward in a basis of the gradients' own, and error feedback: both sides decode bit for bit through
the gradient basis's refreshes, whose bytes the backward's messages carry; the own basis keeps gradients the
activations' basis drops; error feedback delivers over a run what was sent, less one residual, and its residual is
put back by a rejected step and carried by a checkpoint."""
import pytest
import torch

from aqpipe.compression import Message, Subspace, SubspaceCodec, SubspaceGradCodec, subspace_codecs
from aqpipe.compression.subspace import refresh_step
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory
from tests.helpers.codec_states import reloaded

WIDTH, RANK, SHAPE, MICRO = 64, 8, (2, 16, 64), 3


def side(basis="own", feedback=True, seed=1, bits=3):
    return subspace_codecs(RANK, bits, bits, seed=seed, backward_seed=seed + 1, backward_basis=basis,
                           feedback=feedback)


def wire(message: Message) -> Message:
    return Message(message.payload.clone(), message.shape, message.dtype)


def mixing(seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(seed)))[0]


ACTS, GRADS = mixing(7), mixing(8)  # the activations' directions and the gradients', unrelated


def activations(step: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + mb)
    return (torch.randn(*SHAPE, generator=g) * torch.logspace(1, -2, WIDTH)) @ ACTS.T


def gradient(step: int, mb: int) -> torch.Tensor:
    """A gradient whose energy lies in a few directions of its own (unlike the activations'), with a mean that
    a run's sum is made of."""
    g = torch.Generator().manual_seed(5000 + 100 * step + mb)
    strength = torch.logspace(0.5, -2.5, WIDTH)
    return (torch.randn(*SHAPE, generator=g) * strength + 0.3 * strength) @ GRADS.T


def run_steps(sender, receiver, steps, first=0, log=None, sent=None, applied=None):
    """1F1B on 2 stages with MICRO micro-batches; the receiver of each direction posts its step's receives at the
    step's start, as the transport does. Each decode must equal the sender's own copy; the transport ends every
    codec's step."""
    (fwd_s, bwd_r), (fwd_r, bwd_s) = sender, receiver  # stage 0 sends activations, stage 1 gradients
    log = [] if log is None else log
    for step in range(first, first + steps):
        posted_fwd = [fwd_r.payload_nbytes(SHAPE, torch.float32) for _ in range(MICRO)]
        posted_bwd = [bwd_r.payload_nbytes(SHAPE, torch.float32) for _ in range(MICRO)]
        for mb in range(MICRO):
            out = fwd_s.encode(activations(step, mb))
            assert out.nbytes == posted_fwd[mb]
            assert torch.equal(fwd_r.decode(wire(out)), out.decoded)
            g = gradient(step, mb)
            back = bwd_s.encode(g)
            assert back.nbytes == posted_bwd[mb], (step, mb)
            got = bwd_r.decode(wire(back))
            assert torch.equal(got, back.decoded)
            log.append((bytes(out.payload.numpy()), bytes(back.payload.numpy())))
            if sent is not None:
                sent.append(g), applied.append(got)
        for codec in (*sender, *receiver):
            codec.end_step()
    return log


@pytest.mark.parametrize("feedback", [False, True])
def test_the_gradient_basis_refreshes_on_the_step_clock_in_the_backwards_bytes_both_sides_bit_for_bit(feedback):
    log = run_steps(side(feedback=feedback), side(feedback=feedback), steps=9)
    backward = [len(b) for _, b in log]
    plain = backward[1]
    basis = Subspace(RANK).basis_nbytes(WIDTH)
    assert backward == [plain + basis * (mb == 0 and refresh_step(step)) for step in range(9) for mb in range(MICRO)]


def test_the_own_basis_keeps_the_gradients_the_activations_basis_drops():
    errors = {}
    for basis in ("activations", "own"):
        sent, applied = [], []
        run_steps(side(basis, feedback=False, bits=8), side(basis, feedback=False, bits=8), steps=5, sent=sent,
                  applied=applied)
        g, d = torch.stack(sent[-MICRO:]), torch.stack(applied[-MICRO:])
        errors[basis] = float((d - g).norm() / g.norm())
    assert errors["own"] < 0.45  # 8 of 64 directions with most of the energy, at 8 bits
    assert errors["activations"] > 0.85  # the activations' directions hold little of it


def test_error_feedback_delivers_what_was_sent_summed_over_a_run_less_the_one_residual_kept():
    """Over 20 steps of 3 gradients, the sum the receiver applied equals the sum sent, less the residual the sender
    still keeps, to float32's rounding; without feedback the sum misses what the basis leaves out. What the basis
    leaves out piles up between refreshes and goes at one: step 16's refresh delivers most of what steps 9-15 kept."""
    missed, kept = {}, []
    for feedback in (False, True):
        sender, receiver = side(feedback=feedback), side(feedback=feedback)
        sent, applied = [], []
        for step in range(20):
            run_steps(sender, receiver, steps=1, first=step, sent=sent, applied=applied)
            if feedback:
                kept.append(float(receiver[1].residual.norm()))  # the gradient's sender is stage 1
        total, got = torch.stack(sent).sum(0), torch.stack(applied).sum(0)
        missed[feedback] = float((total - got).norm() / total.norm())
        if feedback:
            torch.testing.assert_close(got + receiver[1].residual, total, rtol=0,
                                       atol=2e-4 * float(total.abs().max()))
    assert missed[False] > 0.2
    assert kept[15] > kept[14] > kept[9] and kept[16] < 0.6 * kept[15]


def test_a_smaller_message_takes_the_residual_where_it_lies_and_leaves_the_rest_for_later():
    fwd, bwd = side()[0], side()[1]
    fwd.encode(torch.randn(2, 16, WIDTH))  # not needed by an own basis; keeps the forward's clock realistic
    bwd.encode(gradient(0, 0))
    kept = bwd.residual.clone()
    small = torch.zeros(1, 8, WIDTH)
    bwd.encode(small)
    assert bwd.residual.shape == kept.shape
    assert torch.equal(bwd.residual[1:], kept[1:]) and torch.equal(bwd.residual[:, 8:], kept[:, 8:])
    assert not torch.equal(bwd.residual[:1, :8], kept[:1, :8])  # sent again, its rest kept anew
    with pytest.raises(ValueError, match="as many dimensions"):
        bwd.encode(torch.zeros(32, WIDTH))


def test_a_rejected_step_puts_the_residual_back():
    """The step guard asks before every message; the step's first snapshot is the one kept, and a step after an
    accepted one snapshots anew."""
    _, bwd = side()
    for step in range(2):
        bwd.encode(gradient(step, 0))
        bwd.end_step()  # an accepted step
        before = bwd.residual.clone()
        restore = [bwd.undo_point(None)]
        bwd.encode(gradient(step, 1))
        restore.append(bwd.undo_point(None))
        bwd.encode(gradient(step, 2))
        assert not torch.equal(bwd.residual, before)
        for undo in reversed(restore):
            undo()
        assert torch.equal(bwd.residual, before), step


def test_a_resume_goes_on_as_the_uninterrupted_run_feedback_and_gradient_basis_included():
    straight = run_steps(side(), side(), steps=7)
    sender, receiver = side(), side()
    first = run_steps(sender, receiver, steps=3)
    fresh = side(), side()  # new processes
    states = reloaded((*sender, *receiver), (*fresh[0], *fresh[1]))
    sender, receiver = fresh
    assert states[3]["residual"] is not None and states[3]["subspace"]["basis"] is not None  # the gradients' sender
    assert first + run_steps(sender, receiver, steps=4, first=3) == straight  # step 4's refreshes included


def test_a_state_saved_with_or_without_feedback_is_refused_by_the_other_and_one_from_before_it_loads():
    with_feedback, without = side()[1], side(feedback=False)[1]
    with pytest.raises(ValueError, match="feedback"):
        without.load_state_dict(with_feedback.state_dict())
    older = side(basis="activations", feedback=False)
    states = [c.state_dict() for c in older]
    del states[1]["config"]["feedback"]  # written before error feedback and auto rank existed
    for key in ("energy", "now", "next"):
        del states[0]["subspace"][key]
    for codec, state in zip(side(basis="activations", feedback=False), states):
        codec.load_state_dict(state)


def test_the_factory_builds_the_backward_in_its_own_basis_with_feedback_as_set():
    config = CompressionConfig(forward="subspace", forward_bits=3, backward="subspace", backward_bits=3,
                               subspace_rank=RANK, backward_basis="own", backward_feedback=True)
    fwd, bwd = CodecFactory(config, 42, 0).boundary(0, SHAPE[1:], {"forward": 3, "backward": 3}, 8)
    assert isinstance(bwd, SubspaceCodec) and bwd.subspace is not fwd.subspace and bwd.feedback
    assert not fwd.feedback  # the forward takes no feedback: its receiver keeps what it decoded
    plain = CompressionConfig(forward="subspace", forward_bits=3, backward="subspace", backward_bits=3)
    _, bwd = CodecFactory(plain, 42, 0).boundary(0, SHAPE[1:], {"forward": 3, "backward": 3}, 8)
    assert isinstance(bwd, SubspaceGradCodec) and not bwd.feedback


@pytest.mark.parametrize("settings, match", [
    ({"forward": "direct", "forward_bits": 4, "backward": "direct", "backward_bits": 4, "backward_basis": "own"},
     "backward_basis='own': expected backward_compress subspace"),
    ({"forward": "subspace", "forward_bits": 4, "backward": "direct", "backward_bits": 4, "backward_feedback": True},
     "backward_feedback=True: expected backward_compress subspace"),
    ({"forward": "subspace", "forward_bits": 4, "backward": "subspace", "backward_bits": 4, "backward_feedback": True},
     "backward_feedback=True: expected backward_basis own"),
    ({"forward": "subspace", "forward_bits": 4, "backward": "subspace", "backward_bits": 4, "backward_basis": "its"},
     "backward_basis='its': expected one of activations, own"),
    ({"forward": "subspace", "forward_bits": 4, "backward": "subspace", "backward_bits": 4,
      "backward_feedback": "yes"}, "backward_feedback='yes': expected true or false"),
])
def test_bad_settings_are_refused_in_one_line(settings, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(**settings)
