"""Bits per boundary, chosen by what they cost the step (`--forward_bits auto`).

A boundary's message costs the step only where it is on the critical path: in a pipeline's fill and drain
every link's messages are (the first micro-batch's activation crosses each link before the next stage can
start), in the steady state only a link slower than the stages' compute is. So a decision prices a setting
by playing the step's schedule (schedule.makespan) with every stage's measured compute per micro-batch and
every message's time on its link at its bits. It starts from the fewest bits everywhere (the fastest step
the bounds allow) and raises, one setting at a time, the bits whose raise costs the step least, while the
step stays within `slack` of that fastest one: more bits where they are free, the fewest where the link is
the bottleneck.

Bits are drawn from the user's bounds (default 2 to 8) and only where the quantizer stays inside
AQ-SGD's convergence theorem, c_Q < sqrt(1/2) at the group size those bits get (`error_constant`).

Everything here is a pure function of numbers every rank holds alike (the job-wide tables of the steps since
the last decision), so both sides of a boundary, and every replica, reach the same choice at the same step
without a message.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from aqpipe.compression import QuantizedTensor
from aqpipe.compression.quantizer import error_constant

from .schedule import COMPUTE, Action, makespan, train_schedule

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


Key = tuple[int, str]  # (boundary, direction)


@dataclass(frozen=True)
class Step:
    """What a decision prices bits against: every stage's action list for one step and its compute per micro-batch
    (forward and backward together; split as schedule.COMPUTE has it, a backward twice a forward)."""

    schedules: list[list[Action]]
    compute: list[float]

    @cached_property
    def costs(self) -> list[dict[str, float]]:
        """Each stage's seconds per compute action (a decision prices many settings on the same compute)."""
        return [{op: c * share / 3 for op, share in COMPUTE.items()} for c in self.compute]

    def seconds(self, transfer: dict[Key, float]) -> float:
        """The step's length when boundary b's messages each way take `transfer[(b, direction)]` seconds."""
        links = {(b, b + 1) if d == "forward" else (b + 1, b): t for (b, d), t in transfer.items()}
        return makespan(self.schedules, self.costs, links)


def choose(allowed: dict[str, list[int]], keys: list[Key], message_seconds: Callable[[Key, int], float],
           step: Step, slack: float, fixed: dict[Key, float] | None = None) -> tuple[dict[Key, int], float, float]:
    """Bits for every key: from the fewest allowed, raise the setting whose next bits lengthen the step least
    while the step stays within `slack` of its length at the fewest. `message_seconds(key, bits)`: one message's
    time on its link; `fixed`: the message times of directions not chosen here. Returns the bits, the step's
    length at the fewest bits and at the choice."""
    fixed = fixed or {}

    def length(bits: dict[Key, int]) -> float:
        return step.seconds({**fixed, **{k: message_seconds(k, b) for k, b in bits.items()}})

    bits = {k: min(allowed[k[1]]) for k in keys}
    fastest = current = length(bits)
    while True:
        raises = []
        for k in keys:
            higher = [b for b in allowed[k[1]] if b > bits[k]]
            if higher:
                trial = {**bits, k: higher[0]}
                raises.append((length(trial), k, trial))
        affordable = [r for r in raises if r[0] <= fastest * (1 + slack)]
        if not affordable:
            return bits, fastest, current
        current, _, bits = min(affordable, key=lambda r: (r[0], r[1]))


@dataclass
class AutoBits:
    """The current bits of every (boundary, direction) set to auto, the compute seen since the last decision and
    the last decision's inputs and outcome.

    `allowed[direction]` holds the candidate bits (from `allowed_bits`); `observe` takes every step's compute per
    micro-batch of each stage; `decide` prices settings on the median of those (one step's timing is noisy) and
    returns what changed. Its state travels in checkpoints.
    """

    boundaries: int
    allowed: dict[str, list[int]]  # direction -> candidate bits; a direction absent is not automatic
    bits: dict[Key, int] = field(default_factory=dict)
    seen: list[list[float]] = field(default_factory=list)  # per step since the last decision: compute per stage
    last: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for direction, candidates in self.allowed.items():
            for b in range(self.boundaries):  # until measured: the most bits allowed
                self.bits.setdefault((b, direction), max(candidates))

    def observe(self, compute: list[float]) -> None:
        """One step's compute per micro-batch, per stage."""
        if len(compute) != self.boundaries + 1:
            raise ValueError(f"compute of {len(compute)} stages: expected {self.boundaries + 1}")
        self.seen.append([float(c) for c in compute])

    def decide(self, step: int, schedules: list[list[Action]], links: dict[Key, Link],
               message_bytes: Callable[[int, str, int], int], slack: float,
               fixed: dict[Key, float] | None = None) -> dict[Key, int]:
        """New bits for every automatic (boundary, direction) from the links (every automatic key's) and the
        median compute observed since the last decision; returns those that changed."""
        if not self.seen:  # every step since the last decision rejected: nothing to price, the bits stay
            return {}
        compute = [statistics.median(column) for column in zip(*self.seen)]
        keys = sorted(self.bits)
        pick, fastest, chosen = choose(self.allowed, keys, lambda k, b: links[k].seconds(message_bytes(*k, b)),
                                       Step(schedules, compute), slack, fixed)
        changed = {k: b for k, b in pick.items() if b != self.bits[k]}
        self.bits.update(pick)
        self.last = {"step": step, "bits": self.record(), "steps_seen": len(self.seen),
                     "links": {f"{b}.{d}": [link.seconds_per_byte, link.latency] for (b, d), link in links.items()},
                     "compute": compute, "step_seconds_fewest": fastest, "step_seconds_chosen": chosen}
        self.seen = []
        return changed

    def record(self) -> dict[str, int]:
        """For metrics.jsonl: "boundary.direction" -> bits."""
        return {f"{b}.{d}": bits for (b, d), bits in sorted(self.bits.items())}

    def state_dict(self) -> dict[str, Any]:
        return {"bits": self.record(), "allowed": {d: list(v) for d, v in self.allowed.items()},
                "seen": [list(row) for row in self.seen], "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["allowed"] != {d: list(v) for d, v in self.allowed.items()} or set(state["bits"]) != set(
                self.record()):
            raise ValueError(f"auto bits state for {sorted(state['bits'])} with candidates {state['allowed']}; this "
                             f"run has {sorted(self.record())} with {self.allowed}")
        for key, bits in state["bits"].items():
            b, direction = key.split(".")
            self.bits[(int(b), direction)] = int(bits)
        self.seen = [list(row) for row in state.get("seen", [])]  # absent in checkpoints before it was kept
        self.last = dict(state["last"])


PROBE_BYTES = 64 << 10  # a link probe's large message: 52 ms on 10 Mbit/s, above the noise


class AutoBitsController:
    """Bits per link in a running engine: on a decision step (every `auto_bits_every`) this rank probes its links
    before the schedule; after it, every rank reads the step's job-wide table alike (each stage's compute, each
    link's probe) and reaches the same bits, setting its own codecs. With `link_mbit` the rates are given."""

    def __init__(self, compression: Any, grid: Any, width: int, schedule: str, wire_dtype: Any) -> None:
        c, boundaries = compression, grid.stages - 1
        if c.link_mbit is not None and len(c.link_mbit) != boundaries:
            raise ValueError(f"link_mbit={c.link_mbit}: expected {boundaries} rates, one per boundary")
        allowed = {d: allowed_bits(c.auto_bits_min, c.auto_bits_max, width,
                                   lambda bits, d=d: c.group_size(d, width, bits)) for d in DIRECTIONS if c.auto(d)}
        self.compression, self.grid, self.width = c, grid, width
        self.schedule, self.wire_dtype = schedule, wire_dtype
        self.state = AutoBits(boundaries, allowed)

    def bits(self, boundary: int, direction: str) -> int:
        return self.state.bits[(boundary, direction)]

    def deciding(self, step: int) -> bool:
        """Whether the step after `step` steps decides (and so probes, unless the rates are given)."""
        return step % self.compression.auto_bits_every == 0

    @staticmethod
    def probe(stage: int, prev: Any, next_: Any) -> tuple[float, float, float]:
        """Probe this rank's links, even boundaries first, then odd ones (a rank is in one probe at a time);
        returns the probe of the next link (zeros on the last stage)."""
        mine = (0.0, 0.0, 0.0)
        for parity in (0, 1):
            if next_ is not None and stage % 2 == parity:
                mine = next_.probe(True, PROBE_BYTES)
            if prev is not None and (stage - 1) % 2 == parity:
                prev.probe(False, PROBE_BYTES)
        return mine

    def observe(self, table: Any, micro_batches: int) -> None:
        """Every accepted step: each stage's compute per micro-batch (its slowest replica's, each over its own share of
        the step's micro-batches: `micro_batches` where the table has no count), from the table."""
        compute, grid = table.column("compute_seconds"), self.grid
        counts = [table.replica_sum("micro_batches", r) or micro_batches for r in range(grid.replicas)]
        self.state.observe([max(float(compute[grid.rank(s, r)]) / counts[r] for r in range(grid.replicas))
                            for s in range(grid.stages)])

    def most_micro_batches(self, table: Any, micro_batches: int) -> int:
        """The largest replica's share of the step's micro-batches (the schedule a decision prices, alike on every
        rank); `micro_batches` where the table has no count."""
        return int(max(table.replica_sum("micro_batches", r) for r in range(self.grid.replicas)) or micro_batches)

    def decide(self, table: Any, step: int, rows: int, seq: int, micro_batches: int,
               codecs: dict[int, Any]) -> dict[str, Any]:
        """New bits from the job-wide table, the same on every rank: per boundary, its slowest replica's link each
        way, priced on the schedule with the compute seen since the last decision. `codecs[b]`: this rank's side
        of boundary b (a `transport.Boundary`), whose codecs take the new bits. Returns the decision's record."""
        c, width, grid = self.compression, self.width, self.grid
        links = {}
        for b in range(grid.stages - 1):
            senders = [grid.rank(b, r) for r in range(grid.replicas)]
            for direction, way in (("forward", "link_ahead"), ("backward", "link_back")):
                links[(b, direction)] = Link(8 / (c.link_mbit[b] * 1e6)) if c.link_mbit is not None else Link(
                    float(table.column(way)[senders].max()), float(table.column("link_latency")[senders].max()))

        def message_bytes(b: int, direction: str, bits: int | None) -> int:
            ids = 8 * rows if direction == "forward" else 0  # the sample ids travel with activations
            if getattr(c, direction) == "none":
                return rows * seq * width * self.wire_dtype.itemsize + ids
            return QuantizedTensor.wire_nbytes((rows, seq, width), bits, c.group_size(direction, width, bits),
                                               c.scales()) + ids

        fixed = {k: link.seconds(message_bytes(*k, getattr(c, f"{k[1]}_bits"))) for k, link in links.items()
                 if k[1] not in self.state.allowed}
        schedules = [train_schedule(self.schedule, s, grid.stages, micro_batches) for s in range(grid.stages)]
        changed = self.state.decide(step, schedules, {k: v for k, v in links.items() if k[1] in self.state.allowed},
                                    message_bytes, c.auto_bits_slack, fixed)
        for (b, direction), bits in changed.items():
            if b in codecs:
                getattr(codecs[b], direction).set_bits(bits, c.group_size(direction, width, bits))
        return self.state.last

    def record(self) -> dict[str, int]:
        return self.state.record()

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)  # the codecs restore their current bits themselves
