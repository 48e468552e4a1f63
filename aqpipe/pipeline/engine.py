"""The pipeline engine: one stage per process, a schedule of actions, codecs on every boundary.

`train_batch` runs one optimizer step over M micro-batches, in the order it reads:

    probe the links (auto bits, on a decision step)
    run the schedule (step_run.py): the tied weights' rows this step reads, then recv/forward/send and
        recv/backward/send per micro-batch, the followers' tied gradients back to their owner
    exchange the step table (step_table.py): one small collective, one round of direct messages (over slow
        links, one latency): every rank's findings, gradient norm and totals (loss, counts, bytes, times)
    reach the verdict, the same on every rank: a NaN/inf or an activation the AQ-SGD buffer cannot hold rejects
        the step, which is undone (step_guard.py) and raises or, with skip_nonfinite, is skipped everywhere
    accept: the data-parallel algorithm's after_backward, global-norm clipping, the optimizer step, the
        algorithm's after_step, the LR scheduler

Without replicas that collective is the step's only one; with them the norm is taken again after the algorithm
(over the pipeline) and its bytes summed (over the job), each another such round. Every stage loads the same
micro-batches itself; only boundary activations and their gradients cross the pipeline, as codec messages, and a
NaN/inf is never sent (zeros go in its place, so the peer receives a message of the size it expects and the
schedule runs to its end).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import schedule as sched
from .auto_bits import DIRECTIONS, AutoBitsController
from .codec_factory import CodecFactory
from .compression_config import CompressionConfig
from .step_guard import StepGuard
from .engine_settings import EngineSettings
from .step_run import StageRuntime, StepRun, causal_lm_labels
from .step_table import PARAM_GRAD, TOKEN_METRICS, Row, StepCounters, StepTable, StepTotals, sum_over_job
from .ties import Tie, TiedWeights
from .topology import BOUNDARY, TIE, Groups
from .transport import Boundary, Wire

__all__ = ["PipelineEngine", "StepCounters", "StepMetrics", "StepTotals", "followed_parameters",
           "owned_parameters"]


class Stage(Protocol):
    """What the engine needs of a stage module (pipeline.partition and pipeline.loading build them)."""

    stage_index: int
    num_stages: int
    is_first: bool
    is_last: bool
    hidden_size: int

    def __call__(self, hidden: torch.Tensor | None, batch: dict[str, torch.Tensor], seed: int | None = None) -> Any:
        """`seed`: this micro-batch's (training only); a stage with dropout seeds each part from it (seeding.py),
        a compiled stage the whole of it."""

    block_indices: list[int]  # the model's blocks it holds, by their index in the model

    def parameters(self) -> Any: ...
    def tied_parameters(self) -> dict[str, torch.nn.Parameter]: ...
    def hf_parameter_names(self) -> dict[str, str]: ...


NO_TARGETS = "no target tokens in the step (every label -100): skipped, as its loss is 0/0"


@dataclass(kw_only=True)
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
    staging: float | None = None  # of the schedule's time, the fraction its sends and receives spent copying GPU
    # tensors to and from gloo (a copy to the GPU counted as launched; the replicas' sync is outside the schedule)
    target_tokens: int | None = None  # a causal LM's: the tokens its loss fell on, over every replica
    token_metrics: dict[str, float] = field(default_factory=dict)  # a causal LM's, TRL's: TOKEN_METRICS, by name
    input_tokens: int | None = None  # a causal LM's: its micro-batches' input tokens, over every replica (the
    # trainer sums them into TRL's num_tokens)
    stop: bool = False  # some rank was asked to stop after this step (EngineSettings.stop_asked): every rank alike

    def record(self) -> dict[str, Any]:
        """A JSON object for metrics.jsonl: a skipped step says why instead of a NaN loss and gradient norm; what a
        step does not have (no staging, no causal-LM tokens) is left out."""
        drop = {"input_tokens", "stop", *(("skipped",) if self.skipped is None else ("loss", "grad_norm"))}
        record = {}
        for k, v in vars(self).items():
            if k == "token_metrics":
                record.update(v)
            elif k not in drop and not (v is None and k in ("staging", "target_tokens")):
                record[k] = v
        return record


def token_metrics(t: StepTotals, training: bool) -> dict[str, float]:
    """The declared token metrics (TOKEN_METRICS) a step's or an evaluation batch's totals have."""
    return {m.name: v for m in TOKEN_METRICS if (m.train or not training) and (v := m.value(t)) is not None}


def followed_parameters(stage: Stage, ties: dict[str, Tie] | None) -> list[torch.nn.Parameter]:
    """This stage's copies of tied weights that another stage owns (they take the owner's rows each step)."""
    return [p for key, p in stage.tied_parameters().items()
            if key in (ties or {}) and ties[key].owner != stage.stage_index]


def owned_parameters(stage: Stage, ties: dict[str, Tie] | None) -> list[torch.nn.Parameter]:
    """The parameters this stage's optimizer and data-parallel algorithm update: those that train (LoRA freezes the
    base), less the tied copies it follows.

    A tied weight is stepped by its owner alone (ties.py); the followers' copies take the owner's rows
    each step, so an algorithm keeping state about its parameters (replicas, drift, error memory)
    never sees them change behind its back.
    """
    followers = {id(p) for p in followed_parameters(stage, ties)}
    return [p for p in stage.parameters() if p.requires_grad and id(p) not in followers]


class PipelineEngine:
    """One stage of a pipeline (and of one replica), trained a step at a time.

    `optimizer` steps `owned_parameters(stage, ties)` (a data-parallel algorithm's wrapped one where it has its own,
    QAdam's); `lr_scheduler` steps it after each step; `data_parallel` keeps this stage's replicas in step.
    """

    def __init__(
        self, stage: Stage, groups: Groups, optimizer: torch.optim.Optimizer, settings: EngineSettings, *,
        compression: CompressionConfig | None = None, lr_scheduler: Any = None, ties: dict[str, Tie] | None = None,
        data_parallel: Any = None,
    ) -> None:
        """Its parts (the stage, its place in the process grid, the optimizer and its LR schedule, the boundaries'
        codecs, the tied weights, the replicas' algorithm) and what it does with them (`settings`)."""
        self.per_token = settings.loss_average == "tokens"
        self.stage, self.groups, self.optimizer, self.lr_scheduler = stage, groups, optimizer, lr_scheduler
        self.data_parallel = data_parallel  # a data_parallel.Algorithm over this stage's replicas, or None
        self.gradient_clipping, self.schedule = settings.gradient_clipping, settings.schedule
        self.skip_nonfinite = settings.skip_nonfinite
        self.compression = compression or CompressionConfig()
        self.device, self.seed = settings.device, settings.seed
        self.num_samples = settings.num_samples  # rows of each AQ-SGD buffer: a training micro-batch's ids index them
        self.buffer_keep = settings.buffer_keep  # the samples whose rows the buffers keep (None: every one)
        # bf16 weights beside float32 ones (a frozen bf16 base under float32 LoRA adapters, or float32 under bf16
        # ones) multiply only under autocast
        dtypes = {p.dtype for p in stage.parameters() if p.is_floating_point()}
        self.bf16 = settings.bf16 or (torch.bfloat16 in dtypes and len(dtypes) > 1)
        # activations cross in bf16 under bf16 autocast or with bf16 weights (which compute in bf16), else float32
        self.wire_dtype = torch.bfloat16 if self.bf16 or dtypes == {torch.bfloat16} else torch.float32
        self.ties = {k: v for k, v in sorted((ties or {}).items()) if groups.stage in v.holders}
        self.wire = Wire(latency_s=settings.link_latency_s, transport=groups.transport,
                         entropy=self.compression.entropy_coding, mbit=settings.link_mbit, device=self.device,
                         matrix=settings.link_matrix)
        self.compute_slowdown, self.stop_asked = settings.compute_slowdown, settings.stop_asked
        c = self.compression
        self.factory = CodecFactory(c, self.seed, groups.replica)  # every codec of this rank, and its seeds
        # a frozen tied weight (LoRA's base) never changes: its copies need no rows and send no gradients
        trained = {k: p for k, p in stage.tied_parameters().items() if p.requires_grad}
        self.tied = TiedWeights(trained, {k: v for k, v in self.ties.items() if k in trained}, groups.stage,
                                self.wire, groups.pipeline_rank_of,
                                channel=lambda src, dst: groups.channel(TIE, src, dst), codecs=self.factory.tie)
        self.global_step = self.skipped_steps = 0
        self.auto_bits = AutoBitsController(c, groups.grid, stage.hidden_size, self.schedule, self.wire_dtype) \
            if c.auto() else None
        self.prev = self._boundary(groups.stage - 1, settings.seq_len) if not stage.is_first else None
        self.next = self._boundary(groups.stage, settings.seq_len) if not stage.is_last else None

    def _boundary(self, index: int, seq_len: int) -> Boundary:
        """The codecs of boundary `index` (between stages index and index+1), on this side of it."""
        c, here = self.compression, self.groups.stage
        side = "send" if here == index else "recv"
        peer = self.groups.pipeline_rank_of(index + 1 if side == "send" else index)
        path = None
        if c.buffer_dir:  # a codec with per-sample rows keeps them there (the others take no file)
            path = os.path.join(c.buffer_dir, f"boundary{index}_{side}_replica{self.groups.replica}.buf")
        bits = {d: self.auto_bits.bits(index, d) if c.auto(d) else getattr(c, f"{d}_bits") for d in DIRECTIONS}
        forward, backward = self.factory.boundary(index, (seq_len, self.stage.hidden_size), bits, self.num_samples,
                                                  self.buffer_keep, path)
        ahead, back = (index, index + 1), (index + 1, index)  # activations flow ahead, gradients back
        out_link, in_link = (ahead, back) if side == "send" else (back, ahead)
        return Boundary(self.wire, peer, forward, backward, *self.factory.fallbacks(), sends_activations=side == "send",
                        outgoing=self.groups.channel(BOUNDARY, *out_link),
                        incoming=self.groups.channel(BOUNDARY, *in_link))

    def autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 autocast with --bf16 or bf16 weights beside float32 ones, else nothing."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _runtime(self) -> StageRuntime:
        """What this step's actions may touch (step_run.py)."""
        buffered = any(b.forward.buffer is not None for b in (self.prev, self.next) if b is not None)
        return StageRuntime(stage=self.stage, prev=self.prev, next=self.next, tied=self.tied, wire=self.wire,
                            wire_dtype=self.wire_dtype, device=self.device, autocast=self.autocast, seed=self.seed,
                            replica=self.groups.replica, step=self.global_step, num_samples=self.num_samples,
                            buffered=buffered, timed=self.device.type == "cuda" and self.auto_bits is not None,
                            per_token=self.per_token, slowdown=self.compute_slowdown)

    def codecs(self) -> dict[str, Any]:
        """This rank's stateful codecs by name (the full-precision fallbacks keep no state)."""
        out = {}
        for name, boundary in (("prev", self.prev), ("next", self.next)):
            if boundary is not None:
                out[f"{name}.forward"], out[f"{name}.backward"] = boundary.forward, boundary.backward
        return {**out, **self.tied.codecs()}

    # ------------------------------------------------------------------ one step
    def train_batch(self, micro_batches: list[dict[str, torch.Tensor]], epoch: int = 0) -> StepMetrics:
        """One optimizer step over the micro-batches; its metrics, the same on every stage. Give the loader's host
        tensors: the step reads what it decides there and stages them to the device itself (micro_batch.py); batches
        already on a GPU work too, at a host sync for each value it then reads back."""
        if not micro_batches:
            raise ValueError("train_batch needs at least one micro-batch")
        start, m = time.perf_counter(), len(micro_batches)
        phase = "warmup" if epoch < self.compression.warmup_epochs else "train"
        bits = self.auto_bits.record() if self.auto_bits is not None else None
        deciding = self.auto_bits is not None and self.auto_bits.deciding(self.global_step)
        link = self.auto_bits.probe(self.groups.stage, self.prev, self.next) \
            if deciding and self.compression.link_mbit is None else (0.0, 0.0, 0.0)
        self.stage.train()
        guard = StepGuard(self.codecs())
        actions = sched.train_schedule(self.schedule, self.groups.stage, self.groups.grid.stages, m)
        try:
            run = StepRun(self._runtime(), micro_batches, phase, True, guard).run(actions)
        except BaseException:  # stopped short (a peer lost, a data-order error, an interrupt): no trace of it stays
            guard.undo()
            raise
        mine = run.totals(link)
        mine.stop = int(self.stop_asked is not None and bool(self.stop_asked()))  # read as late as a step can
        table = StepTable.exchange(self.groups, Row(guard.findings, self._grad_squares(guard, run.part.finite_flags),
                                                    mine))
        totals, verdict = table.totals(), table.verdict(self.global_step + 1, self.compression.buffer_dtype)
        decision = self._decide_bits(table, verdict is None, micro_batches) if self.auto_bits is not None else None
        empty = verdict is None and self.per_token and not totals.target_tokens and causal_lm_labels(micro_batches)
        if verdict is not None or empty:  # rejected, or nothing to learn from: undone, the weights and LR untouched
            guard.undo()
            self._zero_grads()
            self.global_step += 1
            if verdict is not None and verdict.error is not None:
                raise verdict.error
            if verdict is not None and not self.skip_nonfinite:
                raise FloatingPointError(f"{verdict.line}; stopping (skip_nonfinite skips such steps instead)")
            self.skipped_steps += 1
            line = verdict.line if verdict is not None else NO_TARGETS
            return self._metrics(totals, m, epoch, self.optimizer.param_groups[0]["lr"], float("nan"), phase, start,
                                 bits, decision, skipped=line)
        lr, grad_norm = self._step(table, totals)
        return self._metrics(totals, m, epoch, lr, grad_norm, phase, start, bits, decision)

    def _step(self, table: StepTable, totals: StepTotals) -> tuple[float, float]:
        """An accepted step's update: the replicas' algorithm, clipping, the optimizer and the LR schedule; returns
        the learning rate it stepped with and the gradient norm before clipping (`totals` gets the dp bytes)."""
        norm = None  # the algorithm may change the gradients: their norm is taken again after it
        share = self._share(table, totals)
        if share != 1.0:  # this replica held another share of the step's targets (or micro-batches) than 1 / replicas
            grads = [p.grad for p in owned_parameters(self.stage, self.ties) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, share)
        if self.data_parallel is not None:
            self.data_parallel.after_backward()
        else:
            norm = table.pipeline_norm(self.groups.replica) * share
        grad_norm = self._clip(norm)
        self.optimizer.step()
        if self.data_parallel is not None:
            self.data_parallel.after_step()
            sent = float(self.data_parallel.comm.take_bytes())
            totals.dp_bytes = int(sum_over_job(self.groups, [sent])[0])  # known only after the optimizer step
        self._zero_grads()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_step += 1
        return lr, grad_norm

    def _share(self, table: StepTable, totals: StepTotals) -> float:
        """What this replica's gradients are multiplied by so that the replicas' equal average is the step's mean: each
        replica's last stage divided by its own count (of target tokens per token, else of micro-batches), so this is
        replicas x its count / the job's (exactly 1 where replicas hold equal counts: LM blocks, equal shares of
        micro-batches, one replica)."""
        column = "target_tokens" if self.per_token and totals.target_tokens else "micro_batches"
        whole = getattr(totals, column)
        if not whole:
            return 1.0
        return self.groups.grid.replicas * table.replica_sum(column, self.groups.replica) / whole

    def _loss(self, t: StepTotals) -> float:
        """The step's loss: per token over the step (`tokens`, a causal LM) or the mean of micro-batch means."""
        if self.per_token and t.target_tokens:
            return t.token_loss_sum / t.target_tokens
        return t.mean_loss()

    def _decide_bits(self, table: StepTable, accepted: bool, micro_batches: list[dict]) -> dict[str, Any] | None:
        """Auto bits after the step: its compute observed (not a rejected step's: it may have stopped short), and on a
        decision step new bits for the next steps, the same on every rank."""
        if accepted:
            self.auto_bits.observe(table, len(micro_batches))
        if not self.auto_bits.deciding(self.global_step):
            return None
        rows, seq = micro_batches[0]["input_ids"].shape[:2]
        here = {b: boundary for b, boundary in ((self.groups.stage - 1, self.prev), (self.groups.stage, self.next))
                if boundary is not None}
        return self.auto_bits.decide(table, self.global_step + 1, rows, seq,
                                     self.auto_bits.most_micro_batches(table, len(micro_batches)), here)

    def _metrics(self, t: StepTotals, m: int, epoch: int, lr: float, grad_norm: float, phase: str, start: float,
                 bits: dict[str, int] | None, decision: dict[str, Any] | None,
                 skipped: str | None = None) -> StepMetrics:
        loss = float("nan") if skipped is not None else self._loss(t)
        return StepMetrics(step=self.global_step, epoch=epoch, loss=loss, lr=lr, grad_norm=grad_norm,
                           fwd_bytes=t.fwd_bytes, bwd_bytes=t.bwd_bytes, tie_bytes=t.tie_bytes, dp_bytes=t.dp_bytes,
                           phase=phase, seconds=time.perf_counter() - start, skipped=skipped, bubble=t.bubble(),
                           fwd_change=t.change(), bits=bits, bits_decision=decision, staging=t.staging(),
                           target_tokens=t.target_tokens or None, token_metrics=token_metrics(t, training=True),
                           input_tokens=t.input_tokens or None, stop=t.stop > 0)

    def _zero_grads(self) -> None:
        """Every gradient of the stage, not only the optimizer's: a tied copy that follows its owner is outside
        the optimizer, and a gradient left on it (a rejected step) would be sent with the next step's."""
        self.optimizer.zero_grad(set_to_none=True)
        self.stage.zero_grad(set_to_none=True)

    def _grad_squares(self, guard: StepGuard, finite_flags: list[torch.Tensor]) -> float:
        """This stage's share of the squared global gradient norm (a tied weight counts once, at its owner); notes
        PARAM_GRAD when a gradient it holds is not finite (a followed tied copy's: found in the rows it sent,
        without a scan of the whole copy, which for GPT2's embedding is vocabulary x width)."""
        squares = self._owned_squares()  # inf or NaN where a gradient is not finite
        flags = [f.to(torch.float64) for f in finite_flags]  # what the tied weights sent was finite
        squares, *finite = torch.stack([squares, *flags]).tolist()  # one read for all of them
        if not guard.findings.bad and (not all(finite) or not math.isfinite(squares)):
            guard.findings.bad |= PARAM_GRAD
        return squares

    def _owned_squares(self) -> torch.Tensor:
        """The sum of squares of the gradients this stage steps, accumulated in float64 (the norms in one fused
        foreach reduction), on the stage's device."""
        grads = [p.grad.detach() for p in owned_parameters(self.stage, self.ties) if p.grad is not None]
        if not grads:  # a tied weight counts once, at its owner
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()

    def _clip(self, norm: float | None) -> float:
        """Clips to the global gradient norm if configured; `norm` None: taken here over the pipeline (each tied
        weight counted once), as after a data-parallel algorithm that changed the gradients."""
        if norm is None:  # every stage's share, summed exactly rounded: the same bits wherever the stages sit
            shares = self.groups.gather(self._owned_squares().cpu().reshape(1), "pipeline")[:, 0].tolist()
            norm = math.sqrt(math.fsum(shares))
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm} at step {self.global_step + 1} after the data-parallel "
                                     f"step (stage {self.groups.stage}, replica {self.groups.replica})")
        if self.gradient_clipping and norm > self.gradient_clipping:
            scale = self.gradient_clipping / (norm + 1e-6)  # a followed copy's gradient is not stepped
            grads = [p.grad for p in owned_parameters(self.stage, self.ties) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
        return norm

    @torch.no_grad()
    def eval_batch(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Forward only at full precision (AQ-SGD buffers untouched); loss and, for classification, accuracy; for a
        causal LM, TRL's token metrics (mean_token_accuracy, entropy: the mean over the tokens the loss falls on,
        target_tokens of them)."""
        self.stage.eval()
        actions = sched.forward_only(self.groups.stage, self.groups.grid.stages, len(micro_batches))
        run = StepRun(self._runtime(), micro_batches, "eval", False, None).run(actions)
        t = StepTable.exchange(self.groups, Row(run.guard.findings, 0.0, run.totals())).totals()
        loss = self._loss(t)
        result = {"loss": loss if not t.nonfinite else float("nan")}  # some stage saw NaN/inf (zeros were sent)
        if t.counted:
            result["accuracy"] = t.correct / t.counted
        if t.target_tokens:
            result.update(token_metrics(t, training=False), target_tokens=t.target_tokens)
        elif self.per_token and causal_lm_labels(micro_batches):  # no targets: no loss to report (0/0), no weight
            result.update(loss=float("nan"), target_tokens=0)
        return result

    # ------------------------------------------------------------------ checkpoints
    def file_buffers(self) -> dict[str, Any]:
        """This rank's AQ-SGD buffers kept in files (buffer_dir), by codec name: `state_dict()` leaves their rows
        in the files, which a checkpoint copies (`SampleBuffer.write_rows`; the loaded state names the copy)."""
        buffers = {name: codec.buffer for name, codec in self.codecs().items()}
        return {name: b for name, b in buffers.items() if b is not None and b.path is not None}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's weights under their HF names, less the tied copies it follows (their owner's is the
        truth; a follower's rows are current only where it reads them): what an export writes."""
        followed = {id(p) for p in followed_parameters(self.stage, self.ties)}
        skip = {name for name, p in self.stage.named_parameters() if id(p) in followed}
        return {k: v for k, v in self.stage.hf_state_dict().items() if k not in skip}

    def _place(self) -> dict[str, int]:
        grid = self.groups.grid
        return {"stage": self.groups.stage, "replica": self.groups.replica, "stages": grid.stages,
                "replicas": grid.replicas}

    def _frozen(self) -> set[str]:
        """The names of the stage's weights that never train (LoRA's base): the model's, not the run's state."""
        return {name for name, p in self.stage.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine needs to continue exactly: weights that train, optimizer, LR scheduler, step,
        codecs (dither generators, AQ-SGD buffers and seen bits), data-parallel algorithm, auto bits. The rows of
        buffers kept in files stay in the files (`file_buffers()`: a checkpoint copies them); frozen weights stay in
        the model they were read from."""
        frozen = self._frozen()
        return {
            "place": self._place(), "global_step": self.global_step, "skipped_steps": self.skipped_steps,
            "model": {k: v for k, v in self.stage.state_dict().items()  # a 4-bit weight's statistics are frozen too
                      if k not in frozen and not any(k.startswith(f"{f}.") for f in frozen)},
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "codecs": {name: codec.state_dict() for name, codec in self.codecs().items()},
            "data_parallel": None if self.data_parallel is None else self.data_parallel.state_dict(),
            "auto_bits": None if self.auto_bits is None else self.auto_bits.state_dict(),
            # what a resume on another shape needs to reshard this state (aqpipe/reshape.py)
            "blocks": list(self.stage.block_indices), "optimized": self._optimized_names(),
            "tied_names": {k: v for k, v in self.stage.hf_parameter_names().items() if k != v},
        }

    def _optimized_names(self) -> list[str]:
        """The names of the parameters the optimizer steps, in its order (its state is by position)."""
        owned = {id(p) for p in owned_parameters(self.stage, self.ties)}
        return [name for name, p in self.stage.named_parameters() if id(p) in owned]

    def load_state_dict(self, state: dict[str, Any], fresh: Collection[str] = ()) -> None:
        """The inverse of state_dict; ValueError saying what differs when the state is another place's. `fresh`: the
        parts that start as built instead (codecs by name, "data_parallel", "auto_bits"), absent from `state`: a
        resume on another shape (aqpipe/reshape.py), whose moved boundaries and replicas' memories cannot carry."""
        diff = [f"{k}={state['place'].get(k)!r} (this engine: {v!r})" for k, v in self._place().items()
                if state["place"].get(k) != v]
        if diff:
            raise ValueError("engine state from another place in the grid: " + ", ".join(diff))
        codecs = self.codecs()
        if set(state["codecs"]) != set(codecs) - set(fresh):
            raise ValueError(f"engine state has codecs {sorted(state['codecs'])}, this stage {sorted(codecs)}")
        if "data_parallel" not in fresh and (state["data_parallel"] is None) != (self.data_parallel is None):
            raise ValueError("engine state and this engine differ in whether a data-parallel algorithm runs")
        if "auto_bits" not in fresh and (state.get("auto_bits") is None) != (self.auto_bits is None):
            raise ValueError("engine state and this engine differ in whether bits are chosen per link (auto)")
        try:
            missing, unexpected = self.stage.load_state_dict(state["model"], strict=False)
        except RuntimeError as exc:
            raise ValueError(f"the saved stage {self.groups.stage} does not fit this model: {exc}") from None
        absent = sorted(set(missing) - self._frozen())  # a frozen weight is the model's: not in the state
        if unexpected or absent:
            raise ValueError(f"the saved stage {self.groups.stage} does not fit this model: weights "
                             f"{', '.join(unexpected[:3]) or '-'} saved but not here, {', '.join(absent[:3]) or '-'} "
                             "here but not saved")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for name, codec in codecs.items():
            if name not in fresh:
                codec.load_state_dict(state["codecs"][name])
        if self.data_parallel is not None and "data_parallel" not in fresh:
            self.data_parallel.load_state_dict(state["data_parallel"])
        if self.auto_bits is not None and "auto_bits" not in fresh:
            self.auto_bits.load_state_dict(state["auto_bits"])  # the codecs restored their current bits themselves
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.data_parallel is not None and "data_parallel" in fresh:  # from the weights just loaded
            self.data_parallel.restart(self.global_step - self.skipped_steps)
