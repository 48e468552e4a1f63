"""What takes part in a step beside the stage's compute: each side of a boundary and the tied weights.

Each keeps state across a step's schedule (ids to check, rows and gradients in flight, AQ-SGD rows still to land),
and every one takes part through the same two calls, which `StepRun` makes in a loop: `begin` before the schedule,
`finish` after it. A new kind of per-step state is a new participant (one file), not a new call in the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from aqpipe.compression import BufferRangeError


@dataclass(frozen=True, kw_only=True)
class StepStart:
    """What a participant is told before the schedule."""

    micro_batches: Sequence[dict[str, Any]]
    phase: str  # "warmup", "train" or "eval"
    training: bool
    undo: list[Callable[[], None]] | None  # where a step that may be rejected collects how to put back what it changes


@dataclass(kw_only=True)
class StepPart:
    """A participant's part of the step's row, once its schedule is over."""

    overflow: BufferRangeError | None = None  # the first row it sent that its AQ-SGD buffer's dtype could not hold
    change: tuple[float, float] = (0.0, 0.0)  # an AQ-SGD sender's squares of its changes and of its activations
    finite_flags: list[torch.Tensor] = field(default_factory=list)  # 0-dim bools on the device: what it sent was
    # finite (read with the step's gradient norm)


class StepParticipant(Protocol):
    def begin(self, start: StepStart) -> None:
        """Before the schedule: what it must send or post first (its bytes count on the wire, by the counter each
        send names)."""

    def finish(self) -> StepPart:
        """After the schedule (the wire flushed): what waits for the schedule done; its part of the step's row."""


def combined(parts: Sequence[StepPart]) -> StepPart:
    """Every participant's part as one: the first overflow, the changes summed, every flag."""
    return StepPart(overflow=next((p.overflow for p in parts if p.overflow is not None), None),
                    change=(sum(p.change[0] for p in parts), sum(p.change[1] for p in parts)),
                    finite_flags=[f for p in parts for f in p.finite_flags])
