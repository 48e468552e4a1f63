"""Bits per boundary from the link and the receiver's compute: the choice, its bounds, its state."""
import pytest

from compression import QuantizedTensor
from pipeline.auto_bits import THEOREM_C_Q, AutoBits, Link, allowed_bits, choose
from pipeline.compression_config import CompressionConfig

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


def test_choose_takes_the_most_bits_that_hide_under_the_receivers_compute():
    candidates = list(range(2, 9))
    fast = Link(seconds_per_byte=8 / 10e9)  # 10 Gbit/s: even 8 bits (~0.4 MB) take 0.3 ms
    assert choose(candidates, message, fast, budget=0.05) == 8
    slow = Link(seconds_per_byte=8 / 100e6, latency=0.001)  # 100 Mbit/s: 4 bits ~ 17 ms, 5 bits ~ 20 ms
    budget = slow.seconds(message(4)) + 1e-6
    assert choose(candidates, message, slow, budget) == 4
    assert choose(candidates, message, slow, budget=slow.seconds(message(4)) - 1e-6) == 3
    assert choose(candidates, message, Link(1.0), budget=0.05) == 2  # nothing fits: the fewest allowed


def test_four_stages_one_slow_link_two_fast():
    auto = AutoBits(3, {"forward": list(range(2, 9)), "backward": list(range(2, 9))})
    assert auto.record() == {f"{b}.{d}": 8 for b in range(3) for d in ("forward", "backward")}  # until measured
    gbit, slow = Link(8 / 1e9), Link(8 / 100e6)  # boundary 1 at 100 Mbit/s, the others at 1 Gbit/s
    links = {(b, d): slow if b == 1 else gbit for b in range(3) for d in ("forward", "backward")}
    budgets = {key: 0.018 for key in links}  # each receiver computes 18 ms a micro-batch
    changed = auto.decide(10, links, budgets, lambda b, d, bits: message(bits))
    # on 100 Mbit/s 4 bits take 16.1 ms (201 KB), 5 bits 20.0 ms; on 1 Gbit/s 8 bits take 3.2 ms
    assert changed == {(1, "forward"): 4, (1, "backward"): 4}
    assert auto.bits[(0, "forward")] == auto.bits[(2, "backward")] == 8
    budgets[(1, "forward")] = 0.005  # a receiver too quick for even 2 bits to hide: the fewest allowed
    assert auto.decide(11, links, budgets, lambda b, d, bits: message(bits)) == {(1, "forward"): 2}
    budgets[(1, "forward")] = 0.018
    assert auto.last["step"] == 11 and auto.last["bits"]["1.forward"] == 2
    assert auto.decide(12, links, budgets, lambda b, d, bits: message(bits)) == {(1, "forward"): 4}
    assert auto.decide(13, links, budgets, lambda b, d, bits: message(bits)) == {}  # nothing new: nothing changes


def test_state_round_trips_and_refuses_another_layout():
    auto = AutoBits(2, {"forward": [2, 3, 4]})
    auto.decide(5, {(0, "forward"): Link(1.0), (1, "forward"): Link(0.0)}, {(0, "forward"): 1.0,
                                                                           (1, "forward"): 1.0}, lambda b, d, bits: 10)
    assert auto.record() == {"0.forward": 2, "1.forward": 4}
    again = AutoBits(2, {"forward": [2, 3, 4]})
    again.load_state_dict(auto.state_dict())
    assert again.bits == auto.bits and again.last == auto.last
    with pytest.raises(ValueError, match="auto bits state for"):
        AutoBits(3, {"forward": [2, 3, 4]}).load_state_dict(auto.state_dict())
    with pytest.raises(ValueError, match="candidates"):
        AutoBits(2, {"forward": [3, 4]}).load_state_dict(auto.state_dict())
