"""The pipeline engine: one stage per process, a schedule of actions, codecs on every boundary.

`train_batch` runs one optimizer step over M micro-batches: the tied weights' rows this step
reads (owner to followers, ties.py), the schedule's actions (recv/forward/send,
recv/backward/send), the followers' tied gradients to their owner, one small collective (every
rank's non-finite findings, gradient norm and totals: loss, counts, bytes, times), the
data-parallel algorithm's after_backward, global-norm clipping, the optimizer step, the
algorithm's after_step, and the LR-scheduler step. Without replicas that collective is the
step's only one; with them the norm is taken again after the algorithm, and its bytes summed.
Every stage loads the same micro-batches itself; only boundary activations and their
gradients cross the pipeline, as codec messages. Bytes are counted per step.

Non-finite values never cross a boundary: a NaN/inf activation or gradient about to be sent
is replaced by zeros (the peer is waiting for a message of a known size, so the schedule
runs to its end and no stage blocks), and after the schedule every rank learns which stages
saw what (in that collective). The step then leaves no trace (weights, optimizer, codec
buffers and generators as before it) and either raises FloatingPointError on every rank
alike, naming step, stage and micro-batch, or, with skip_nonfinite, is skipped everywhere.
An activation the AQ-SGD buffer's dtype cannot hold (float16 above 65504) goes the same way,
caught before it is stored, and stops the run on every rank with a ValueError naming the
boundary, the sample and the remedy (a bfloat16 or float32 buffer): skipping would not help.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from compression import BackwardCodec, BufferRangeError, ForwardCodec, QuantizedTensor, SampleIds

from . import schedule as sched
from .auto_bits import DIRECTIONS, AutoBits, Link, allowed_bits
from .compression_config import CompressionConfig
from . import split_backward
from .seeding import derive_seed
from .ties import Tie, TiedWeights
from .topology import BOUNDARY, TIE, Groups
from .transport import Boundary, Wire

# what a stage found non-finite in a step (a bit mask, agreed on by every rank)
LOSS, ACTIVATION, GRADIENT, PARAM_GRAD, BUFFER_RANGE = 1, 2, 4, 8, 16
_KINDS = {LOSS: "loss", ACTIVATION: "activation to send", GRADIENT: "boundary gradient to send",
          PARAM_GRAD: "parameter gradients"}  # BUFFER_RANGE has a line of its own (_verdict)


# the columns of a rank's row in the step's one collective (_exchange): its verdict (what, first micro-batch,
# overflowing sample and value), its gradients' squared norm, then its StepTotals fields
_ROW_SQUARES, _ROW_TOTALS = 4, 5
PROBE_BYTES = 64 << 10  # a link probe's large message (auto bits): 52 ms on 10 Mbit/s, above the noise


class Stage(Protocol):
    """What the engine needs of a stage module (pipeline.partition builds them)."""

    stage_index: int
    num_stages: int
    is_first: bool
    is_last: bool
    hidden_size: int

    def __call__(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor], seed: int | None = None) -> Any:
        """`seed`: this micro-batch's (training only); a stage with dropout seeds each part from it (seeding.py)."""

    def parameters(self) -> Any: ...
    def tied_parameters(self) -> dict[str, torch.nn.Parameter]: ...


@dataclass
class StepCounters:
    """Bytes this rank sent in one step, by wire."""

    fwd_bytes: int = 0
    bwd_bytes: int = 0
    tie_bytes: int = 0
    dp_bytes: int = 0


@dataclass
class StepTotals(StepCounters):
    """One step summed over the whole job, the same on every rank: the last stages' loss and eval counts, each
    rank's bytes, how many ranks saw a non-finite value, and the seconds the ranks spent in the schedule and, of
    them, computing (forwards and backwards)."""

    loss_sum: float = 0.0
    correct: int = 0
    counted: int = 0
    nonfinite: int = 0
    schedule_seconds: float = 0.0
    compute_seconds: float = 0.0
    change_squares: float = 0.0  # AQ-SGD senders' sum of ||a - m||^2 over the changes they sent
    activation_squares: float = 0.0  # and of ||a||^2 over the same rows
    # this rank's probe of the link to its next stage (auto bits): read per row from the table, never summed
    link_ahead: float = 0.0  # seconds a byte, activations' way
    link_back: float = 0.0  # seconds a byte, gradients' way
    link_latency: float = 0.0  # seconds a message

    def change(self) -> float | None:
        """||a - m|| / ||a|| over every AQ-SGD change the step sent (None when it sent none)."""
        return (self.change_squares / self.activation_squares) ** 0.5 if self.activation_squares > 0 else None

    def bubble(self) -> float | None:
        """The fraction of the schedule's time the stages waited instead of computing (the pipeline bubble)."""
        return 1.0 - self.compute_seconds / self.schedule_seconds if self.schedule_seconds > 0 else None

    def mean_loss(self, micro_batches: int, replicas: int) -> float:
        """The mean micro-batch loss: every replica's last stage adds one loss per micro-batch."""
        return self.loss_sum / (micro_batches * replicas)


_TOTALS = tuple(f.name for f in fields(StepTotals))
_FLOATS = {f.name for f in fields(StepTotals) if f.type in (float, "float")}


@dataclass
class StepMetrics:
    """What `train_batch` returns, alike on every rank: the step's loss (NaN when skipped), its learning rate
    and gradient norm, the bytes every wire carried over the whole job, and the step's time."""

    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    fwd_bytes: int
    bwd_bytes: int
    tie_bytes: int
    dp_bytes: int
    phase: str
    seconds: float
    skipped: str | None = None  # why, for a step skipped on every rank (skip_nonfinite)
    bubble: float | None = None  # of the schedule's time over all ranks, the fraction outside forwards/backwards
    # (on CUDA an approximation: kernels run asynchronously, so some compute shows as the next sync's wait)
    fwd_change: float | None = None  # ||a - m|| / ||a|| over the AQ-SGD changes sent (None: the step sent none:
    # no aqsgd boundary, a warm-up step, or first visits only)
    bits: dict[str, int] | None = None  # with auto bits: "boundary.direction" -> the bits this step's messages used
    bits_decision: dict[str, Any] | None = None  # with auto bits, on a decision step: its inputs and outcome

    def record(self) -> dict[str, Any]:
        """A JSON object for metrics.jsonl: a skipped step says why instead of a NaN loss and gradient norm."""
        drop = ("skipped",) if self.skipped is None else ("loss", "grad_norm")
        return {k: v for k, v in vars(self).items() if k not in drop}


@dataclass
class _Flight:
    """Tensors of the micro-batches in flight on this stage."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, split_backward.WeightGradients | None] = field(default_factory=dict)  # zb1's still to run
    losses: dict[int, float] = field(default_factory=dict)
    correct: int = 0
    counted: int = 0
    bad: int = 0  # bit mask of the non-finite kinds found on this stage
    bad_mb: int = -1  # the first micro-batch where one was found
    schedule_seconds: float = 0.0  # from the schedule's first action to its sends' completion
    compute_seconds: float = 0.0  # of it, in forwards and backwards
    overflow: BufferRangeError | None = None  # an activation the AQ-SGD buffer could not hold
    verdict_error: Exception | None = None  # what every rank raises after undoing the step, whatever skip_nonfinite
    undo: list[Callable[[], None]] = field(default_factory=list)  # puts back what the step changed, newest last


def followed_parameters(stage: Stage, ties: dict[str, Tie] | None) -> list[torch.nn.Parameter]:
    """This stage's copies of tied weights that another stage owns (they take the owner's rows each step)."""
    return [p for key, p in stage.tied_parameters().items()
            if key in (ties or {}) and ties[key].owner != stage.stage_index]


def owned_parameters(stage: Stage, ties: dict[str, Tie] | None) -> list[torch.nn.Parameter]:
    """The parameters this stage's optimizer and data-parallel algorithm update.

    A tied weight is stepped by its owner alone (ties.py); the followers' copies take the owner's rows
    each step, so an algorithm keeping state about its parameters (replicas, drift, error memory)
    never sees them change behind its back.
    """
    followers = {id(p) for p in followed_parameters(stage, ties)}
    return [p for p in stage.parameters() if id(p) not in followers]


class PipelineEngine:
    def __init__(
        self, stage: Stage, groups: Groups, optimizer: torch.optim.Optimizer, *,
        compression: CompressionConfig | None = None, num_samples: int, seq_len: int,
        lr_scheduler: Any = None, gradient_clipping: float = 0.0, schedule: str = "1f1b",
        ties: dict[str, Tie] | None = None, device: torch.device | str = "cpu", bf16: bool = False,
        seed: int = 0, data_parallel: Any = None, skip_nonfinite: bool = False,
    ) -> None:
        if schedule not in sched.SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(sched.SCHEDULES)}")
        self.stage, self.groups = stage, groups
        self.data_parallel = data_parallel  # a data_parallel.Algorithm over this stage's replicas, or None
        self.optimizer = data_parallel.wrap_optimizer(optimizer) if data_parallel is not None else optimizer
        self.lr_scheduler, self.gradient_clipping, self.schedule = lr_scheduler, gradient_clipping, schedule
        self.compression = (compression or CompressionConfig()).validate()
        self.device, self.bf16 = torch.device(device), bf16
        # activations cross in bf16 under bf16 autocast or with bf16 weights (which compute in bf16), else float32
        weights = next((p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32)
        self.wire_dtype = torch.bfloat16 if bf16 or weights == torch.bfloat16 else torch.float32
        self.ties = {k: v for k, v in sorted((ties or {}).items()) if groups.stage in v.holders}
        self.wire = Wire()
        c = self.compression
        self.tied = TiedWeights(stage.tied_parameters(), self.ties, groups.stage, self.wire, groups.pipeline_rank_of,
                                channel=lambda src, dst: groups.channel(TIE, src, dst),
                                mode=c.tie_mode(), bits=c.tie_bits, stochastic=c.stochastic,
                                seed=seed * 100 + groups.replica)
        self.global_step = 0
        self.seed = seed
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        self.num_samples = num_samples  # rows of each AQ-SGD buffer: a training micro-batch's ids index them
        self.auto_bits = self._auto_bits() if c.auto() else None
        self._link = (0.0, 0.0, 0.0)  # this step's probe of the next link (auto bits)
        self._bits: tuple[dict[str, int] | None, dict[str, Any] | None] = (None, None)  # the step's bits, decision
        self.prev = self._boundary(groups.stage - 1, num_samples, seq_len, seed) if not stage.is_first else None
        self.next = self._boundary(groups.stage, num_samples, seq_len, seed) if not stage.is_last else None

    # ------------------------------------------------------------------ construction
    def _boundary(self, index: int, num_samples: int, seq_len: int, seed: int) -> Boundary:
        """The codecs of boundary `index` (between stages index and index+1), on this side of it."""
        c, here = self.compression, self.groups.stage
        side = "send" if here == index else "recv"
        peer = self.groups.pipeline_rank_of(index + 1 if side == "send" else index)
        path = None
        if c.buffer_dir and c.forward == "aqsgd":
            path = os.path.join(c.buffer_dir, f"boundary{index}_{side}_replica{self.groups.replica}.buf")
        shape = (seq_len, self.stage.hidden_size)
        kw = {"num_samples": num_samples, "sample_shape": shape, "buffer_dtype": c.buffer_dtype,
              "buffer_path": path, "buffer_bits": c.buffer_bits} if c.forward == "aqsgd" else {}
        codec_seed = seed * 1000 + index * 10 + self.groups.replica  # only the sender's draws matter
        rotation_seed = seed * 1000 + index * 10  # hadamard's signs: the same on both sides and in every replica
        bits = {d: self.auto_bits.bits[(index, d)] if c.auto(d) else getattr(c, f"{d}_bits") for d in DIRECTIONS}
        forward = ForwardCodec(c.forward, bits["forward"], stochastic=c.stochastic, seed=codec_seed,
                               group_size=c.group_size("forward", shape[-1], bits["forward"]),
                               rotation_seed=rotation_seed, adaptive=c.auto("forward"), **kw)
        backward = BackwardCodec(c.backward, bits["backward"], stochastic=c.stochastic, seed=codec_seed + 1,
                                 group_size=c.group_size("backward", shape[-1], bits["backward"]),
                                 rotation_seed=rotation_seed + 1, adaptive=c.auto("backward"))
        ahead, back = (index, index + 1), (index + 1, index)  # activations flow ahead, gradients back
        out_link, in_link = (ahead, back) if side == "send" else (back, ahead)
        return Boundary(self.wire, peer, forward, backward, ForwardCodec("none"), BackwardCodec("none"),
                        outgoing=self.groups.channel(BOUNDARY, *out_link),
                        incoming=self.groups.channel(BOUNDARY, *in_link))

    def _auto_bits(self) -> AutoBits:
        """The candidates of every automatic direction (inside the bounds and the theorem) at this model's width."""
        c, width, boundaries = self.compression, self.stage.hidden_size, self.groups.grid.stages - 1
        if c.link_mbit is not None and len(c.link_mbit) != boundaries:
            raise ValueError(f"link_mbit={c.link_mbit}: expected {boundaries} rates, one per boundary")
        allowed = {d: allowed_bits(c.auto_bits_min, c.auto_bits_max, width,
                                   lambda bits, d=d: c.group_size(d, width, bits)) for d in DIRECTIONS if c.auto(d)}
        return AutoBits(boundaries, allowed)

    # ------------------------------------------------------------------ bits per link
    def _decision_step(self) -> bool:
        return self.auto_bits is not None and self.global_step % self.compression.auto_bits_every == 0

    def _probe_links(self) -> tuple[float, float, float]:
        """Probe this rank's links, even boundaries first, then odd ones (a rank is in one probe at a time);
        returns the probe of the next link (zeros on the last stage)."""
        mine, stage = (0.0, 0.0, 0.0), self.groups.stage
        for parity in (0, 1):
            if self.next is not None and stage % 2 == parity:
                mine = self.next.probe(True, PROBE_BYTES, self.device)
            if self.prev is not None and (stage - 1) % 2 == parity:
                self.prev.probe(False, PROBE_BYTES, self.device)
        return mine

    def _observe_compute(self, table: torch.Tensor, micro_batches: int) -> None:
        """Every step, for auto bits: each stage's compute per micro-batch (its slowest replica's)."""
        grid, col = self.groups.grid, _ROW_TOTALS + _TOTALS.index("compute_seconds")
        self.auto_bits.observe([float(table[[grid.rank(s, r) for r in range(grid.replicas)], col].max()) / micro_batches
                                for s in range(grid.stages)])

    def _decide_bits(self, table: torch.Tensor, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """New bits from the job-wide table, the same on every rank: per boundary, its slowest replica's link each
        way, priced on the schedule with the compute seen since the last decision. Sets this rank's codecs."""
        c, grid, width = self.compression, self.groups.grid, self.stage.hidden_size
        col = {n: _ROW_TOTALS + _TOTALS.index(n) for n in ("link_ahead", "link_back", "link_latency")}
        rows, seq = micro_batches[0]["input_ids"].shape[:2]
        links = {}
        for b in range(grid.stages - 1):
            senders = [grid.rank(b, r) for r in range(grid.replicas)]
            for direction, way in (("forward", "link_ahead"), ("backward", "link_back")):
                links[(b, direction)] = Link(8 / (c.link_mbit[b] * 1e6)) if c.link_mbit is not None else Link(
                    float(table[senders, col[way]].max()), float(table[senders, col["link_latency"]].max()))

        def message_bytes(b: int, direction: str, bits: int | None) -> int:
            ids = 8 * rows if direction == "forward" else 0  # the sample ids travel with activations
            if getattr(c, direction) == "none":
                return rows * seq * width * self.wire_dtype.itemsize + ids
            return QuantizedTensor.wire_nbytes((rows, seq, width), bits, c.group_size(direction, width, bits)) + ids

        fixed = {k: link.seconds(message_bytes(*k, getattr(c, f"{k[1]}_bits"))) for k, link in links.items()
                 if k[1] not in self.auto_bits.allowed}
        schedules = [sched.train_schedule(self.schedule, s, grid.stages, len(micro_batches))
                     for s in range(grid.stages)]
        changed = self.auto_bits.decide(self.global_step + 1, schedules,  # the step it ends
                                        {k: v for k, v in links.items() if k[1] in self.auto_bits.allowed},
                                        message_bytes, c.auto_bits_slack, fixed)
        for (b, direction), bits in changed.items():
            for boundary, index in ((self.next, self.groups.stage), (self.prev, self.groups.stage - 1)):
                if boundary is not None and index == b:
                    getattr(boundary, direction).set_bits(bits, c.group_size(direction, width, bits))
        return self.auto_bits.last

    # ------------------------------------------------------------------ one batch
    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _shape(self, batch: dict[str, torch.Tensor]) -> torch.Size:
        b, t = batch["input_ids"].shape[:2]
        return torch.Size((b, t, self.stage.hidden_size))

    @staticmethod
    def _note(kind: int, mb: int, flight: _Flight) -> None:
        flight.bad |= kind
        flight.bad_mb = mb if flight.bad_mb < 0 else flight.bad_mb

    @classmethod
    def _finite(cls, x: torch.Tensor, kind: int, mb: int, flight: _Flight) -> bool:
        """Whether x is all finite; if not, note what and where on the flight."""
        if bool(torch.isfinite(x).all()):
            return True
        cls._note(kind, mb, flight)
        return False

    def _sample_ids(self, sample_ids: Any, phase: str) -> Any:
        """A micro-batch's ids, checked once per step where AQ-SGD buffers read them (sender, receiver, undo)."""
        has_boundary = self.prev is not None or self.next is not None
        buffered = phase != "eval" and self.compression.forward == "aqsgd" and has_boundary
        return SampleIds(sample_ids, self.num_samples) if buffered else sample_ids

    @staticmethod
    def _remember(boundary: Boundary, sample_ids: Any, phase: str, flight: _Flight) -> None:
        """Before an AQ-SGD update of a buffer, keep its rows so a rejected step can be undone."""
        if phase != "eval":
            flight.undo.append(boundary.forward.undo_point(sample_ids))

    def _run(self, actions: list[sched.Action], micro_batches: list[dict], phase: str, training: bool) -> _Flight:
        flight, counters, m = _Flight(), self._counters, len(micro_batches)
        undo = flight.undo if phase != "eval" else None  # a training step may be rejected: note what it changes
        ids = [self._sample_ids(batch.get("sample_id"), phase) for batch in micro_batches]

        def recv_act(mb: int) -> None:
            self._remember(self.prev, ids[mb], phase, flight)
            x = self.prev.take_activation(posted.pop((sched.RECV_ACT, mb)))
            flight.inputs[mb] = x.requires_grad_(training)

        def forward(mb: int) -> None:
            self.tied.before_forward(mb, undo)
            seed = derive_seed(self.seed, self.groups.replica, self.global_step, mb) if training else None
            with self._autocast(), torch.set_grad_enabled(training):
                out = self.stage(flight.inputs.get(mb), micro_batches[mb], seed=seed)
            if self.stage.is_last:
                loss = out.loss.float()
                flight.losses[mb] = loss.item()
                self._score(out.logits, micro_batches[mb], flight)
                out = loss / m if self._finite(loss, LOSS, mb, flight) else None  # None: no backward through it
            flight.outputs[mb] = out

        def send_act(mb: int) -> None:
            out = flight.outputs[mb] if training else flight.outputs.pop(mb)
            x = out.detach().to(self.wire_dtype)
            if not self._finite(x, ACTIVATION, mb, flight):
                x = torch.zeros_like(x)  # never send NaN/inf; the step is rejected after the schedule
            self._remember(self.next, ids[mb], phase, flight)
            try:
                counters.fwd_bytes += self.next.send_activation(x, ids[mb], phase)
            except BufferRangeError as exc:  # nothing stored or sent yet: the peer gets zeros, the step stops
                self._note(BUFFER_RANGE, mb, flight)
                flight.overflow = flight.overflow or exc
                counters.fwd_bytes += self.next.send_activation(torch.zeros_like(x), ids[mb], phase)

        def recv_grad(mb: int) -> None:
            flight.grads[mb] = self.next.take_grad(posted.pop((sched.RECV_GRAD, mb)))

        def backward(mb: int) -> None:
            out = flight.outputs.pop(mb)
            if out is not None and self.stage.is_last:
                out.backward()
            elif out is not None:
                out.backward(flight.grads.pop(mb).to(out.dtype))
            counters.tie_bytes += self.tied.after_backward(mb, phase)

        def backward_input(mb: int) -> None:
            """zb1: the input's gradient now (send_grad sends it), the weights' when backward_weight runs."""
            out, x = flight.outputs.pop(mb), flight.inputs.get(mb)
            if out is None:  # a non-finite loss: nothing to backward
                flight.weights[mb] = None
                return
            grad = None if self.stage.is_last else flight.grads.pop(mb).to(out.dtype)
            if getattr(self.stage, "activation_checkpointing", False):  # split, it would recompute per weight node
                out.backward(grad)
                flight.weights[mb] = None
                return
            x_grad, flight.weights[mb] = split_backward.backward_input(out, grad, x, list(self.stage.parameters()))
            if x_grad is not None:
                x.grad = x_grad

        def backward_weight(mb: int) -> None:
            weights = flight.weights.pop(mb)
            if weights is not None:
                weights.run()
            counters.tie_bytes += self.tied.after_backward(mb, phase)

        def send_grad(mb: int) -> None:
            x = flight.inputs.pop(mb)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            grad = grad.to(self.wire_dtype)
            if not self._finite(grad, GRADIENT, mb, flight):
                grad = torch.zeros_like(grad)
            counters.bwd_bytes += self.prev.send_grad(grad, phase)

        handlers: dict[str, Callable[[int], None]] = {
            sched.RECV_ACT: recv_act, sched.FORWARD: forward, sched.SEND_ACT: send_act,
            sched.RECV_GRAD: recv_grad, sched.BACKWARD: backward, sched.SEND_GRAD: send_grad,
            sched.BACKWARD_INPUT: backward_input, sched.BACKWARD_WEIGHT: backward_weight,
        }
        posted = self._post_receives(actions, micro_batches, ids, phase)
        counters.tie_bytes += self.tied.start(micro_batches, phase, training, undo)
        began = time.perf_counter()
        for op, mb in actions:
            if op in sched.COMPUTE:
                t = time.perf_counter()
                handlers[op](mb)
                flight.compute_seconds += time.perf_counter() - t
            else:
                handlers[op](mb)
        self.wire.flush()
        flight.schedule_seconds = time.perf_counter() - began
        return flight

    def _post_receives(self, actions: list[sched.Action], micro_batches: list[dict], ids: list[Any],
                       phase: str) -> dict:
        """Post every receive of the step up front, in schedule order: gloo starts a transfer only once
        its receive is posted, so this overlaps each message's flight with this stage's compute."""
        posted = {}
        for op, mb in actions:
            batch = micro_batches[mb]
            if op == sched.RECV_ACT:
                posted[op, mb] = self.prev.post_activation(self._shape(batch), self.wire_dtype, ids[mb], phase,
                                                           self.device)
            elif op == sched.RECV_GRAD:
                posted[op, mb] = self.next.post_grad(self._shape(batch), self.wire_dtype, phase, self.device)
        return posted

    @staticmethod
    def _score(logits: torch.Tensor, batch: dict[str, torch.Tensor], flight: _Flight) -> None:
        """Accuracy for sequence classification (logits (B, C) against labels (B,))."""
        labels = batch.get("labels")
        if logits is not None and labels is not None and logits.dim() == 2 and labels.dim() == 1:
            flight.correct += int((logits.argmax(dim=-1) == labels.to(logits.device)).sum())
            flight.counted += labels.numel()

    def train_batch(self, micro_batches: list[dict[str, torch.Tensor]], epoch: int = 0) -> StepMetrics:
        """One optimizer step over the micro-batches; its metrics, the same on every stage."""
        if not micro_batches:
            raise ValueError("train_batch needs at least one micro-batch")
        start = time.perf_counter()
        self._counters = StepCounters()
        phase = "warmup" if epoch < self.compression.warmup_epochs else "train"
        deciding = self._decision_step()
        self._link = self._probe_links() if deciding and self.compression.link_mbit is None else (0.0, 0.0, 0.0)
        bits_used = None if self.auto_bits is None else self.auto_bits.record()
        self.stage.train()
        actions = sched.train_schedule(self.schedule, self.groups.stage, self.groups.grid.stages, len(micro_batches))
        generators = self._generator_states()
        flight = self._run(actions, micro_batches, phase, training=True)
        self.tied.finish()  # the owner's tied gradient is whole from here
        table = self._exchange(flight, self._grad_squares(flight))
        totals = self._totals(table)
        verdict = self._verdict(table, flight)
        if self.auto_bits is not None and verdict is None:  # a rejected step's compute is partial (no backward)
            self._observe_compute(table, len(micro_batches))
        self._bits = (bits_used, self._decide_bits(table, micro_batches) if deciding else None)  # for the next steps
        if verdict is not None:
            return self._reject(flight, totals, generators, verdict, epoch, phase, start, len(micro_batches))
        norm = None  # the algorithm may change the gradients: their norm is taken again after it
        if self.data_parallel is not None:
            self.data_parallel.after_backward()
        else:
            norm = self._pipeline_norm(table)
        grad_norm = self._clip(norm)
        self.optimizer.step()
        if self.data_parallel is not None:
            self.data_parallel.after_step()
            dp_bytes = torch.tensor([float(self.data_parallel.comm.take_bytes())], dtype=torch.float64)
            totals.dp_bytes = int(self._sum_over_job(dp_bytes).item())  # known only after the optimizer step
        self._zero_grads()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_step += 1
        return self._metrics(totals, len(micro_batches), epoch, lr, grad_norm, phase, start)

    def _metrics(self, t: StepTotals, m: int, epoch: int, lr: float, grad_norm: float, phase: str, start: float,
                 skipped: str | None = None) -> StepMetrics:
        loss = float("nan") if skipped is not None else t.mean_loss(m, self.groups.grid.replicas)
        bits, decision = self._bits
        return StepMetrics(self.global_step, epoch, loss, lr, grad_norm, t.fwd_bytes, t.bwd_bytes, t.tie_bytes,
                           t.dp_bytes, phase, time.perf_counter() - start, skipped, t.bubble(), t.change(), bits,
                           decision)

    def _zero_grads(self) -> None:
        """Every gradient of the stage, not only the optimizer's: a tied copy that follows its owner is outside
        the optimizer, and a gradient left on it (a rejected step) would be sent with the next step's."""
        self.optimizer.zero_grad(set_to_none=True)
        self.stage.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ non-finite steps
    def _codecs(self) -> dict[str, Any]:
        """This rank's stateful codecs by name (the full-precision fallbacks keep no state)."""
        out = {}
        for name, boundary in (("prev", self.prev), ("next", self.next)):
            if boundary is not None:
                out[f"{name}.forward"], out[f"{name}.backward"] = boundary.forward, boundary.backward
        return {**out, **self.tied.codecs()}

    def file_buffers(self) -> dict[str, Any]:
        """This rank's AQ-SGD buffers kept in files (buffer_dir), by codec name: `state_dict()` leaves their rows
        in the files, which a checkpoint copies (`SampleBuffer.write_rows` / `read_rows`)."""
        buffers = {name: getattr(codec, "buffer", None) for name, codec in self._codecs().items()}
        return {name: b for name, b in buffers.items() if b is not None and b.path is not None}

    def _generator_states(self) -> dict[str, torch.Tensor]:
        return {name: codec.generator.get_state() for name, codec in self._codecs().items()}

    def _grad_squares(self, flight: _Flight) -> float:
        """This stage's share of the squared global gradient norm (a tied weight counts once, at its owner); notes
        PARAM_GRAD on the flight when a gradient it holds is not finite (a followed tied copy's: found in the rows
        it sent, without a scan of the whole copy, which for GPT2's embedding is vocabulary x width)."""
        squares = self._owned_squares()  # inf or NaN where a gradient is not finite
        if not flight.bad and (self.tied.nonfinite_gradient or not bool(torch.isfinite(squares))):
            flight.bad |= PARAM_GRAD
        return float(squares)

    def _owned_squares(self) -> torch.Tensor:
        """The sum of squares of the gradients this stage steps, accumulated in float64 (one fused reduction a
        gradient, 7x faster than `g.double().pow(2).sum()`), brought to the CPU once."""
        grads = [p.grad.detach() for p in owned_parameters(self.stage, self.ties) if p.grad is not None]
        if not grads:  # a tied weight counts once, at its owner
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum().cpu()

    def _exchange(self, flight: _Flight, grad_squares: float = 0.0) -> torch.Tensor:
        """The step's one collective: a row per rank (what it found non-finite and where, an activation its AQ-SGD
        buffer could not hold, its gradients' squared norm, its totals), summed over the job so that every rank
        holds every row (a rank that found something non-finite sends no squares)."""
        grid, over = self.groups.grid, flight.overflow
        change, activation = self.next.forward.take_change() if self.next is not None else (0.0, 0.0)
        mine = StepTotals(**vars(self._counters), loss_sum=sum(flight.losses.values()), correct=flight.correct,
                          counted=flight.counted, nonfinite=int(flight.bad != 0),
                          schedule_seconds=flight.schedule_seconds, compute_seconds=flight.compute_seconds,
                          change_squares=change, activation_squares=activation, link_ahead=self._link[0],
                          link_back=self._link[1], link_latency=self._link[2])
        row = [flight.bad, flight.bad_mb + 1, over.sample_id if over else 0, over.value if over else 0.0,
               grad_squares if flight.bad == 0 else 0.0, *(float(getattr(mine, n)) for n in _TOTALS)]
        table = torch.zeros(grid.world_size, len(row), dtype=torch.float64)
        table[self.groups.rank] = torch.tensor(row, dtype=torch.float64)
        return self._sum_over_job(table)

    def _sum_over_job(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over every rank, in place: over the pipeline group, then the data-parallel one (together they
        span the job; a group of a single rank is skipped)."""
        g = self.groups
        for group, size in ((g.pipeline, g.grid.stages), (g.data_parallel, g.grid.replicas)):
            if group is not None and size > 1:
                dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def _totals(table: torch.Tensor) -> StepTotals:
        """The step's totals over the whole job, from the exchanged table."""
        sums = table[:, _ROW_TOTALS:].sum(dim=0).tolist()
        return StepTotals(**{n: (float(v) if n in _FLOATS else int(v)) for n, v in zip(_TOTALS, sums)})

    def _pipeline_norm(self, table: torch.Tensor) -> float:
        """The global gradient norm of this replica's pipeline, from the exchanged table."""
        grid = self.groups.grid
        mine = [rank for rank in range(grid.world_size) if grid.coords(rank)[1] == self.groups.replica]
        return float(table[mine, _ROW_SQUARES].sum().sqrt())

    def _verdict(self, table: torch.Tensor, flight: _Flight) -> str | None:
        """What every rank found non-finite this step, from the exchanged table; None when none did."""
        grid = self.groups.grid
        if not bool(table[:, 0].any()):
            return None
        found, overflows = [], []
        for rank, (bad, mb, sample, value) in enumerate(table[:, :_ROW_SQUARES].tolist()):
            bad, mb, stage, replica = int(bad), int(mb), *grid.coords(rank)
            if bad & BUFFER_RANGE:
                dtype = str(self.compression.buffer_dtype).removeprefix("torch.")
                overflows.append(f"boundary {stage} (stage {stage} to {stage + 1}, rank {rank}, replica {replica}): "
                                 f"sample {int(sample)}'s activation reaches {value:.4g} at step "
                                 f"{self.global_step + 1}, beyond what the {dtype} AQ-SGD buffer can hold")
            elif bad:
                kinds = ", ".join(text for bit, text in _KINDS.items() if bad & bit)
                where = f" (micro-batch {mb - 1})" if mb else ""
                found.append(f"stage {stage} (rank {rank}, replica {replica}): {kinds}{where}")
        if overflows:
            line = "; ".join(overflows) + ": use buffer_dtype bfloat16 or float32 (--buffer_dtype)"
            flight.verdict_error = ValueError(line)  # raised by _reject once the step is undone
            return line
        return f"non-finite values at step {self.global_step + 1}: " + "; ".join(found)

    def _reject(self, flight: _Flight, totals: StepTotals, generators: dict[str, torch.Tensor], verdict: str,
                epoch: int, phase: str, start: float, m: int) -> StepMetrics:
        """Undo every trace of the step (codec buffers and dither, gradients); raise or skip as configured. The
        totals' bytes did cross (as zeros where values were not finite)."""
        for restore in reversed(flight.undo):
            restore()
        for name, codec in self._codecs().items():
            codec.generator.set_state(generators[name])
        self._zero_grads()
        self.global_step += 1
        if flight.verdict_error is not None:
            raise flight.verdict_error
        if not self.skip_nonfinite:
            raise FloatingPointError(f"{verdict}; stopping (skip_nonfinite skips such steps instead)")
        self.skipped_steps += 1
        return self._metrics(totals, m, epoch, self.optimizer.param_groups[0]["lr"], float("nan"), phase, start,
                             skipped=verdict)

    # ------------------------------------------------------------------ checkpoints
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's weights under their HF names, less the tied copies it follows (their owner's is the
        truth; a follower's rows are current only where it reads them): what merge_into takes."""
        followed = {id(p) for p in followed_parameters(self.stage, self.ties)}
        skip = {name for name, p in self.stage.named_parameters() if id(p) in followed}
        return {k: v for k, v in self.stage.hf_state_dict().items() if k not in skip}

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine needs to continue exactly: weights, optimizer, LR scheduler, step,
        codecs (dither generators, AQ-SGD buffers and seen bits), data-parallel algorithm. The rows of buffers
        kept in files stay in the files (`file_buffers()`: a checkpoint copies them)."""
        grid = self.groups.grid
        return {
            "place": {"stage": self.groups.stage, "replica": self.groups.replica, "stages": grid.stages,
                      "replicas": grid.replicas},
            "global_step": self.global_step, "skipped_steps": self.skipped_steps,
            "model": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "codecs": {name: codec.state_dict() for name, codec in self._codecs().items()},
            "data_parallel": None if self.data_parallel is None else self.data_parallel.state_dict(),
            "auto_bits": None if self.auto_bits is None else self.auto_bits.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of state_dict; ValueError saying what differs when the state is another place's."""
        grid = self.groups.grid
        mine = {"stage": self.groups.stage, "replica": self.groups.replica, "stages": grid.stages,
                "replicas": grid.replicas}
        diff = [f"{k}={state['place'].get(k)!r} (this engine: {v!r})" for k, v in mine.items()
                if state["place"].get(k) != v]
        if diff:
            raise ValueError("engine state from another place in the grid: " + ", ".join(diff))
        codecs = self._codecs()
        if set(state["codecs"]) != set(codecs):
            raise ValueError(f"engine state has codecs {sorted(state['codecs'])}, this stage {sorted(codecs)}")
        if (state["data_parallel"] is None) != (self.data_parallel is None):
            raise ValueError("engine state and this engine differ in whether a data-parallel algorithm runs")
        try:
            self.stage.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ValueError(f"the saved stage {self.groups.stage} does not fit this model: {exc}") from None
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for name, codec in codecs.items():
            codec.load_state_dict(state["codecs"][name])
        if self.data_parallel is not None:
            self.data_parallel.load_state_dict(state["data_parallel"])
        if (state.get("auto_bits") is None) != (self.auto_bits is None):
            raise ValueError("engine state and this engine differ in whether bits are chosen per link (auto)")
        if self.auto_bits is not None:
            self.auto_bits.load_state_dict(state["auto_bits"])  # the codecs restored their current bits themselves
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    @torch.no_grad()
    def eval_batch(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Forward only at full precision (AQ-SGD buffers untouched); loss and, for classification, accuracy."""
        self._counters = StepCounters()
        self.stage.eval()
        actions = sched.forward_only(self.groups.stage, self.groups.grid.stages, len(micro_batches))
        flight = self._run(actions, micro_batches, "eval", training=False)
        t = self._totals(self._exchange(flight))
        loss = t.mean_loss(len(micro_batches), self.groups.grid.replicas)
        result = {"loss": loss if not t.nonfinite else float("nan")}  # some stage saw NaN/inf (zeros were sent)
        if t.counted:
            result["accuracy"] = t.correct / t.counted
        return result

    # ------------------------------------------------------------------ after backward
    def _clip(self, norm: float | None) -> float:
        """Clips to the global gradient norm if configured; `norm` None: taken here over the pipeline (each tied
        weight counted once), as after a data-parallel algorithm that changed the gradients."""
        if norm is None:
            sq = self._owned_squares()
            if self.groups.pipeline is not None and self.groups.grid.stages > 1:
                dist.all_reduce(sq, group=self.groups.pipeline)
            norm = float(sq.sqrt())
        if not torch.isfinite(torch.tensor(norm)):
            raise FloatingPointError(f"gradient norm is {norm} at step {self.global_step + 1} after the data-parallel "
                                     f"step (stage {self.groups.stage}, replica {self.groups.replica})")
        if self.gradient_clipping and norm > self.gradient_clipping:
            scale = self.gradient_clipping / (norm + 1e-6)
            for p in owned_parameters(self.stage, self.ties):  # a followed copy's gradient is not stepped
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm
