"""Where a run's AQ-SGD buffer rows go, planned once at start from the run's own data order.

A buffer row m[ξ] is read only when sample ξ comes back, so the plan counts each sample's visits over the run's
steps (data.visit_counts) and gives rows only to the samples visited twice or more: a one-epoch run, or one that
`--max_steps` ends within the first epoch, keeps none, and its memory is flat in the dataset's size. Each rank's rows
(samples x row bytes x the boundary sides it holds) then go to memory where they fit its memory budget, else to a
memory-mapped file under `--buffer_dir` (default `<output_dir>/buffers`) where they fit its disk budget (which leaves
room for the checkpoints' copies of them), else as many samples keep rows as the larger budget holds (those visited
most), and the others are sent whole at every visit, as first visits are. Both sides of a boundary must keep the
same samples, so the ranks agree on the count: the fewest any rank holds, or, resuming, the count the checkpoint's
run kept where every rank still holds it (a resume is then exact). Rank 0 says the outcome in one line at start.

Why a fixed set of samples and not eviction: each epoch visits every sample once, in a new shuffle, so between two
visits of a sample nearly every other sample comes by. Least-recently-used rows then hit about 3.5% of revisits
with room for a quarter of the rows, and a fixed quarter hits 25%, which is also what Belady's optimal rule (evict
the row needed furthest ahead, knowing the order) reaches here (benchmarks/RESULTS.md, "AQ-SGD at a user's
dataset size"). A fixed set also needs no eviction state, so both sides agree by construction and a step is undone
as before.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aqpipe.compression.row_store import human_bytes as size

from .config import RunConfig
from .environment import launch
from .storage import broadcast, gather
from .world import World

BUDGET_SHARE = 0.5  # of the memory available at start, or of the free disk, that a machine's buffers may take
DEFAULT_DIR = "buffers"  # under the output directory


def available_memory() -> int:
    """The memory this machine can give without swapping, in bytes (Linux's MemAvailable; else its total)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_disk(directory: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `directory`."""
    for path in (directory, *directory.absolute().parents):
        if path.exists():
            return shutil.disk_usage(path).free
    return 0


@dataclass(frozen=True)
class RankBudget:
    """What one rank can hold: its boundary sides, and its memory and disk budgets in bytes; and a digest of the
    visits it counted, which every rank must share (each computes the kept samples from them)."""

    sides: int
    memory: int
    disk: int
    explicit_dir: bool  # --buffer_dir given: the rows go to disk, as the user asked
    visits: str = ""
    replica: int = 0  # the rank's replica: both sides of a boundary are in one, so each replica agrees on its own
    wanted: int = 0  # the samples its replica's shard visits twice or more (replicas of unequal shares differ)

    def rows(self, row: int, wanted: int) -> int:
        """How many samples' rows (on each side) this rank can hold, at most `wanted`."""
        if not self.sides:
            return wanted
        per_sample = self.sides * row
        room = self.disk if self.explicit_dir else max(self.memory, self.disk)
        if not self.explicit_dir and wanted * per_sample <= self.memory:
            return wanted
        return min(wanted, room // per_sample)

    def on_disk(self, row: int, rows: int) -> bool:
        """Where `rows` samples' rows go on this rank: disk when asked, or when memory cannot hold them."""
        return self.explicit_dir or self.sides * row * rows > self.memory


@dataclass(frozen=True)
class BufferPlan:
    """The samples that hold rows (a bool per shard position), and where this rank's rows live (None: memory)."""

    keep: torch.Tensor
    directory: str | None
    line: str | None = None  # what rank 0 says at start
    note: dict[str, Any] | None = None  # what a checkpoint keeps of it: the count agreed, for the visits counted


def rank_budget(cfg: RunConfig, sides: int, local_ranks: int, counts: np.ndarray, replica: int = 0,
                everyone: np.ndarray | None = None) -> RankBudget:
    """This rank's budgets: the settings', or BUDGET_SHARE of what the machine has, shared by its ranks (and on disk
    with the copies its checkpoints keep: the newest --save_total_limit, 2 where all are kept, and one being
    written)."""
    c, saving = cfg.compression, cfg.checkpointing
    copies = (saving.save_total_limit or 2) + 1 if saving.save_every else 0
    memory = c.buffer_memory_gb * 1e9 if c.buffer_memory_gb is not None else \
        BUDGET_SHARE * available_memory() / local_ranks
    disk = c.buffer_disk_gb * 1e9 if c.buffer_disk_gb is not None else \
        BUDGET_SHARE * free_disk(buffer_directory(cfg)) / local_ranks / (1 + copies)
    seen = counts if everyone is None else everyone  # every replica's visits, where their shards differ
    return RankBudget(sides, int(memory), int(disk), c.buffer_dir is not None,
                      hashlib.sha256(seen.astype(np.int64).tobytes()).hexdigest(), replica, int((counts >= 2).sum()))


def buffer_directory(cfg: RunConfig) -> Path:
    """Where rows go when they go to disk."""
    return Path(cfg.compression.buffer_dir or Path(cfg.checkpointing.output_dir) / DEFAULT_DIR)


def kept_samples(counts: np.ndarray, rows: int) -> torch.Tensor:
    """The `rows` samples visited most (of those visited twice or more; the lowest positions first among equals)."""
    keep = torch.zeros(len(counts), dtype=torch.bool)
    order = np.argsort(-counts, kind="stable")[:rows]
    keep[torch.from_numpy(order[counts[order] >= 2])] = True
    return keep


def plan(cfg: RunConfig, world: World, counts: np.ndarray, sides: int, row: int, form: str,
         saved: dict[str, Any] | None = None, replica: int = 0, visits: np.ndarray | None = None) -> BufferPlan:
    """Every rank's part of the plan, agreed through rank 0 (every rank calls it at the same point). `counts`: the
    run's visits per position of this rank's replica's shard; `sides`: the boundary sides this rank's stage holds;
    `row`: one row's bytes; `form`: how a row is held, for the line (float16, 8-bit, ...); `saved`: the note of the
    plan a resumed checkpoint's run made; `visits`: every replica's counts, where replicas take unequal shares (the
    ranks check they counted alike)."""
    wanted = int((counts >= 2).sum())
    mine = rank_budget(cfg, sides, launch().local_world_size, counts, replica, visits)
    everyone = gather(mine, world)
    verdict: Any = None
    if everyone is not None:
        try:
            verdict = agree_replicas(everyone, row, saved) if visits is not None else \
                agree(everyone, row, wanted, saved)
            if isinstance(verdict, int):  # equal shares: one count, the fewest any rank holds
                verdict = [verdict] * (max(b.replica for b in everyone) + 1)
            if isinstance(verdict, list):
                verdict = (verdict, describe(cfg, everyone, counts, wanted, verdict, row, form, saved))
        except Exception as exc:  # said on every rank, not left for the others to wait out
            verdict = f"AQ-SGD buffers: planning failed: {exc}"
    verdict = broadcast(verdict, world)
    if isinstance(verdict, str):
        raise ValueError(verdict)
    by_replica, line = verdict
    rows = by_replica[replica]
    directory = str(buffer_directory(cfg)) if sides and rows and mine.on_disk(row, rows) else None
    return BufferPlan(kept_samples(counts, rows), directory, line if world.rank == 0 else None,
                      {"rows": by_replica[0] if len(set(by_replica)) == 1 else by_replica, "visits": mine.visits})


def agree_replicas(budgets: list[RankBudget], row: int, saved: dict[str, Any] | None = None) -> list[int] | str:
    """Each replica's agreed rows (`agree` over its ranks: replicas of unequal shares hold shards of other sizes, and
    both sides of a boundary are in one replica), or why the ranks cannot agree."""
    replicas = max(b.replica for b in budgets) + 1
    kept = (saved or {}).get("rows")
    kept = kept if isinstance(kept, list) and len(kept) == replicas else [None if isinstance(kept, list) else kept] * \
        replicas
    out = []
    for r in range(replicas):
        mine = [b for b in budgets if b.replica == r]
        rows = agree(budgets, row, mine[0].wanted,
                     None if saved is None or kept[r] is None else {**saved, "rows": kept[r]}, mine)
        if isinstance(rows, str):
            return rows
        out.append(rows)
    return out


def agree(budgets: list[RankBudget], row: int, wanted: int, saved: dict[str, Any] | None = None,
          holders: list[RankBudget] | None = None) -> int | str:
    """The samples every rank (of `holders`, default all) can hold rows for (the fewest any can; a resumed run's own
    count where its visits are counted alike and every rank still holds it), or why the ranks cannot agree: each
    computes which samples keep rows from the visits it counted, so those must be the same everywhere."""
    if len({b.visits for b in budgets}) > 1:
        digests = [b.visits[:8] for b in budgets]
        return (f"the ranks count different visits per sample (digests by rank: {digests}): expected every rank to "
                "load the same data with the same seed and batch sizes")
    rows = min(b.rows(row, wanted) for b in holders or budgets)
    if saved is not None and saved.get("visits") == budgets[0].visits and saved.get("rows", wanted + 1) <= rows:
        return int(saved["rows"])
    return rows


def describe(cfg: RunConfig, budgets: list[RankBudget], counts: np.ndarray, wanted: int, by_replica: list[int],
             row: int, form: str, saved: dict[str, Any] | None = None) -> str:
    """The start line: how many samples keep rows (by replica where their shards differ), their bytes and place on
    each rank, and what the rest cost."""
    visits = int(counts.sum())
    wants = [next(b.wanted for b in budgets if b.replica == r) for r in range(len(by_replica))]
    if not any(wants):
        return (f"AQ-SGD buffers: none kept: no sample is visited twice in this run's {visits:,} visits, so every "
                "visit goes whole, as a first visit")
    where = []
    for rank, budget in enumerate(budgets):
        if budget.sides:
            rows = by_replica[budget.replica]
            place = f"on disk under {buffer_directory(cfg)}" if budget.on_disk(row, rows) else "in memory"
            where.append(f"rank {rank} {size(budget.sides * rows * row)} {place}")
    if len(set(wants)) == 1 and len(set(by_replica)) == 1:
        kept = (f"rows for {by_replica[0]:,} of the {wanted:,} samples visited again ({len(counts):,} in a replica's "
                "shard)")
    else:
        kept = "rows for " + ", ".join(f"{rows:,} of replica {r}'s {want:,} samples visited again"
                                       for r, (rows, want) in enumerate(zip(by_replica, wants)))
    line = f"AQ-SGD buffers: {kept}, {size(row)} each ({form}): " + ", ".join(where)
    short = sum(want - rows for rows, want in zip(by_replica, wants))
    if short and saved is not None and saved.get("rows") in (by_replica, by_replica[0]):
        line += f"; as the resumed checkpoint's run kept, the other {short:,} samples sent whole at every visit"
    elif short:
        tight = min((b for b in budgets if b.sides), key=lambda b: b.rows(row, b.wanted))
        line += (f"; the budget holds no more (a rank with {tight.sides} side(s), {size(tight.memory)} of memory "
                 f"and {size(tight.disk)} of disk: --buffer_memory_gb, --buffer_disk_gb), so the other "
                 f"{short:,} samples are sent whole at every visit")
    return line
