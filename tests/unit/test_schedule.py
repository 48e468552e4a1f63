"""Schedules as data: every stage's list runs together without deadlock, in a valid order."""
import pytest

from aqpipe.pipeline import schedule as sched


@pytest.mark.parametrize("name", sched.SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 5, 8])
def test_schedules_complete_and_order_forward_before_backward(name, stages, micro):
    lists = [sched.train_schedule(name, s, stages, micro) for s in range(stages)]
    order = sched.simulate(lists)
    back = sched.BACKWARD_INPUT if name == "zb1" else sched.BACKWARD  # the backward that sends the gradient
    for s in range(stages):
        ops = [a for st, a in order if st == s]
        assert sorted(a.micro_batch for a in ops if a.op == sched.FORWARD) == list(range(micro))
        assert sorted(a.micro_batch for a in ops if a.op == back) == list(range(micro))
        for mb in range(micro):
            assert ops.index(sched.Action(sched.FORWARD, mb)) < ops.index(sched.Action(back, mb))
        if name == "zb1":  # each weight gradient once, after its input gradient, in micro-batch order
            weights = [a.micro_batch for a in ops if a.op == sched.BACKWARD_WEIGHT]
            assert weights == list(range(micro))
            for mb in range(micro):
                assert ops.index(sched.Action(back, mb)) < ops.index(sched.Action(sched.BACKWARD_WEIGHT, mb))
    # a backward on stage s needs the gradient from s+1: globally, (s+1)'s backward of mb comes first
    when = {(s, a): i for i, (s, a) in enumerate(order)}
    for s in range(stages - 1):
        for mb in range(micro):
            assert when[(s + 1, sched.Action(back, mb))] < when[(s, sched.Action(back, mb))]


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
    if name in ("1f1b", "zb1") and micro >= 2:
        with pytest.raises(RuntimeError, match="deadlock"):
            sched.simulate_streams(lists, shared=True, posted_ahead=False)
    else:
        sched.simulate_streams(lists, shared=True, posted_ahead=False)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 5, 8])
def test_zb1_sends_what_1f1b_sends_in_its_order_and_holds_no_more_than_its_peak(stages, micro):
    """zb1 reorders compute only: every stage's messages are 1F1B's, in 1F1B's order; every stage holds at most
    1F1B's peak (its first stage's) micro-batches between forward and weight gradient."""
    talk = (sched.RECV_ACT, sched.SEND_ACT, sched.RECV_GRAD, sched.SEND_GRAD)
    peak = sched.in_flight(sched.one_f_one_b(0, stages, micro))
    for s in range(stages):
        zb = sched.zero_bubble_h1(s, stages, micro)
        assert [a for a in zb if a.op in talk] == [a for a in sched.one_f_one_b(s, stages, micro) if a.op in talk]
        assert sched.in_flight(zb) <= peak
    assert max(sched.in_flight(sched.zero_bubble_h1(s, stages, micro)) for s in range(stages)) == peak


def test_zb1_holds_back_weight_gradients_on_later_stages():
    """Stage s runs its first weight gradient after s + 1 input gradients (ZB-H1): the last stage, idle under 1F1B
    while the others drain, runs its held-back weight gradients there."""
    compute = (sched.FORWARD, sched.BACKWARD_INPUT, sched.BACKWARD_WEIGHT)
    ops = [(a.op[9:] if a.op.startswith("backward_") else a.op, a.micro_batch)
           for a in sched.zero_bubble_h1(3, 4, 6) if a.op in compute]
    assert ops == [("forward", 0), ("input", 0), ("forward", 1), ("input", 1), ("forward", 2), ("input", 2),
                   ("forward", 3), ("input", 3), ("weight", 0), ("forward", 4), ("input", 4), ("weight", 1),
                   ("forward", 5), ("input", 5), ("weight", 2), ("weight", 3), ("weight", 4), ("weight", 5)]
    first = [a.op for a in sched.zero_bubble_h1(0, 4, 6) if a.op != sched.RECV_GRAD]
    assert first.count(sched.BACKWARD_WEIGHT) == 6
    assert all(first[i + 1] == sched.BACKWARD_WEIGHT for i, op in enumerate(first) if op == sched.BACKWARD_INPUT)


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8), (3, 5), (4, 16)])
def test_zb1_bubble_is_the_papers(stages, micro):
    """With a forward, an input gradient and a weight gradient of equal cost (a backward is two), 1F1B idles
    (S-1)/(M+S-1) of the time and ZB-H1 (S-1)/(3M+S-1): a third of 1F1B's idle time."""
    def run(name):
        return sched.bubble([sched.train_schedule(name, s, stages, micro) for s in range(stages)])
    assert run("1f1b") == pytest.approx((stages - 1) / (micro + stages - 1))
    assert run("gpipe") == pytest.approx((stages - 1) / (micro + stages - 1))
    assert run("zb1") == pytest.approx((stages - 1) / (3 * micro + stages - 1))


def test_a_slow_link_stretches_every_bubble_and_zb1_still_has_the_smallest():
    lists = {name: [sched.train_schedule(name, s, 4, 8) for s in range(4)] for name in sched.SCHEDULES}
    fast = {name: sched.bubble(v) for name, v in lists.items()}
    slow = {name: sched.bubble(v, transfer=0.5) for name, v in lists.items()}
    for name in sched.SCHEDULES:
        assert slow[name] > fast[name]
    assert slow["zb1"] < min(slow["1f1b"], slow["gpipe"])


def test_makespan_queues_messages_on_a_busy_link():
    """GPipe on 2 stages, 3 micro-batches (forward 1, backward 2), the activations' link 5 a message: each
    activation waits for the one before it to cross (arrivals 6, 11, 16), so stage 1's forwards end at 17, its
    backwards at 23 and stage 0's at 25. A link that carried messages side by side would finish at 17."""
    lists = [sched.gpipe(s, 2, 3) for s in range(2)]
    costs = [{sched.FORWARD: 1.0, sched.BACKWARD: 2.0}] * 2
    assert sched.makespan(lists, costs, {(0, 1): 5.0}) == 25.0
    assert sched.makespan(lists, costs, {}) == 1 + 3 + 6 + 2  # no wire: stage 0's first forward, stage 1's all,
    # then stage 0's last backward
    slow_stage = [costs[0], {sched.FORWARD: 3.0, sched.BACKWARD: 6.0}]  # each stage at its own speed
    assert sched.makespan(lists, slow_stage, {}) == 1 + 9 + 18 + 2


def _torch_actions(lists: list[list[sched.Action]]) -> dict:
    """Our lists in torch.distributed.pipelining's form: one stage per rank, F / I / W (or B) per micro-batch."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    kinds = {sched.FORWARD: _ComputationType.FORWARD, sched.BACKWARD: _ComputationType.FULL_BACKWARD,
             sched.BACKWARD_INPUT: _ComputationType.BACKWARD_INPUT,
             sched.BACKWARD_WEIGHT: _ComputationType.BACKWARD_WEIGHT}
    return {rank: [_Action(rank, kinds[a.op], a.micro_batch) for a in actions if a.op in kinds]
            for rank, actions in enumerate(lists)}


@pytest.mark.parametrize("name", sched.SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_torch_pipelinings_validator_accepts_our_schedules(name, stages, micro):
    """A second opinion: torch's own check of a pipeline order (every micro-batch forwarded, then input gradient,
    then weight gradient, on every stage, exactly once)."""
    from torch.distributed.pipelining.schedules import _validate_schedule

    lists = [sched.train_schedule(name, s, stages, micro) for s in range(stages)]
    _validate_schedule(_torch_actions(lists), stages, stages, micro)


def test_torch_pipelinings_validator_rejects_a_weight_gradient_before_its_input_gradient():
    from torch.distributed.pipelining.schedules import _validate_schedule

    lists = [sched.zero_bubble_h1(s, 2, 2) for s in range(2)]
    last = lists[1]
    i, w = last.index(sched.Action(sched.BACKWARD_INPUT, 0)), last.index(sched.Action(sched.BACKWARD_WEIGHT, 0))
    last[i], last[w] = last[w], last[i]
    with pytest.raises(AssertionError, match="without first running Backward Input"):
        _validate_schedule(_torch_actions(lists), 2, 2, 2)


def test_the_engines_bubble_is_waiting_over_the_schedules_time_of_all_ranks():
    from aqpipe.pipeline.engine import StepTotals

    assert StepTotals(schedule_seconds=4.0, compute_seconds=3.0).bubble() == pytest.approx(0.25)
    assert StepTotals().bubble() is None  # no schedule ran (nothing to say)
