"""The LR plan: any schedule as a table of rates, and a resume that changes the run's length stretching what is
left of it, continuous at the resume step."""
import math

import pytest
import torch
from transformers import get_scheduler

from aqpipe.lr_plan import PlannedLR


def hf(kind, warmup=2):
    return lambda opt, total: get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)


def run(plan, steps):
    """The rates of the next `steps` steps (each set before its step)."""
    out = []
    for _ in range(steps):
        out.append(plan.optimizer.param_groups[0]["lr"])
        plan.step()
    return out


def optimizer(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_the_plan_is_the_schedule_step_by_step():
    opt, ref = optimizer(), optimizer()
    plan, sched = PlannedLR(opt, hf("cosine"), 10, 0.1), hf("cosine")(ref, 10)
    expected = []
    for _ in range(10):
        expected.append(ref.param_groups[0]["lr"])
        ref.step()
        sched.step()
    assert run(plan, 10) == expected  # exact: the table is the schedule's own floats


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_a_longer_resume_stretches_the_rest_continuously(kind):
    old = PlannedLR(optimizer(), hf(kind), 10, 0.1)
    before = run(old, 6)
    planned_rest = run(PlannedLR(optimizer(), hf(kind), 10, 0.1), 10)[6:]
    new = PlannedLR(optimizer(), hf(kind), 20, 0.1)  # the resumed run plans 20 steps
    new.load_state_dict(dict(old.state_dict()))
    rest = run(new, 14)
    assert rest[0] == planned_rest[0]  # step 7 at the rate the old plan gave it: continuous
    assert len(before) + len(rest) == 20
    # the old plan's last 4 steps after 6 done (its rates at 6, 7, 8, 9 steps done) spread over 14: after 6 + i
    # steps the rate is the old one after 6 + 4i/14, so after 13 (i = 7) it is the old one after 8, exactly
    assert rest[7] == planned_rest[2]
    assert planned_rest[1] > rest[4] > planned_rest[2]  # 6 + 16/14: between the old rates after 7 and 8 done
    assert planned_rest[3] >= rest[13]  # the last step: near the old end
    assert all(a >= b for a, b in zip(rest, rest[1:]))  # still decaying, never jumping up

def test_a_stretched_plan_survives_another_resume_exactly():
    old = PlannedLR(optimizer(), hf("linear"), 10, 0.1)
    run(old, 4)
    mid = PlannedLR(optimizer(), hf("linear"), 30, 0.1)
    mid.load_state_dict(old.state_dict())
    run(mid, 5)
    again = PlannedLR(optimizer(), hf("linear"), 30, 0.1)  # the same length: a plain resume
    again.load_state_dict(mid.state_dict())
    longer = PlannedLR(optimizer(), hf("linear"), 50, 0.1)  # and a second stretch
    longer.load_state_dict(mid.state_dict())
    assert run(again, 21) == run(mid, 21)
    rest = run(longer, 41)
    assert rest[0] == again.rate(9) and longer.stretches == [(4, 10, 30), (9, 30, 50)]
    # what was left of the once-stretched plan (21 steps), laid over 41: step 9 + k reads mid's 9 + k * 21 / 41
    assert rest == [pytest.approx(again.rate(9 + k * 21 / 41), rel=1e-12) for k in range(41)]
    assert rest[-1] > 0  # the last step still learns: the decay ends at step 50, not before


def test_a_finished_decay_refuses_more_steps_and_a_constant_rate_goes_on():
    done = PlannedLR(optimizer(), hf("linear"), 10, 0.1)
    run(done, 10)
    more = PlannedLR(optimizer(), hf("linear"), 20, 0.1)
    with pytest.raises(ValueError, match="schedule ended at step 10 with rate 0, so no step after it would learn"):
        more.load_state_dict(done.state_dict())
    flat = PlannedLR(optimizer(), hf("constant_with_warmup"), 10, 0.1)
    run(flat, 10)
    longer = PlannedLR(optimizer(), hf("constant_with_warmup"), 20, 0.1)
    longer.load_state_dict(flat.state_dict())
    assert run(longer, 10) == [pytest.approx(0.1)] * 10
    shorter = PlannedLR(optimizer(), hf("linear"), 5, 0.1)
    with pytest.raises(ValueError, match="the checkpoint is at step 10; expected --epochs/--max_steps"):
        shorter.load_state_dict(done.state_dict())


def test_a_deepspeed_scheduler_checkpoint_resumes_at_its_step():
    plan = PlannedLR(optimizer(), hf("linear"), 10, 0.1)
    plan.load_state_dict({"last_batch_iteration": 5})  # DeepSpeed's iteration k = step k: 4 steps were done
    assert plan.step_count == 4 and math.isclose(plan.optimizer.param_groups[0]["lr"], plan.rate(4))
