"""Bits per boundary, chosen from the link and the receiver's compute (`--forward_bits auto`).

A boundary's message hides under the receiving stage's compute when it arrives before that stage
needs it: in a 1F1B steady state a micro-batch's activation travels while the receiver runs the
previous micro-batch's forward and backward. So for each boundary and direction the choice is the
most bits whose message, at the link's measured speed, takes no longer than the receiver's compute
per micro-batch; where even the fewest bits take longer, the fewest. More bits where they are free,
fewer where the link is the bottleneck.

Bits are drawn from the user's bounds (default 2 to 8) and only where the quantizer stays inside
AQ-SGD's convergence theorem, c_Q < sqrt(1/2) at the group size those bits get (`error_constant`).

Everything here is a pure function of numbers every rank holds alike (the step's job-wide table), so
both sides of a boundary, and every replica, reach the same choice at the same step without a message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from compression.quantizer import error_constant

THEOREM_C_Q = 0.5 ** 0.5  # AQ-SGD's bound on the quantizer's relative error
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Link:
    """One direction of a boundary's link as measured: seconds a byte and a fixed delay per message."""

    seconds_per_byte: float
    latency: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes * self.seconds_per_byte


def allowed_bits(low: int, high: int, width: int, group_of: Callable[[int], int | None]) -> list[int]:
    """The bits in [low, high] whose quantizer, at the group `group_of(bits)`, keeps c_Q below the theorem's
    bound on rows of `width`; ValueError naming the bounds when none does."""
    if not 1 <= low <= high <= 8:
        raise ValueError(f"auto bits between {low} and {high}: expected 1 <= min <= max <= 8")
    bits = [b for b in range(low, high + 1) if error_constant(b, width, group_of(b)) < THEOREM_C_Q]
    if not bits:
        raise ValueError(f"auto bits between {low} and {high}: no setting keeps c_Q below {THEOREM_C_Q:.3f} "
                         f"on rows of {width} (raise the maximum)")
    return bits


def choose(allowed: list[int], message_bytes: Callable[[int], int], link: Link, budget: float) -> int:
    """The most allowed bits whose message crosses `link` within `budget` seconds; the fewest if none does."""
    fitting = [b for b in allowed if link.seconds(message_bytes(b)) <= budget]
    return max(fitting) if fitting else min(allowed)


@dataclass
class AutoBits:
    """The current bits of every (boundary, direction) set to auto, and the decisions that set them.

    `allowed[direction]` holds the candidate bits (from `allowed_bits`); a decision takes, per boundary,
    the links each way, the receivers' compute per micro-batch and the message sizes, and returns what
    changed. Its state (current bits, the last decision's inputs) travels in checkpoints.
    """

    boundaries: int
    allowed: dict[str, list[int]]  # direction -> candidate bits; a direction absent is not automatic
    bits: dict[tuple[int, str], int] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for direction, candidates in self.allowed.items():
            for b in range(self.boundaries):  # until measured: the most bits allowed
                self.bits.setdefault((b, direction), max(candidates))

    def decide(self, step: int, links: dict[tuple[int, str], Link], budgets: dict[tuple[int, str], float],
               message_bytes: Callable[[int, str, int], int]) -> dict[tuple[int, str], int]:
        """New bits for every automatic (boundary, direction) from its link and its receiver's compute budget
        per micro-batch; returns those that changed."""
        changed = {}
        for (b, direction), current in sorted(self.bits.items()):
            pick = choose(self.allowed[direction], lambda bits: message_bytes(b, direction, bits),
                          links[(b, direction)], budgets[(b, direction)])
            if pick != current:
                changed[(b, direction)] = self.bits[(b, direction)] = pick
        self.last = {"step": step, "bits": self.record(),
                     "links": {f"{b}.{d}": [link.seconds_per_byte, link.latency] for (b, d), link in links.items()},
                     "budgets": {f"{b}.{d}": s for (b, d), s in budgets.items()}}
        return changed

    def record(self) -> dict[str, int]:
        """For metrics.jsonl: "boundary.direction" -> bits."""
        return {f"{b}.{d}": bits for (b, d), bits in sorted(self.bits.items())}

    def state_dict(self) -> dict[str, Any]:
        return {"bits": self.record(), "allowed": {d: list(v) for d, v in self.allowed.items()}, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["allowed"] != {d: list(v) for d, v in self.allowed.items()} or set(state["bits"]) != set(
                self.record()):
            raise ValueError(f"auto bits state for {sorted(state['bits'])} with candidates {state['allowed']}; this "
                             f"run has {sorted(self.record())} with {self.allowed}")
        for key, bits in state["bits"].items():
            b, direction = key.split(".")
            self.bits[(int(b), direction)] = int(bits)
        self.last = dict(state["last"])
