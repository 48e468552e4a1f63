"""Bits per boundary priced on the schedule from the links and the stages' compute: the choice, its bounds, its
state."""
import pytest

from aqpipe.compression import QuantizedTensor
from aqpipe.pipeline.auto_bits import THEOREM_C_Q, AutoBits, Link, Step, allowed_bits, choose
from aqpipe.pipeline.compression_config import CompressionConfig
from aqpipe.pipeline.schedule import train_schedule

WIDTH, ELEMENTS = 768, 4 * 128 * 768  # a micro-batch of 4 x 128 tokens of GPT-2 small


def auto_group(bits: int) -> int | None:
    return CompressionConfig(forward="direct", forward_bits=bits).group_size("forward", WIDTH)


def message(bits: int) -> int:
    return QuantizedTensor.wire_nbytes((4, 128, WIDTH), bits, auto_group(bits))


def test_allowed_bits_keep_the_quantizer_inside_the_theorem():
    assert allowed_bits(2, 8, WIDTH, auto_group) == [2, 3, 4, 5, 6, 7, 8]  # 2 bits in groups of 64: c_Q 0.63
    assert allowed_bits(2, 8, WIDTH, lambda bits: None) == [3, 4, 5, 6, 7, 8]  # whole rows at 2 bits: 0.86
    assert allowed_bits(1, 3, WIDTH, auto_group) == [2, 3]  # 1 bit never qualifies
    with pytest.raises(ValueError, match="no setting keeps c_Q below 0.707"):
        allowed_bits(1, 1, WIDTH, auto_group)
    with pytest.raises(ValueError, match="auto bits between 6 and 4: expected 1 <= min <= max <= 8"):
        allowed_bits(6, 4, WIDTH, auto_group)
    assert THEOREM_C_Q == pytest.approx(0.7071, abs=1e-4)


SCHEDULE = [train_schedule("1f1b", s, 4, 4) for s in range(4)]  # 4 stages, 4 micro-batches
BOTH = {"forward": list(range(2, 9)), "backward": list(range(2, 9))}
KEYS = [(b, d) for b in range(3) for d in ("forward", "backward")]


def links(slow_mbit: float) -> dict:
    """Boundary 1 at `slow_mbit`, the others at 1 Gbit/s."""
    return {(b, d): Link(8 / ((slow_mbit if b == 1 else 1000) * 1e6)) for b, d in KEYS}


def test_a_step_is_priced_on_the_schedule_with_each_links_time():
    step = Step(SCHEDULE, [0.02] * 4)  # 20 ms a micro-batch, forward and backward
    assert step.seconds({}) == pytest.approx(0.02 * 7)  # 1F1B: (M + S - 1) micro-batch times, nothing on the wire
    # a link quicker than the compute: paid on the critical path only, which crosses it twice in 1F1B (the first
    # micro-batch in the fill; the fourth, which stage 1 forwards only after its first backward while stage 2
    # waits for it), not per micro-batch
    fill = step.seconds({(1, "forward"): 0.005})
    assert fill == pytest.approx(0.02 * 7 + 2 * 0.005)
    bound = step.seconds({(1, "forward"): 0.05})  # a link slower than the compute: every micro-batch waits on it
    assert bound > 0.02 * 7 + 0.05 + 3 * (0.05 - 0.02) - 1e-9


def test_choose_raises_bits_while_the_step_stays_within_the_slack():
    step = Step(SCHEDULE, [0.02] * 4)
    slow = links(100)  # on 100 Mbit/s a 2-bit micro-batch of GPT-2 small (148 KB) takes 11.8 ms, 8 bits 31.8 ms
    seconds = lambda key, bits: slow[key].seconds(message(bits))  # noqa: E731
    bits, fastest, chosen = choose(BOTH, KEYS, seconds, step, slack=0.0)
    assert set(bits.values()) == {2} and chosen == fastest  # no slack: every byte in the fill costs, the fewest
    bits, fastest, chosen = choose(BOTH, KEYS, seconds, step, slack=0.05)
    assert fastest < chosen <= 1.05 * fastest
    # the slow link stays near the fewest (3 bits' rows cost 3% over 2 bits in groups of 64); the fast links'
    # messages are on the fill's path too, so only the raises that cost least reach 8
    assert bits == {(0, "forward"): 8, (0, "backward"): 8, (1, "forward"): 3, (1, "backward"): 3,
                    (2, "forward"): 3, (2, "backward"): 8}
    every = choose(BOTH, KEYS, seconds, step, slack=1.0)[0]  # room for everything: the most everywhere
    assert set(every.values()) == {8}
    backward = {k: seconds(k, 8) for k in KEYS if k[1] == "backward"}  # not chosen here: priced as given
    fixed, fastest, _ = choose({"forward": BOTH["forward"]}, [k for k in KEYS if k[1] == "forward"], seconds, step,
                               0.05, fixed=backward)
    assert set(fixed) == {(0, "forward"), (1, "forward"), (2, "forward")}
    assert fastest == pytest.approx(step.seconds({**backward, **{k: seconds(k, 2) for k in fixed}}))


def test_four_stages_one_slow_link_two_fast():
    auto = AutoBits(3, {"forward": list(range(2, 9)), "backward": list(range(2, 9))})
    assert auto.record() == {f"{b}.{d}": 8 for b, d in KEYS}  # until measured
    assert auto.decide(0, SCHEDULE, links(100), lambda b, d, bits: message(bits), 0.05) == {}  # no step seen:
    assert auto.record() == {f"{b}.{d}": 8 for b, d in KEYS}  # (all rejected) nothing to price, the bits stay
    for compute in ([0.02] * 4, [0.02] * 4, [0.5] * 4):  # one noisy step among three, the last: the median ignores it
        auto.observe(compute)
    changed = auto.decide(10, SCHEDULE, links(100), lambda b, d, bits: message(bits), 0.05)
    assert changed == {(1, "forward"): 3, (1, "backward"): 3, (2, "forward"): 3}
    assert auto.last["step"] == 10 and auto.last["compute"] == [0.02] * 4 and auto.last["steps_seen"] == 3
    assert auto.seen == []  # each decision prices the steps since the last
    auto.observe([0.02] * 4)
    assert auto.decide(11, SCHEDULE, links(100), lambda b, d, bits: message(bits), 0.05) == {}  # nothing new
    auto.observe([0.02] * 4)
    auto.decide(12, SCHEDULE, links(1), lambda b, d, bits: message(bits), 0.05)  # a link of 1 Mbit/s: (nearly) the
    assert max(auto.bits[(1, "forward")], auto.bits[(1, "backward")]) <= 3  # fewest (3 bits' rows: 3% over 2's groups)
    assert auto.last["step_seconds_chosen"] <= 1.05 * auto.last["step_seconds_fewest"]
    with pytest.raises(ValueError, match="compute of 3 stages: expected 4"):
        auto.observe([0.02] * 3)


def test_state_round_trips_and_refuses_another_layout():
    auto = AutoBits(2, {"forward": [2, 3, 4]})
    three = [train_schedule("1f1b", s, 3, 2) for s in range(3)]
    auto.observe([0.01, 0.01, 0.01])
    auto.decide(5, three, {(0, "forward"): Link(1.0), (1, "forward"): Link(0.0)}, lambda b, d, bits: 10 * bits, 0.05)
    assert auto.record() == {"0.forward": 2, "1.forward": 4}
    auto.observe([0.03, 0.04, 0.05])  # seen since: the next decision's, kept across a resume
    again = AutoBits(2, {"forward": [2, 3, 4]})
    again.load_state_dict(auto.state_dict())
    assert again.bits == auto.bits and again.last == auto.last and again.seen == [[0.03, 0.04, 0.05]]
    with pytest.raises(ValueError, match="auto bits state for"):
        AutoBits(3, {"forward": [2, 3, 4]}).load_state_dict(auto.state_dict())
    with pytest.raises(ValueError, match="candidates"):
        AutoBits(2, {"forward": [3, 4]}).load_state_dict(auto.state_dict())
