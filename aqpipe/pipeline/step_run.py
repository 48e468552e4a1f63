"""One run of a stage's action list: the engine's per-step worker.

It holds what one step has in flight on this stage (each micro-batch's input, output, received gradient, zb1's
weight gradients still to run, the loss), the bytes it sent and its guard, and runs each action of the schedule
(schedule.py) as a method of the same name. Receives are all posted before the first action, in schedule order:
gloo starts a transfer once its receive is posted, so each message's flight overlaps this stage's compute. A
NaN/inf about to be sent goes as zeros (the peer waits for a message of a known size) and is noted on the guard.

Nothing in the schedule reads a device value on the host: losses, accuracy counts and finiteness flags stay on
the device, so a GPU runs ahead of the Python that queues its work; `read_device_values` reads them all at once at
the end. What else keeps state across the step (each side of a boundary, the tied weights) takes part through
participants.py's `begin` and `finish`, in one loop each.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aqpipe.compression import BufferRangeError, SampleIds

from . import emulated_device
from . import schedule as sched
from . import split_backward
from .micro_batch import staged
from .participants import StepParticipant, StepPart, StepStart, combined
from .seeding import derive_seed
from .step_guard import StepGuard
from .step_table import ACTIVATION, BUFFER_RANGE, GRADIENT, LOSS, StepCounters, StepTotals
from .ties import TiedWeights
from .transport import Boundary, Wire


@dataclass(frozen=True, kw_only=True)
class StageRuntime:
    """What a step's actions may touch, and nothing else of the engine: the stage, its two boundaries (None at
    the pipeline's ends), the tied weights, the wire and its dtype, and the step's seeds and timing."""

    stage: torch.nn.Module
    prev: Boundary | None
    next: Boundary | None
    tied: TiedWeights
    wire: Wire
    wire_dtype: torch.dtype
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    seed: int
    replica: int
    step: int  # optimizer steps taken before this one
    num_samples: int  # the dataset's, which AQ-SGD's sample ids index
    buffered: bool  # whether AQ-SGD buffers read the sample ids (training phases, a compressed boundary here)
    timed: bool  # whether compute timers wait for the GPU (auto bits prices compute from them)
    per_token: bool = False  # a causal LM's loss per target token over the step (else the micro-batches' mean)
    slowdown: float = 1.0  # an emulated slower device: each compute action waits (slowdown - 1) x its own time more

    def participants(self) -> list[StepParticipant]:
        """Everything beside the stage that keeps state across a step, in the order it begins and finishes."""
        return [p for p in (self.prev, self.next, self.tied) if p is not None]


LOSS_AVERAGES = ("tokens", "micro_batches")  # per_token True / False
IGNORE = -100  # a label the loss skips


def causal_lm_labels(micro_batches: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every micro-batch's labels are a causal LM's (B, T), whose target tokens a step counts (a
    classifier's are one per row, and count none)."""
    return all(mb.get("labels") is not None and mb["labels"].dim() == 2 for mb in micro_batches)


def target_counts(micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor] | None:
    """Each causal-LM micro-batch's target tokens (labels other than -100 after the first position), 0-dim host
    tensors (counted where the loader left the labels); None where the labels are not a causal LM's (B, T)."""
    if not causal_lm_labels(micro_batches):
        return None
    return [(mb["labels"][:, 1:] != IGNORE).sum().cpu() for mb in micro_batches]


def input_counts(micro_batches: list[dict[str, torch.Tensor]],
                 targets: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Each micro-batch's target tokens and input tokens (its attention mask's; packed rows have none, and every
    position is an input token), read together in one transfer."""
    inputs = [mb["attention_mask"].sum().cpu() if mb.get("attention_mask") is not None
              else torch.tensor(mb["input_ids"].numel()) for mb in micro_batches]
    read = torch.stack([*targets, *inputs]).tolist()
    return read[:len(targets)], read[len(targets):]


class StepRun:
    def __init__(self, runtime: StageRuntime, micro_batches: list[dict[str, torch.Tensor]], phase: str,
                 training: bool, guard: StepGuard | None) -> None:
        """`guard`: a training step's (None in evaluation, which changes no buffer and is never undone)."""
        self.runtime, self.micro_batches, self.phase, self.training = runtime, micro_batches, phase, training
        self.staged = staged(micro_batches, runtime.device)  # what the stage computes with
        self.guard = guard or StepGuard({})
        self.restores = self.guard.restores if guard is not None else None  # the tie's undo points go here too
        self.counters = StepCounters()
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.weights: dict[int, split_backward.WeightGradients | None] = {}  # zb1's weight gradients still to run
        self.losses: dict[int, torch.Tensor] = {}  # on the device until `read_device_values`
        self.correct: torch.Tensor | int = 0  # likewise
        self.targets: list[int] = []  # each causal-LM micro-batch's target tokens
        self.token_stats: list[torch.Tensor] = []  # on the device: each one's [targets predicted, entropy sum]
        self.counts = target_counts(micro_batches) if runtime.stage.is_last else None
        # each one's targets and input tokens (its attention mask's; a packed row's every position) as numbers
        self.host_targets, self.host_inputs = input_counts(micro_batches, self.counts) if self.counts else ([], [])
        # per token: a micro-batch's loss weighs its share of this replica's targets (the engine scales replicas)
        self.replica_tokens = torch.stack(self.counts).sum() if self.counts and runtime.per_token else None
        self.counted = self.target_tokens = self.token_correct = self.input_tokens = self.accuracy_tokens = 0
        self.loss_sum = self.token_loss_sum = self.entropy_sum = 0.0
        self.schedule_seconds = self.compute_seconds = self.staging_seconds = 0.0
        buffered = phase != "eval" and runtime.buffered  # ids checked once, where AQ-SGD buffers read them
        self.ids = [SampleIds(mb.get("sample_id"), runtime.num_samples) if buffered else mb.get("sample_id")
                    for mb in micro_batches]
        self.posted: dict[sched.Action, Any] = {}
        self.part = StepPart()  # the participants' part of the step's row, once it ran

    def run(self, actions: list[sched.Action]) -> "StepRun":
        e, parts = self.runtime, self.runtime.participants()
        e.wire.flush()  # this step's bytes alone: what a step that raised left queued or counted is not its
        e.wire.take_sent()
        self.posted = self._post_receives(actions)
        start = StepStart(micro_batches=self.micro_batches, phase=self.phase, training=self.training,
                          undo=self.restores)
        for part in parts:
            part.begin(start)
        began = time.perf_counter()
        for op, mb in actions:
            if op in sched.COMPUTE:
                t = emulated_device.began()
                getattr(self, op)(mb)
                if e.timed or (e.slowdown > 1 and e.device.type == "cuda"):  # the kernels' time, not their launch's
                    torch.cuda.synchronize(e.device)
                if e.slowdown > 1:  # the emulator: a device this many times slower, by waiting
                    emulated_device.stretch(t, e.slowdown, e.device)
                self.compute_seconds += time.perf_counter() - t[0]
            else:
                getattr(self, op)(mb)
        e.wire.flush()
        for counter, nbytes in e.wire.take_sent().items():  # every send of the step, on the wire it named
            setattr(self.counters, counter, getattr(self.counters, counter) + nbytes)
        self.schedule_seconds = time.perf_counter() - began
        self.staging_seconds = e.wire.staging.take_seconds()  # what finishing stages counts with the next step's
        self.part = combined([part.finish() for part in parts])
        self.read_device_values()
        self._note_overflow(self.part.overflow)
        return self

    def read_device_values(self) -> None:
        """The step's device values (loss sum, accuracy count, token counts and statistics, finiteness flags) read in
        one transfer."""
        correct = [self.correct] if self.counted else []
        stats = [v for pair in self.token_stats for v in pair.unbind()]
        values = [*self.losses.values(), *correct, *stats, *(t for _, _, t, _ in self.guard.findings.pending)]
        counts = self.targets  # counted on the host
        self.target_tokens = sum(counts)
        if not values:
            return
        host = torch.stack([v.to(torch.float64) for v in values]).tolist()
        n = len(self.losses)
        self.loss_sum = sum(host[:n])
        if self.counted:
            self.correct, n = int(host[n]), n + 1
        if len(counts) == len(self.losses):  # float64 products of float32 losses and integer counts: exact
            self.token_loss_sum = sum(loss * count for loss, count in zip(host[:len(counts)], counts))
        self.token_correct = int(sum(host[n:n + len(stats):2]))
        self.entropy_sum, n = sum(host[n + 1:n + len(stats):2]), n + len(stats)
        self.guard.findings.resolve(host[n:])

    def _note_overflow(self, overflow: BufferRangeError | None) -> None:
        """A row beyond an AQ-SGD buffer's dtype (its writes landed after the schedule, waiting for no GPU inside it)
        is reported by the side that sent it (its peer holds the same row and finds the same)."""
        if overflow is None:
            return
        mb = next((i for i, ids in enumerate(self.ids) if ids is not None and overflow.sample_id in
                   getattr(ids, "tensor", ids)), 0)
        self.guard.note(BUFFER_RANGE, mb)
        self.guard.findings.overflow = self.guard.findings.overflow or overflow

    def totals(self, link: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> StepTotals:
        """This rank's share of the step's totals (`link`: its probe of the links)."""
        change = self.part.change  # its AQ-SGD sender's squares
        return StepTotals(**vars(self.counters), loss_sum=self.loss_sum, micro_batches=len(self.losses),
                          token_loss_sum=self.token_loss_sum,
                          target_tokens=self.target_tokens, token_correct=self.token_correct,
                          accuracy_tokens=self.accuracy_tokens,
                          entropy_sum=self.entropy_sum, input_tokens=self.input_tokens,
                          correct=int(self.correct),
                          counted=self.counted, nonfinite=int(self.guard.findings.bad != 0),
                          schedule_seconds=self.schedule_seconds, compute_seconds=self.compute_seconds,
                          staging_seconds=self.staging_seconds,
                          change_squares=change[0], activation_squares=change[1], link_ahead=link[0],
                          link_back=link[1], link_latency=link[2])

    # ------------------------------------------------------------------ the actions
    def _remember(self, boundary: Any, mb: int) -> None:
        if self.phase != "eval":
            self.guard.remember(boundary.forward, self.ids[mb])

    def recv_act(self, mb: int) -> None:
        e = self.runtime
        self._remember(e.prev, mb)
        x = e.prev.take_activation(self.posted.pop((sched.RECV_ACT, mb)))
        self.inputs[mb] = x.requires_grad_(self.training)

    def forward(self, mb: int) -> None:
        e = self.runtime
        e.tied.before_forward(mb, self.restores)
        seed = derive_seed(e.seed, e.replica, e.step, mb) if self.training else None
        with e.autocast(), torch.set_grad_enabled(self.training):
            out = e.stage(self.inputs.get(mb), self.staged[mb], seed=seed)
        if e.stage.is_last:
            loss = out.loss.float()
            self.losses[mb] = loss.detach()
            self._score(out.logits, self.staged[mb])
            if self.counts is not None:  # a causal LM's: what its loss falls on, how much it predicts, its input
                self.targets.append(self.host_targets[mb])
                self.input_tokens += self.host_inputs[mb]
                stats = getattr(out, "token_stats", None)  # a stage's output may not count them (a fused loss)
                if stats is not None:
                    self.token_stats.append(stats.detach())
                    self.accuracy_tokens += self.host_targets[mb]
            self.guard.finite(loss, LOSS, mb)  # a NaN loss backwards NaN gradients: the step is rejected after
            # per token: its token sum over this replica's target count, as loss / (that count / its own), which is
            # loss / micro-batches where they hold equal counts (LM blocks train as with a micro-batch's mean)
            tokens = self.replica_tokens
            # (a replica's step with no targets at all: tokens clamped, so each of its losses counts 0, not 0/0)
            out = loss / (tokens.clamp(min=1) / self.counts[mb] if tokens is not None else len(self.micro_batches))
        self.outputs[mb] = out

    def send_act(self, mb: int) -> None:
        e = self.runtime
        out = self.outputs[mb] if self.training else self.outputs.pop(mb)
        x = self.guard.zeros_unless(out.detach().to(e.wire_dtype), ACTIVATION, mb)  # never send NaN/inf
        self._remember(e.next, mb)
        e.next.send_activation(x, self.ids[mb], self.phase)
        for step in e.next.take_checks():  # its encoding's largest step: finite where the message is
            self.guard.findings.check_value(ACTIVATION, mb, step)

    def recv_grad(self, mb: int) -> None:
        self.grads[mb] = self.runtime.next.take_grad(self.posted.pop((sched.RECV_GRAD, mb)))

    def backward(self, mb: int) -> None:
        out = self.outputs.pop(mb)
        if self.runtime.stage.is_last:
            out.backward()
        else:
            out.backward(self.grads.pop(mb).to(out.dtype))
        self.runtime.tied.after_backward(mb, self.phase)

    def backward_input(self, mb: int) -> None:
        """zb1: the input's gradient now (send_grad sends it), the weights' when backward_weight runs."""
        stage = self.runtime.stage
        out, x = self.outputs.pop(mb), self.inputs.get(mb)
        grad = None if stage.is_last else self.grads.pop(mb).to(out.dtype)
        if getattr(stage, "whole_backward", False):  # a split would recompute or rescale (PipelineStage's)
            out.backward(grad)
            self.weights[mb] = None
            return
        x_grad, self.weights[mb] = split_backward.backward_input(out, grad, x, list(stage.parameters()))
        if x_grad is not None:
            x.grad = x_grad

    def backward_weight(self, mb: int) -> None:
        weights = self.weights.pop(mb)
        if weights is not None:
            weights.run()
        self.runtime.tied.after_backward(mb, self.phase)

    def send_grad(self, mb: int) -> None:
        x = self.inputs.pop(mb)
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        grad = self.guard.zeros_unless(grad.to(self.runtime.wire_dtype), GRADIENT, mb)
        if self.phase == "train":  # a backward codec with state (error feedback's residual) puts it back too
            self.guard.remember(self.runtime.prev.backward, None)
        self.runtime.prev.send_grad(grad, self.phase)
        for step in self.runtime.prev.take_checks():
            self.guard.findings.check_value(GRADIENT, mb, step)

    # ------------------------------------------------------------------ around them
    def _post_receives(self, actions: list[sched.Action]) -> dict[sched.Action, Any]:
        """Every receive of the step, posted up front in schedule order."""
        e, posted = self.runtime, {}
        for op, mb in actions:
            b, t = self.micro_batches[mb]["input_ids"].shape[:2]
            shape = torch.Size((b, t, e.stage.hidden_size))
            if op == sched.RECV_ACT:
                posted[op, mb] = e.prev.post_activation(shape, e.wire_dtype, self.ids[mb], self.phase, e.device)
            elif op == sched.RECV_GRAD:
                posted[op, mb] = e.next.post_grad(shape, e.wire_dtype, self.phase, e.device)
        return posted

    def _score(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        """Accuracy for sequence classification (logits (B, C) against labels (B,))."""
        labels = batch.get("labels")
        if logits is not None and labels is not None and logits.dim() == 2 and labels.dim() == 1:
            self.correct = self.correct + (logits.argmax(dim=-1) == labels.to(logits.device)).sum()
            self.counted += labels.numel()
