"""A tied weight's rows as AQ-SGD changes in a basis of their own: both sides hold the same copy bit for bit through
the basis's refreshes, whose bytes ride on a step's first message; a row's change travels as k coefficients; what
the basis leaves out stays in the difference and goes later; a checkpoint carries the basis."""
import pytest
import torch

from aqpipe.compression import Message, QuantizedTensor, Subspace, SubspaceRowsCodec, aqsgd_codec
from aqpipe.compression.subspace import refresh_step
from aqpipe.pipeline import CompressionConfig
from aqpipe.pipeline.codec_factory import CodecFactory
from tests.helpers.codec_states import reloaded

ROWS, WIDTH, RANK, BITS = 40, 32, 4, 4
START = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))
DRIFT = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)))[0]


def side(rank=RANK, seed=3):
    codec = SubspaceRowsCodec(aqsgd_codec(BITS, num_samples=ROWS, sample_shape=(WIDTH,), seed=seed,
                                          buffer_dtype=torch.float32), rank)
    codec.prime(START)
    return codec


def wire(message: Message) -> Message:
    return Message(message.payload.clone(), message.shape, message.dtype)


def weights(step: int, directions: int = 2) -> torch.Tensor:
    """The owner's rows after `step` updates: each update in `directions` directions, mostly the first."""
    g = torch.Generator().manual_seed(100 + step)
    moves = torch.randn(ROWS, directions, generator=g) * torch.tensor([1.0, 0.3, 0.1, 0.05][:directions])
    return START + 0.1 * step * moves @ DRIFT[:, :directions].T


def run(owner, follower, steps, first=0, per_step=(range(0, 20), range(15, 40)), make=weights, log=None):
    """Each step the owner sends two messages of rows (overlapping: a row may move twice a step); the follower posts
    both receives at the step's start, as the tie does."""
    log = [] if log is None else log
    for step in range(first, first + steps):
        rows = [torch.tensor(list(r)) for r in per_step]
        posted = [follower.payload_nbytes((len(r), WIDTH), torch.float32, r) for r in rows]
        w = make(step)
        for r, size in zip(rows, posted):
            message = owner.encode(w[r], r)
            assert message.nbytes == size
            got = follower.decode(wire(message), r)
            assert torch.equal(got, message.decoded)
            log.append(bytes(message.payload.numpy()))
        for codec in (owner, follower):
            codec.end_step()
    return log


def test_both_sides_hold_one_copy_through_refreshes_and_the_basis_rides_on_a_steps_first_message():
    owner, follower = side(), side()
    log = run(owner, follower, 9)
    assert torch.equal(owner.buffer.rows(torch.arange(ROWS), "cpu"), follower.buffer.rows(torch.arange(ROWS), "cpu"))
    basis = Subspace(RANK).basis_nbytes(WIDTH)
    coefficients = [QuantizedTensor.wire_nbytes((n, RANK), BITS) for n in (20, 25)]
    assert [len(b) for b in log] == [coefficients[k] + basis * (k == 0 and refresh_step(s)) for s in range(9)
                                     for k in range(2)]
    assert coefficients[0] < QuantizedTensor.wire_nbytes((20, WIDTH), BITS) / 2  # k of a row's WIDTH values


def test_changes_in_a_few_directions_keep_the_copy_within_a_quantization_step():
    owner, follower = side(), side()
    run(owner, follower, 9)
    held, true = follower.buffer.rows(torch.arange(ROWS), "cpu"), weights(8)
    moved = float((true - START).norm())
    assert float((held - true).norm()) < 0.05 * moved  # two directions, rank 4: the copy follows the rows


def test_what_the_basis_leaves_out_stays_in_the_difference_and_goes_once_a_refresh_takes_its_direction():
    """Each row drifts in one direction from step 1, and in another, faster, from step 5. Rank 1: the basis of step
    4 holds only the first, so steps 5-7 leave the second in the difference (not lost: the copy's error is just that
    part); the difference piles up in that direction, step 8's refresh takes it and sends it."""
    pace = torch.randn(ROWS, 2, generator=torch.Generator().manual_seed(5))  # each row's own pace, each direction

    def make(step):
        return START + 0.1 * step * pace[:, :1] * DRIFT[:, 0] + 0.3 * max(0, step - 4) * pace[:, 1:] * DRIFT[:, 1]

    owner, follower = side(rank=1), side(rank=1)
    errors = []
    for step in range(9):
        run(owner, follower, 1, first=step, make=make, per_step=(range(ROWS),))
        errors.append(float((follower.buffer.rows(torch.arange(ROWS), "cpu") - make(step)).norm()))
    left = float(((make(7) - START) @ DRIFT[:, 1]).norm())
    assert errors[7] == pytest.approx(left, rel=0.05)  # the new direction, whole, is what the copy lacks
    assert errors[8] < 0.2 * errors[7]  # the refresh at step 8 took it


def test_a_resume_goes_on_as_the_uninterrupted_run():
    straight = run(side(), side(), 7)
    owner, follower = side(), side()
    first = run(owner, follower, 3)
    fresh = side(), side()  # new processes
    reloaded((owner, follower), fresh)
    owner, follower = fresh
    assert first + run(owner, follower, 4, first=3) == straight  # step 4's refresh included


def test_a_state_of_another_rank_or_of_plain_rows_is_refused():
    with pytest.raises(ValueError, match="rows_rank"):
        side(rank=RANK * 2).load_state_dict(side().state_dict())
    plain = aqsgd_codec(BITS, num_samples=ROWS, sample_shape=(WIDTH,), buffer_dtype=torch.float32)
    with pytest.raises(ValueError, match="rows_rank"):
        side().load_state_dict(plain.state_dict())


def test_the_factory_puts_a_ties_rows_in_a_basis_when_asked():
    config = CompressionConfig(forward="direct", forward_bits=4, backward="direct", backward_bits=4, tie_bits=2,
                               tie_rows_rank=8)
    values, _ = CodecFactory(config, 1, 0).tie("embed", 1, (100, WIDTH), torch.float32)
    assert isinstance(values, SubspaceRowsCodec) and values.subspace.rank == 8 and values.bits == 2
    plain, _ = CodecFactory(CompressionConfig(forward="direct", forward_bits=4, backward="direct", backward_bits=4,
                                              tie_bits=2), 1, 0).tie("embed", 1, (100, WIDTH), torch.float32)
    assert not isinstance(plain, SubspaceRowsCodec)
    with pytest.raises(ValueError, match="tie_rows_rank=-1"):
        CompressionConfig(tie_rows_rank=-1)


def test_a_warm_ups_whole_rows_leave_the_clock_alone_and_the_first_changes_bring_the_first_basis():
    """Warm-up steps send every row whole (refresh): no change, so no tick and no basis on either side; the first
    step of changes is the clock's step 0 and carries the basis, and the copy follows the rows from there."""
    owner, follower = side(), side()
    rows = torch.arange(ROWS)
    for step in range(3):
        posted = follower.payload_nbytes((ROWS, WIDTH), torch.float32, rows, refresh=True)
        message = owner.encode(weights(step), rows, refresh=True)
        assert message.nbytes == posted == ROWS * WIDTH * 4  # whole, in full precision
        follower.decode(wire(message), rows, refresh=True)
        owner.end_step(), follower.end_step()
    assert owner.subspace.steps == follower.subspace.steps == 0 and owner.subspace.basis is None
    log = run(owner, follower, 2, first=3)
    assert len(log[0]) == QuantizedTensor.wire_nbytes((20, RANK), BITS) + Subspace(RANK).basis_nbytes(WIDTH)
    held = follower.buffer.rows(rows, "cpu")
    assert float((held - weights(4)).norm()) < 0.1 * float((weights(4) - START).norm())


def test_a_rank_wider_than_the_tied_weight_is_refused_as_both_sides_build_it():
    for rank in (WIDTH + 1, 0):
        with pytest.raises(ValueError, match=f"tie_rows_rank={rank}: expected 1 to the tied weight's width, {WIDTH}"):
            side(rank=rank)
