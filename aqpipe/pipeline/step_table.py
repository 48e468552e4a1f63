"""The step's one collective: every rank's row, gathered over the job so that every rank holds every row.

A row says what the rank found non-finite and where (`Findings`), an activation its AQ-SGD buffer could not hold,
its gradients' squared norm, and its totals (loss, counts, bytes, times, a link probe). From the table every rank
reads the same totals, the same gradient norm of its replica's pipeline, and the same verdict, with no second
message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable

import torch

from aqpipe.compression import BufferRangeError

if TYPE_CHECKING:
    from .topology import Groups

# what a stage found non-finite in a step (a bit mask, agreed on by every rank)
LOSS, ACTIVATION, GRADIENT, PARAM_GRAD, BUFFER_RANGE = 1, 2, 4, 8, 16
KINDS = {LOSS: "loss", ACTIVATION: "activation to send", GRADIENT: "boundary gradient to send",
         PARAM_GRAD: "parameter gradients"}  # BUFFER_RANGE has a line of its own (Verdict)


@dataclass(kw_only=True)
class StepCounters:
    """Bytes this rank sent in one step, by wire."""

    fwd_bytes: int = 0
    bwd_bytes: int = 0
    tie_bytes: int = 0
    dp_bytes: int = 0


@dataclass(kw_only=True)
class StepTotals(StepCounters):
    """One step summed over the whole job, the same on every rank: the last stages' loss and eval counts, each
    rank's bytes, how many ranks saw a non-finite value, and the seconds the ranks spent in the schedule and, of
    them, computing (forwards and backwards)."""

    loss_sum: float = 0.0
    micro_batches: int = 0  # the losses loss_sum adds: each replica's last stage, one a micro-batch
    token_loss_sum: float = 0.0  # the sum of each causal-LM micro-batch's loss times its target tokens
    target_tokens: int = 0  # the tokens the causal-LM loss fell on (labels other than -100 after the first position)
    token_correct: int = 0  # of them, those the argmax predicts (TRL's mean_token_accuracy = this / accuracy_tokens)
    accuracy_tokens: int = 0  # of them, those whose predictions were counted (none under a fused loss in training)
    entropy_sum: float = 0.0  # in evaluation, the predicted distributions' entropies summed over the same tokens
    input_tokens: int = 0  # the causal-LM micro-batches' input tokens (their attention masks'; TRL's num_tokens)
    correct: int = 0
    counted: int = 0
    nonfinite: int = 0
    schedule_seconds: float = 0.0
    compute_seconds: float = 0.0
    staging_seconds: float = 0.0  # of the schedule's, copying tensors between a GPU and the host (gloo on GPUs)
    change_squares: float = 0.0  # AQ-SGD senders' sum of ||a - m||^2 over the changes they sent
    activation_squares: float = 0.0  # and of ||a||^2 over the same rows
    # this rank's probe of the link to its next stage (auto bits): read per row from the table, never summed
    link_ahead: float = 0.0  # seconds a byte, activations' way
    link_back: float = 0.0  # seconds a byte, gradients' way
    link_latency: float = 0.0  # seconds a message
    stop: int = 0  # ranks asked to stop after this step (a spot warning: every rank reads it in the same step)

    def change(self) -> float | None:
        """||a - m|| / ||a|| over every AQ-SGD change the step sent (None when it sent none)."""
        return (self.change_squares / self.activation_squares) ** 0.5 if self.activation_squares > 0 else None

    def bubble(self) -> float | None:
        """The fraction of the schedule's time the stages waited instead of computing (the pipeline bubble)."""
        return 1.0 - self.compute_seconds / self.schedule_seconds if self.schedule_seconds > 0 else None

    def staging(self) -> float | None:
        """Of the schedule's time over all ranks, the fraction spent staging tensors through host memory (None:
        nothing was staged)."""
        return self.staging_seconds / self.schedule_seconds if self.staging_seconds and self.schedule_seconds else None

    def token_accuracy(self) -> float | None:
        """TRL's mean_token_accuracy: of the tokens the loss fell on, the share the argmax predicts (None where no
        prediction was counted: a fused loss builds no logits, and TRL logs none with it either)."""
        return self.token_correct / self.accuracy_tokens if self.accuracy_tokens else None

    def mean_loss(self) -> float:
        """The mean micro-batch loss over the job: every replica's last stage adds one loss a micro-batch (replicas
        may take unequal shares of them)."""
        return self.loss_sum / self.micro_batches if self.micro_batches else math.nan


@dataclass(frozen=True)
class TokenMetric:
    """A mean over the tokens a causal LM's loss falls on, as TRL logs it, declared once: `value` reads it from a
    step's or an evaluation batch's totals over the job (None: none counted), a training row carries it if `train`
    (TRL's entropy is evaluation's alone), and an evaluation's row averages its batches' weighted by their target
    tokens as `eval_<name>`. A new one is its sums (StepTotals' fields, filled where they are computed) and a line
    in TOKEN_METRICS."""

    name: str
    value: Callable[[StepTotals], float | None]
    train: bool = True


TOKEN_METRICS = (
    TokenMetric("mean_token_accuracy", StepTotals.token_accuracy),
    TokenMetric("entropy", lambda t: t.entropy_sum / t.target_tokens if t.target_tokens else None, train=False),
)


TOTALS = tuple(f.name for f in fields(StepTotals))
_FLOATS = {f.name for f in fields(StepTotals) if f.type in (float, "float")}


@dataclass
class Findings:
    """What a rank found in a step that stops it: non-finite kinds (a bit mask), the first micro-batch where, and
    an activation its AQ-SGD buffer could not hold. A check made inside the schedule stays on the device as a
    pending flag (`check`) or value (`check_value`), read with the step's other device values once the schedule is
    done (`resolve`)."""

    bad: int = 0
    first_mb: int = -1
    overflow: BufferRangeError | None = None
    pending: list[tuple[int, int, torch.Tensor, bool]] = field(default_factory=list)  # (kind, mb, tensor, a value?)

    def note(self, kind: int, mb: int) -> None:
        self.bad |= kind
        self.first_mb = mb if self.first_mb < 0 else self.first_mb

    def check(self, kind: int, mb: int, finite: torch.Tensor) -> None:
        """Note `kind` at `mb` once the flag `finite` (a 0-dim bool on the device) is read, if it is false."""
        self.pending.append((kind, mb, finite, False))

    def check_value(self, kind: int, mb: int, value: torch.Tensor) -> None:
        """Note `kind` at `mb` once `value` (0-dim, on the device) is read, if it is not finite (a codec's check:
        one reduction where a flag would take two)."""
        self.pending.append((kind, mb, value, True))

    def resolve(self, read: list[float]) -> None:
        """The pending tensors as read, in the order they were checked. A boundary gradient backwarded from a
        non-finite loss of the same micro-batch is that loss's consequence, not a finding of its own."""
        finite = [math.isfinite(v) if value else bool(v) for (_, _, _, value), v in zip(self.pending, read)]
        lost = {mb for (kind, mb, _, _), ok in zip(self.pending, finite) if kind == LOSS and not ok}
        for (kind, mb, _, _), ok in zip(self.pending, finite):
            if not ok and not (kind == GRADIENT and mb in lost):
                self.note(kind, mb)
        self.pending = []


@dataclass
class Row:
    """One rank's row of the table, by column."""

    findings: Findings
    grad_squares: float  # its share of the squared global gradient norm (none sent when it found a non-finite)
    totals: StepTotals = field(default_factory=StepTotals)

    def values(self) -> list[float]:
        f, over = self.findings, self.findings.overflow
        return [f.bad, f.first_mb + 1, over.sample_id if over else 0, over.value if over else 0.0,
                self.grad_squares if f.bad == 0 else 0.0, *(float(getattr(self.totals, n)) for n in TOTALS)]


FINDINGS, SQUARES, FIRST_TOTAL = slice(0, 4), 4, 5  # the columns of a row


def sum_over_job(groups: "Groups", values: list[float]) -> list[float]:
    """`values` (counts: exact in any order) summed over every rank."""
    rows = groups.gather(torch.tensor(values, dtype=torch.float64), "job")
    return [float(sum(column)) for column in rows.T.tolist()]


@dataclass(frozen=True)
class Verdict:
    """Why a step is rejected on every rank: the line to say, and the error to raise whatever skip_nonfinite
    (an activation beyond the AQ-SGD buffer's dtype: skipping would not help), or None to skip or raise as set."""

    line: str
    error: Exception | None = None


class StepTable:
    """Every rank's row of one step, the same on every rank after `exchange`."""

    def __init__(self, rows: torch.Tensor, groups: "Groups") -> None:
        self.rows, self.groups = rows, groups

    @classmethod
    def exchange(cls, groups: "Groups", row: Row) -> "StepTable":
        """The step's one collective."""
        return cls(groups.gather(torch.tensor(row.values(), dtype=torch.float64), "job"), groups)

    def totals(self) -> StepTotals:
        """The step's totals over the whole job, summed in (replica, stage) order: the same bits whoever holds
        which place."""
        sums = self.rows[self.groups.grid.placement, FIRST_TOTAL:].sum(dim=0).tolist()
        return StepTotals(**{n: (float(v) if n in _FLOATS else int(v)) for n, v in zip(TOTALS, sums)})

    def column(self, name: str) -> torch.Tensor:
        """A totals column, one value per rank (a probe of a rank's link, its compute)."""
        return self.rows[:, FIRST_TOTAL + TOTALS.index(name)]

    def replica_sum(self, name: str, replica: int) -> float:
        """A totals column summed over `replica`'s ranks."""
        column = self.column(name).tolist()
        return float(sum(column[rank] for rank in self.groups.grid.pipeline_ranks(replica)))

    def pipeline_norm(self, replica: int) -> float:
        """The global gradient norm of `replica`'s pipeline."""
        return float(self.rows[self.groups.grid.pipeline_ranks(replica), SQUARES].sum().sqrt())

    def verdict(self, step: int, buffer_dtype: torch.dtype) -> Verdict | None:
        """What every rank found non-finite in step `step`, or an activation the AQ-SGD buffers could not hold;
        None when no rank did."""
        grid = self.groups.grid
        if not bool(self.rows[:, 0].any()):
            return None
        found, overflows = [], []
        for rank, (bad, mb, sample, value) in enumerate(self.rows[:, FINDINGS].tolist()):
            bad, mb, stage, replica = int(bad), int(mb), *grid.coords(rank)
            if bad & BUFFER_RANGE:
                dtype = str(buffer_dtype).removeprefix("torch.")
                overflows.append(f"boundary {stage} (stage {stage} to {stage + 1}, rank {rank}, replica {replica}): "
                                 f"sample {int(sample)}'s activation reaches {value:.4g} at step {step}, beyond "
                                 f"what the {dtype} AQ-SGD buffer can hold")
            elif bad:
                kinds = ", ".join(text for bit, text in KINDS.items() if bad & bit)
                where = f" (micro-batch {mb - 1})" if mb else ""
                found.append(f"stage {stage} (rank {rank}, replica {replica}): {kinds}{where}")
        if overflows:
            line = "; ".join(overflows) + ": use buffer_dtype bfloat16 or float32 (--buffer_dtype)"
            return Verdict(line, ValueError(line))
        return Verdict(f"non-finite values at step {step}: " + "; ".join(found))
