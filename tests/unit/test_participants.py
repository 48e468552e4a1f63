"""A step's participants (pipeline/participants.py): `StepRun` begins each before the schedule and finishes each after
it, in one loop, and what they finish with reaches the step's row: bytes sent in `begin` on the wire they name, an
overflow of the AQ-SGD buffer noted against the micro-batch that sent the sample, the changes' squares in the totals,
finite flags for the gradient norm's read."""
import contextlib

import pytest
import torch

from aqpipe.compression import BufferRangeError
from aqpipe.pipeline import schedule as sched
from aqpipe.pipeline.participants import StepPart, StepStart
from aqpipe.pipeline.step_guard import StepGuard
from aqpipe.pipeline.step_run import StageRuntime, StepRun
from aqpipe.pipeline.step_table import BUFFER_RANGE
from aqpipe.pipeline.transport import Wire
from tests.helpers.toy import toy_batches, toy_stages


class Recording:
    """A participant standing in the tied weights' place: it records every call, counts 7 bytes on the tie's wire at
    `begin` (as a send there would) and finishes with what the test gives it."""

    def __init__(self, part: StepPart, wire: Wire) -> None:
        self.part, self.wire, self.calls, self.start = part, wire, [], None

    def begin(self, start: StepStart) -> None:
        self.calls.append("begin")
        self.start = start
        self.wire.count("tie_bytes", 7)

    def before_forward(self, mb, undo=None) -> None:
        self.calls.append(f"forward {mb}")

    def after_backward(self, mb, phase) -> None:
        self.calls.append(f"backward {mb}")

    def finish(self) -> StepPart:
        self.calls.append("finish")
        return self.part


def run_step(part: StepPart, batches: list[dict]) -> tuple[StepRun, Recording]:
    torch.manual_seed(0)
    wire = Wire()
    stage, participant = toy_stages(1)[0], Recording(part, wire)
    runtime = StageRuntime(stage=stage, prev=None, next=None, tied=participant, wire=wire,
                           wire_dtype=torch.float32, device=torch.device("cpu"), autocast=contextlib.nullcontext,
                           seed=0, replica=0, step=0, num_samples=16, buffered=False, timed=False)
    actions = sched.train_schedule("1f1b", 0, 1, len(batches))
    return StepRun(runtime, batches, "train", True, StepGuard({})).run(actions), participant


def test_each_participant_begins_before_the_schedule_and_finishes_after_it_once():
    batches = next(toy_batches(16, 8, 2, 3, epoch=0))
    run, participant = run_step(StepPart(), batches)
    assert participant.calls == ["begin", "forward 0", "backward 0", "forward 1", "backward 1", "forward 2",
                                 "backward 2", "finish"]
    assert participant.start.micro_batches is batches and participant.start.phase == "train"
    assert participant.start.training and participant.start.undo is run.guard.restores
    assert run.counters.tie_bytes == 7 and run.counters.fwd_bytes == 0  # on the wire it names


def test_what_a_participant_finishes_with_reaches_the_steps_row():
    batches = next(toy_batches(16, 8, 2, 3, epoch=0))
    sample = int(batches[2]["sample_id"][1])  # sent in micro-batch 2
    flag = torch.tensor(False)
    overflow = BufferRangeError(sample, 1e6, torch.float16)
    run, _ = run_step(StepPart(overflow=overflow, change=(0.09, 4.0), finite_flags=[flag]), batches)
    findings = run.guard.findings
    assert findings.overflow is overflow and findings.bad & BUFFER_RANGE and findings.first_mb == 2
    totals = run.totals()
    assert (totals.change_squares, totals.activation_squares) == (0.09, 4.0)
    assert totals.change() == pytest.approx(0.15)  # sqrt(0.09 / 4): neither sum itself
    assert run.part.finite_flags == [flag]


def test_a_step_without_findings_leaves_its_row_clean():
    run, _ = run_step(StepPart(), next(toy_batches(16, 8, 2, 2, epoch=0)))
    assert run.guard.findings.overflow is None and run.guard.findings.bad == 0
    assert run.totals().change() is None and run.loss_sum > 0
