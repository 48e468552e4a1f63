"""Schedules as data: every stage's list runs together without deadlock, in a valid order."""
import pytest

from pipeline import schedule as sched


@pytest.mark.parametrize("name", sched.SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 5, 8])
def test_schedules_complete_and_order_forward_before_backward(name, stages, micro):
    lists = [sched.train_schedule(name, s, stages, micro) for s in range(stages)]
    order = sched.simulate(lists)
    for s in range(stages):
        ops = [a for st, a in order if st == s]
        assert sorted(a.micro_batch for a in ops if a.op == sched.FORWARD) == list(range(micro))
        assert sorted(a.micro_batch for a in ops if a.op == sched.BACKWARD) == list(range(micro))
        for mb in range(micro):
            assert ops.index(sched.Action(sched.FORWARD, mb)) < ops.index(sched.Action(sched.BACKWARD, mb))
    # a backward on stage s needs the gradient from s+1: globally, (s+1)'s backward of mb comes first
    when = {(s, a): i for i, (s, a) in enumerate(order)}
    for s in range(stages - 1):
        for mb in range(micro):
            assert when[(s + 1, sched.Action(sched.BACKWARD, mb))] < when[(s, sched.Action(sched.BACKWARD, mb))]


@pytest.mark.parametrize("stages,micro", [(2, 8), (4, 8), (4, 2), (3, 5)])
def test_1f1b_keeps_at_most_stages_minus_index_in_flight(stages, micro):
    for s in range(stages):
        assert sched.in_flight(sched.one_f_one_b(s, stages, micro)) == min(stages - s, micro)
        assert sched.in_flight(sched.gpipe(s, stages, micro)) == micro


def test_1f1b_alternates_in_steady_state():
    ops = [a.op for a in sched.one_f_one_b(0, 2, 4) if a.op in (sched.FORWARD, sched.BACKWARD)]
    assert ops == ["forward", "forward", "backward", "forward", "backward", "forward", "backward", "backward"]


def test_first_and_last_stage_do_not_talk_past_the_ends():
    first, last = sched.gpipe(0, 3, 2), sched.gpipe(2, 3, 2)
    assert not any(a.op in (sched.RECV_ACT, sched.SEND_GRAD) for a in first)
    assert not any(a.op in (sched.SEND_ACT, sched.RECV_GRAD) for a in last)


def test_simulate_finds_a_mismatched_order():
    lists = [sched.gpipe(0, 2, 2), sched.gpipe(1, 2, 2)]
    lists[1] = [sched.Action(a.op, 1 - a.micro_batch) for a in lists[1]]  # stage 1 expects mb 1 first
    with pytest.raises(RuntimeError, match="expected"):
        sched.simulate(lists)


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        sched.train_schedule("zigzag", 0, 2, 2)
    with pytest.raises(ValueError, match="num_micro_batches=0"):
        sched.gpipe(0, 2, 0)
    with pytest.raises(ValueError, match="stage 2 is outside"):
        sched.one_f_one_b(2, 2, 4)


@pytest.mark.parametrize("name", sched.SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_one_channel_per_direction_cannot_deadlock_on_nccl(name, stages, micro):
    """NCCL runs a pair's messages on one stream in issue order, a send only with its receive. With one process
    group per direction of each link (what the engine uses), both ways of posting receives complete; with one
    group for everything, posting the step's receives first (the engine's way on gloo) deadlocks every schedule,
    and 1F1B deadlocks even posting each receive at its action, as soon as two micro-batches overlap."""
    lists = [sched.train_schedule(name, s, stages, micro) for s in range(stages)]
    for ahead in (True, False):
        sched.simulate_streams(lists, shared=False, posted_ahead=ahead)
    with pytest.raises(RuntimeError, match="deadlock"):
        sched.simulate_streams(lists, shared=True, posted_ahead=True)
    if name == "1f1b" and micro >= 2:
        with pytest.raises(RuntimeError, match="deadlock"):
            sched.simulate_streams(lists, shared=True, posted_ahead=False)
    else:
        sched.simulate_streams(lists, shared=True, posted_ahead=False)
