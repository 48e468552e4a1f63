"""The predicted step of a placement: who holds which (stage, replica), and the blocks of each stage.

    step = max over replicas (the schedule's makespan over its share of micro-batches + the tied weights' rows)
           + the step's job-wide tables (each a round of direct messages: its slowest pair)
           + max over stages (the replicas' sync)

The makespan plays the run's own schedule (pipeline.schedule.makespan) with each stage's compute (its blocks and
extras at its machine's speed; a backward twice a forward) and each boundary's messages on the link between the two
machines that hold its sides (their time on the link, then its latency). The replicas' sync is the algorithm's bytes
over the links of the stage's group, shaped as its collective runs (pipeline.emulated_link.collective_seconds: a
ring's 2 (R-1) hops of 1/R of them at its slowest link, an allgather, two all-to-all rounds, an exchange with
peers). A placement whose stage does not fit its machine's memory costs infinity.

Where the replicas' algorithm averages gradients (it can weigh them) and the settings leave the shares to the plan,
each placement's replicas take the shares of the step's micro-batches that even out their makespans (`shares`): a
replica on slower machines or links takes fewer, the global batch kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from aqpipe.pipeline.emulated_link import collective_seconds
from aqpipe.pipeline.schedule import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, makespan, train_schedule

from .cluster import Cluster
from .workload import Workload


@dataclass(frozen=True)
class Prediction:
    """A placement's predicted step and its parts, in seconds."""

    step: float
    pipeline: float  # the slowest replica's schedule (compute and boundaries) and tied rows
    compute: float  # of it, the slowest stage's compute alone
    boundaries: dict[int, float] = field(default_factory=dict)  # per boundary, its slowest replica's messages a step
    tables: float = 0.0  # the job-wide tables
    data_parallel: float = 0.0  # the slowest stage's replicas' sync
    fits: bool = True
    shares: tuple[int, ...] = ()  # each replica's micro-batches a step

    def parts(self) -> str:
        links = ", ".join(f"boundary {b} {t:.3g} s" for b, t in self.boundaries.items())
        return (f"compute {self.compute:.3g} s, {links or 'no boundary'}, tables {self.tables:.3g} s, "
                f"data-parallel {self.data_parallel:.3g} s")


def ring_seconds(cluster: Cluster, ranks: list[int], nbytes: float) -> float:
    """A ring allreduce of `nbytes` over `ranks` (in global-rank order, as gloo rings): 2 (k-1) hops of nbytes / k,
    each as long as the ring's slowest link takes."""
    return collective_seconds(cluster.seconds, ranks, nbytes, "ring")


def round_seconds(cluster: Cluster, ranks: list[int], nbytes: float) -> float:
    """One round of direct messages of `nbytes` among `ranks` (a step's table: each rank's row to every other at
    once), as long as its slowest pair takes, the job waiting for the last rank to hold every row."""
    return max((collective_seconds(cluster.seconds, ranks, nbytes, "peers", me) for me in ranks), default=0.0)


def stage_memory(work: Workload, stage: int, stages: int, blocks: int) -> float:
    """Bytes stage `stage` holds: its blocks' weights and state, the extras, and 1F1B's activations in flight."""
    in_flight = min(stages - stage, work.micro_batches) if work.schedule != "gpipe" else work.micro_batches
    return blocks * (work.block_memory + in_flight * work.activation_memory) + \
        (work.first_memory if stage == 0 else 0.0) + (work.last_memory if stage == stages - 1 else 0.0)


class CostModel:
    """Prices placements of one workload on one cluster; remembers each replica's pipeline it priced (the search
    asks about the same ones many times)."""

    def __init__(self, cluster: Cluster, work: Workload, stages: int, replicas: int) -> None:
        self.cluster, self.work, self.stages, self.replicas = cluster, work, stages, replicas
        self.fixed = work.fixed_shares(replicas)
        self._schedules: dict[int, list] = {}
        self.block_s = [cluster.block_seconds(r, work.block_flops) for r in range(len(cluster))]
        # a round of the step's tables over the whole job: every placement's is this one
        self.job_round = round_seconds(cluster, list(range(len(cluster))), work.table_bytes)
        self._pipes: dict[tuple, tuple[float, dict[int, float]]] = {}

    # ------------------------------------------------------------------ parts
    def stage_seconds(self, rank: int, stage: int, blocks: int) -> float:
        """Rank `rank`'s compute for one micro-batch's forward and backward of stage `stage` with `blocks`."""
        return (blocks + self.work.stage_extra(stage, self.stages)) * self.block_s[rank]

    def schedules(self, micro_batches: int) -> list:
        if micro_batches not in self._schedules:
            self._schedules[micro_batches] = [train_schedule(self.work.schedule, s, self.stages, micro_batches)
                                              for s in range(self.stages)]
        return self._schedules[micro_batches]

    def pipeline(self, ranks: tuple[int, ...], partition: tuple[int, ...],
                 micro_batches: int | None = None) -> tuple[float, dict[int, float]]:
        """One replica's makespan on `ranks` (stage order) over `micro_batches` (default the run's) with its tied
        rows, and each boundary's message time."""
        m = self.work.micro_batches if micro_batches is None else micro_batches
        key = (ranks, partition, m)
        if key not in self._pipes:
            w, c = self.work, self.cluster
            costs = []
            for s, rank in enumerate(ranks):
                f = self.stage_seconds(rank, s, partition[s]) / 3
                costs.append({FORWARD: f, BACKWARD: 2 * f, BACKWARD_INPUT: f, BACKWARD_WEIGHT: f})
            transfer, links = {}, {}
            for b in range(self.stages - 1):
                a, z = ranks[b], ranks[b + 1]
                transfer[(b, b + 1)] = (w.forward_bytes / c.rate[a][z], c.latency[a][z])
                transfer[(b + 1, b)] = (w.backward_bytes / c.rate[z][a], c.latency[z][a])
                links[b] = m * (c.seconds(a, z, w.forward_bytes) + c.seconds(z, a, w.backward_bytes))
            span = makespan(self.schedules(m), costs, transfer)
            if w.tie_bytes and self.stages > 1:
                span += c.seconds(ranks[0], ranks[-1], w.tie_bytes / 2) + c.seconds(ranks[-1], ranks[0],
                                                                                     w.tie_bytes / 2)
            self._pipes[key] = (span, links)
        return self._pipes[key]

    def fits(self, placement: list[int], partition: tuple[int, ...]) -> bool:
        for slot, rank in enumerate(placement):
            stage = slot % self.stages
            memory = self.cluster.machines[rank].memory_bytes
            if memory is not None and stage_memory(self.work, stage, self.stages, partition[stage]) > memory:
                return False
        return True

    # ------------------------------------------------------------------ the whole step
    def predict(self, placement: list[int], partition: tuple[int, ...]) -> Prediction:
        """`placement[replica x stages + stage]`: the rank holding it; `partition`: blocks per stage."""
        S, R, w, c = self.stages, self.replicas, self.work, self.cluster
        if not self.fits(placement, partition):
            return Prediction(math.inf, math.inf, math.inf, fits=False)
        pipes = [tuple(placement[r * S:(r + 1) * S]) for r in range(R)]
        shares = self.fixed or self.shares(pipes, partition)
        priced = [self.pipeline(p, partition, m) for p, m in zip(pipes, shares)]
        pipeline = max(span for span, _ in priced)
        boundaries = {b: max(links[b] for _, links in priced) for b in range(S - 1)}
        groups = [[placement[r * S + s] for r in range(R)] for s in range(S)]
        tables = self.job_round  # the step's table over the job
        if R > 1:  # with replicas, the norm again after their sync (over each pipeline) and its byte count (the job)
            tables += max(round_seconds(c, list(p), w.table_bytes) for p in pipes) + self.job_round
        data_parallel = 0.0
        if R > 1:  # each stage's replicas, as their algorithm's collective runs
            data_parallel = max(collective_seconds(c.seconds, groups[s], w.dp_bytes_per_parameter *
                                                   w.stage_trained(s, S, partition[s]), w.dp_kind)
                                for s in range(S))
        compute = max(shares[r] * self.stage_seconds(placement[r * S + s], s, partition[s])
                      for r in range(R) for s in range(S))
        return Prediction(pipeline + tables + data_parallel, pipeline, compute, boundaries, tables, data_parallel,
                          shares=tuple(shares))

    def shares(self, pipes: list[tuple[int, ...]], partition: tuple[int, ...]) -> list[int]:
        """Each replica's micro-batches a step, the global batch kept, that even out the replicas' makespans: from
        equal shares, one micro-batch at a time from the slowest replica to the one it lengthens least, while that
        shortens the step (equal where the replicas are alike: the first move already does not)."""
        each = [self.work.micro_batches] * len(pipes)

        def span(r: int, m: int) -> float:
            return self.pipeline(pipes[r], partition, m)[0]

        while len(pipes) > 1:
            slow = max(range(len(pipes)), key=lambda r: (span(r, each[r]), -r))
            if each[slow] == 1:
                break
            fast = min((r for r in range(len(pipes)) if r != slow), key=lambda r: (span(r, each[r] + 1), r))
            if max(span(slow, each[slow] - 1), span(fast, each[fast] + 1)) >= span(slow, each[slow]) * (1 - 1e-9):
                break
            each[slow], each[fast] = each[slow] - 1, each[fast] + 1
        return each

    def balance(self, placement: list[int], fastest: bool = False) -> tuple[int, ...]:
        """Blocks per stage for `placement`, contiguous, in proportion to speed: each stage's pace is its slowest
        replica's machine (`fastest`: its fastest's, for replicas whose shares of micro-batches even out the
        slower), and blocks go one at a time to the stage that stays fastest with one more (which minimizes the
        slowest stage's compute), within its machines' memory."""
        S, R, w = self.stages, self.replicas, self.work
        pace = [(min if fastest else max)(self.block_s[placement[r * S + s]] for r in range(R)) for s in range(S)]
        room = [min((self.cluster.machines[placement[r * S + s]].memory_bytes or math.inf) for r in range(R))
                for s in range(S)]
        counts = [1] * S
        for _ in range(w.blocks - S):
            best = None
            for s in range(S):
                if stage_memory(w, s, S, counts[s] + 1) > room[s]:
                    continue
                t = (counts[s] + 1 + w.stage_extra(s, S)) * pace[s]
                if best is None or t < best[0]:
                    best = (t, s)
            if best is None:  # no stage can take another block: the memory check in `predict` refuses it
                counts[max(range(S), key=lambda s: room[s])] += 1
                continue
            counts[best[1]] += 1
        return tuple(counts)
