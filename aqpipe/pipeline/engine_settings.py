"""What an engine does with its parts, apart from the parts themselves: the sizes of the data its AQ-SGD buffers
index (and which samples keep rows), the schedule, clipping, where and in what precision it computes, its seed, what
it does with a non-finite step, emulated links and devices, and how a causal LM's step averages its loss. Checked as it
is made."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from aqpipe.compression.fields import check_choices, check_int

from .schedule import SCHEDULES
from .step_run import LOSS_AVERAGES


@dataclass(frozen=True)
class EngineSettings:
    num_samples: int  # rows of each AQ-SGD buffer: a training micro-batch's sample ids index them
    seq_len: int  # tokens per sample: a boundary's activation is (rows, seq_len, hidden)
    schedule: str = field(default="1f1b", metadata={"choices": SCHEDULES})
    gradient_clipping: float = 0.0  # the global gradient norm's cap (0: off)
    device: torch.device | str = "cpu"
    bf16: bool = False  # bfloat16 autocast and a bf16 wire
    seed: int = 0  # of dropout masks and codecs' dither, per replica, step and micro-batch
    skip_nonfinite: bool = False  # skip a step that found NaN/inf on any rank, instead of raising
    link_latency_s: float = 0.0  # a one-way delay added to every receive (a distant link emulated; checked there)
    link_mbit: float | None = None  # an emulated link rate on every receive (None: the link as it is)
    link_matrix: Any = None  # or each pair of ranks' emulated link, collectives paced too (emulated_link.LinkMatrix)
    compute_slowdown: float = 1.0  # an emulated slower device: each compute action stretched by waiting, by this
    loss_average: str = field(default="tokens", metadata={"choices": LOSS_AVERAGES})  # a causal LM's step loss:
    # per target token, or the micro-batches' mean
    stop_asked: Any = None  # a callable: True where this rank is asked to stop after the step (every rank learns it
    # in the step's table, StepMetrics.stop); None: never
    buffer_keep: torch.Tensor | None = None  # which samples' AQ-SGD rows are kept (a bool each; None: all): the
    # others are sent whole at every visit (a run keeps rows only for the samples it reads back)

    def __post_init__(self) -> None:
        check_int("num_samples", self.num_samples, 1)
        check_int("seq_len", self.seq_len, 1)
        check_choices(self)
        object.__setattr__(self, "device", torch.device(self.device))
        if not (isinstance(self.compute_slowdown, (int, float)) and 1.0 <= self.compute_slowdown < float("inf")):
            raise ValueError(f"compute_slowdown={self.compute_slowdown!r}: expected a factor >= 1")
        keep = self.buffer_keep
        if keep is not None and (keep.dtype != torch.bool or tuple(keep.shape) != (self.num_samples,)):
            raise ValueError(f"buffer_keep: expected a bool per sample ({self.num_samples}), got {keep.dtype} "
                             f"{tuple(keep.shape)}")
