"""The process grid: world = stages x replicas, who holds each (stage, replica), and the groups each rank talks in.

Without a placement, rank r sits at stage r % stages of replica r // stages, so one pipeline's stages are
consecutive ranks (one launcher node per stage, or all on one machine) and a stage's replicas are `stages` apart.
A placement (a planner's: aqpipe/plan) puts any rank at any (stage, replica); everything that talks or keeps state
asks this object, never the arithmetic, so a placement changes who computes what, not what is computed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as dist

from aqpipe.compression.staging import HostStaging
from aqpipe.compression.fields import check_int

BOUNDARY, TIE = "boundary", "tie"  # the kinds of channel between two stages of a pipeline


@dataclass(frozen=True)
class Grid:
    """`stages` x `replicas`, and `ranks`: the rank that holds each (stage, replica), at index replica x stages +
    stage (None: rank order, that index itself)."""

    stages: int
    replicas: int
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("stages", "replicas"):
            value = getattr(self, name)
            check_int(name, value, 1, what="a positive integer")
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if not all(type(r) is int for r in ranks) or sorted(ranks) != list(range(self.world_size)):
                raise ValueError(f"placement {list(ranks)}: expected each rank of 0..{self.world_size - 1} once, "
                                 f"one per (stage, replica) of {self.stages} x {self.replicas}")
            object.__setattr__(self, "ranks", None if ranks == tuple(range(self.world_size)) else ranks)

    @classmethod
    def for_world(cls, world_size: int, stages: int, ranks: list[int] | tuple[int, ...] | None = None) -> "Grid":
        """The grid for `world_size` processes in pipelines of `stages` stages, placed by `ranks` (None: rank
        order)."""
        check_int("pipeline_stages", stages, 1, what="a positive integer")
        if world_size % stages:
            raise ValueError(
                f"pipeline_stages={stages} does not divide the world size {world_size}: "
                f"expected world_size = pipeline_stages x replicas"
            )
        return cls(stages, world_size // stages, None if ranks is None else tuple(ranks))

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    @property
    def placement(self) -> list[int]:
        """The rank of each (stage, replica), at index replica x stages + stage."""
        return list(self.ranks) if self.ranks is not None else list(range(self.world_size))

    @cached_property
    def _slots(self) -> dict[int, int]:
        return {rank: slot for slot, rank in enumerate(self.placement)}

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        slot = self._slots[rank]
        return slot % self.stages, slot // self.stages

    def rank(self, stage: int, replica: int) -> int:
        slot = replica * self.stages + stage
        return self.ranks[slot] if self.ranks is not None else slot

    def describe(self, rank: int) -> str:
        """Where a rank sits, as failure lines name it."""
        stage, replica = self.coords(rank)
        return f"stage {stage}, replica {replica}"

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [self.rank(s, replica) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, r) for r in range(self.replicas)]


@dataclass
class Groups:
    """This rank's place and process groups (None where torch.distributed is not initialized)."""

    grid: Grid
    rank: int
    stage: int
    replica: int
    pipeline: object | None  # this replica's stages
    data_parallel: object | None  # this stage's replicas
    # (kind, from stage, to stage) -> a group of the two ranks that carries only that kind, that way
    channels: dict[tuple[str, int, int], object] = field(default_factory=dict)
    # where the groups' tensors must live: cpu for gloo (a GPU stage's tensors are staged through host memory),
    # the rank's GPU for NCCL
    transport: torch.device = field(default_factory=lambda: torch.device("cpu"))

    pace: Callable[[float, list[int], float, str], None] | None = None  # emulated links' (LinkMatrix.pace)

    def gather(self, row: torch.Tensor, over: str) -> torch.Tensor:
        """Every rank's `row` (1-D) of the job (`over` "job") or of this rank's pipeline ("pipeline"), stacked in
        global rank order (a pipeline's: its stages' ranks, sorted). One round of direct messages, each rank's row to
        every other at once: a row is a few hundred bytes, so over slow links its cost is one link's latency, where a
        ring allreduce waits 2 (k-1) (paced as emulated links would carry it)."""
        if over not in ("job", "pipeline"):
            raise ValueError(f"gather over={over!r}: expected 'job' or 'pipeline'")
        job = over == "job"
        members = list(range(self.grid.world_size)) if job else sorted(self.grid.pipeline_ranks(self.replica))
        if len(members) == 1 or not dist.is_initialized():
            return row.reshape(1, -1).clone()
        group = None if job else self.pipeline  # the job's: the default group
        started = time.monotonic()
        out = HostStaging(self.transport).all_to_all_rows(row, len(members), group)
        if self.pace is not None:
            self.pace(started, members, row.numel() * row.element_size(), "peers")
        return out

    def pipeline_rank_of(self, stage: int) -> int:
        return self.grid.rank(stage, self.replica)

    def channel(self, kind: str, src: int, dst: int) -> object | None:
        """The group that carries `kind` messages from stage `src` to stage `dst` of this replica (None: no
        process group, or not one of this rank's)."""
        return self.channels.get((kind, src, dst))


def channels(stages: int) -> list[tuple[str, int, int]]:
    """Every one-way channel of a pipeline: each boundary both ways, and between any two stages for tied weights.

    One group per direction and kind makes NCCL safe by construction: NCCL ignores tags and runs a pair's
    sends and receives on one stream in the order they were issued, so a stage that posts its receives
    ahead (or sends activations while its peer sends gradients) would wait behind its own posted receive.
    On a channel that carries one kind one way, one side only sends and the other only receives, both in
    schedule order: the i-th send meets the i-th receive whatever else either side does meanwhile."""
    out = [(BOUNDARY, s, s + d) for s in range(stages) for d in (1, -1) if 0 <= s + d < stages]
    return out + [(TIE, a, b) for a in range(stages) for b in range(stages) if a != b]


def build_groups(grid: Grid, rank: int, transport: torch.device | str = "cpu") -> Groups:
    """Create every group on every rank (torch requires all ranks to call new_group alike); `transport`: the device
    the backend moves tensors from (cpu for gloo, the rank's GPU for NCCL)."""
    stage, replica = grid.coords(rank)
    pipeline = data_parallel = None
    links: dict[tuple[str, int, int], object] = {}
    if dist.is_available() and dist.is_initialized():
        for r in range(grid.replicas):
            g = dist.new_group(grid.pipeline_ranks(r))
            pipeline = g if r == replica else pipeline
        for s in range(grid.stages):
            g = dist.new_group(grid.data_parallel_ranks(s))
            data_parallel = g if s == stage else data_parallel
        for r in range(grid.replicas):
            for kind, a, b in channels(grid.stages):
                g = dist.new_group([grid.rank(a, r), grid.rank(b, r)])
                if r == replica and stage in (a, b):
                    links[kind, a, b] = g
    return Groups(grid, rank, stage, replica, pipeline, data_parallel, links, torch.device(transport))
