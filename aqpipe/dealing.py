"""How a run deals its training data over its replicas, epoch by epoch: what the training loop iterates.

Each replica trains its own shard (data.micro_batches), except in the epoch a resume found begun over another
replica count, whose rest is dealt over this run's replicas as the global batches the epoch began with
(data/regroup.py). What follows from that, decided here once: the run's length in steps (the steps taken, the rest
of the epoch in progress as it is dealt, the later epochs at this count) and the rows AQ-SGD's buffers index (a
regrouped epoch's samples take rows past the shard's, which the run keeps while its codecs carry them). A checkpoint
records all of it in its manifest's "position" (checkpoint.save), so any later resume deals the same way.
"""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, replace
from typing import Any, Iterator

from . import data as datalib
from .data import regroup
from .data.regroup import Dealt


@dataclass(frozen=True)
class Dealing:
    """This replica's dealing: `place` (replica, replicas); `dealt`: the epoch begun over another replica count, or
    None; `rows`: the AQ-SGD rows its sample ids index; `launched`: num_micro_batches as this launch was given it
    (before a regroup rescaled it: checkpoint._regrouped); `shares`: every replica's micro-batches a step where they
    differ (None: num_micro_batches each)."""

    train_set: Any
    micro_batch_size: int
    num_micro_batches: int
    seed: int
    place: tuple[int, int]
    dealt: Dealt | None = None
    rows: int = 0
    launched: int = 0
    shares: tuple[int, ...] | None = None
    every_rows: tuple[int, ...] = ()  # every replica's `rows` (they differ where shares do)

    def this_run(self, epoch: int) -> Dealt:
        """How this run deals `epoch` (from its start)."""
        replicas = self.place[1]
        return Dealt(epoch, replicas, sum(self.shares) // replicas if self.shares else self.num_micro_batches,
                     self.shares)

    def dealt_as(self, epoch: int) -> Dealt:
        """How `epoch` is dealt: as it began elsewhere, or as this run deals it."""
        return self.begun_elsewhere(epoch) or self.this_run(epoch)

    def begun_elsewhere(self, epoch: int) -> Dealt | None:
        """How `epoch` was dealt where it began over another replica count than this run's; else None."""
        return self.dealt if self.dealt is not None and epoch == self.dealt.epoch else None

    def per_epoch(self, epoch: int) -> int:
        """Steps in `epoch`: at the count it began with where that was another (HF keeps an epoch's last batch)."""
        by = self.dealt_as(epoch)
        return datalib.steps_per_epoch(self.train_set, self.micro_batch_size, by.num_micro_batches, by.replicas,
                                       last="keep", shares=by.shares)

    def step_samples(self, epoch: int, index: int) -> int:
        """Samples step `index` (1-based) of `epoch` trains over every replica: a global batch, the last one of the
        epoch what is left of it."""
        each = self.dealt_as(epoch).each()
        sizes, steps = datalib.shard_sizes(len(self.train_set), self.micro_batch_size, each)
        whole = self.micro_batch_size * sum(each)
        return whole if index < steps else sum(sizes) - (steps - 1) * whole

    def total_steps(self, epochs: int, max_steps: int | None, position: dict[str, Any] | None, step: int) -> int:
        """The run's length: from a checkpoint at `step` and `position`, the steps taken, the rest of its epoch and
        the later ones at this count; from the start, `epochs` epochs. At most `max_steps`."""
        if position is None:
            total = self.per_epoch(0) * epochs
        else:
            epoch = position["epoch"]
            left = max(self.per_epoch(epoch) - position["index"], 0) if epoch < epochs else 0
            total = step + left + self.per_epoch(epoch + 1) * max(epochs - epoch - 1, 0)
        return total if max_steps is None else min(max_steps, total)

    def batches(self, epoch: int, done: int) -> Iterator[list[dict[str, Any]]]:
        """This replica's micro-batches for the steps of `epoch` after the first `done`."""
        if (by := self.begun_elsewhere(epoch)) is not None:
            return regroup.rest_of_epoch(self.train_set, self.micro_batch_size, by, self.seed, self.place, done,
                                         self.shard(), self.shares)
        return itertools.islice(datalib.micro_batches(self.train_set, self.micro_batch_size, self.num_micro_batches,
                                                      epoch=epoch, seed=self.seed, shard=self.place, last="keep",
                                                      shares=self.shares), done, None)

    def shard(self, replica: int | None = None) -> int:
        """A replica's shard size (default this one's): the AQ-SGD rows its own samples index."""
        return datalib.shard_sizes(len(self.train_set), self.micro_batch_size,
                                   self.this_run(0).each())[0][self.place[0] if replica is None else replica]

    def note(self, epoch: int) -> dict[str, Any]:
        """What a checkpoint in `epoch` records of the dealing (its manifest's position, beside the epoch and index)."""
        by = self.dealt_as(epoch)
        return {"dealt": [by.replicas, by.num_micro_batches, *([list(by.shares)] if by.shares else [])],
                "rows": list(self.every_rows) if len(set(self.every_rows)) > 1 else self.rows,
                "launched": self.launched}


def dealing(cfg: Any, train_set: Any, place: tuple[int, int], manifest: dict[str, Any], regroups: bool,
            speaks: bool) -> Dealing:
    """The run's dealing, resumed from a checkpoint's `manifest` (empty: from the start); `regroups`: the checkpoint
    had another replica count (its codecs start fresh, so the rows are this run's own). Rank 0 (`speaks`) says a
    regrouped epoch in one line."""
    replicas, position = place[1], manifest.get("position")
    # num_micro_batches as the first launch was given it, which every later one's flags give again
    launched = cfg.num_micro_batches if not manifest else (position or {}).get(
        "launched", manifest["fingerprint"].get("num_micro_batches", cfg.num_micro_batches))
    shares = cfg.data_parallel.unequal_shares()
    made = Dealing(train_set, cfg.micro_batch_size, shares[place[0]] if shares else cfg.num_micro_batches, cfg.seed,
                   place, None, 0, launched, tuple(shares) if shares else None)
    dealt = None
    if position is not None and position.get("dealt") is not None:  # the epoch in progress, dealt otherwise
        began = Dealt(position["epoch"], *position["dealt"])  # (a replica count, or shares of one, this run's not)
        dealt = began if began.each() != made.this_run(began.epoch).each() else None
    made = replace(made, dealt=dealt)
    extra = regroup.rows(train_set, dealt, cfg.micro_batch_size) if dealt else 0
    rows = [made.shard(r) + extra for r in range(replicas)]
    if position is not None and not regroups and position.get("rows"):  # the codecs carried hold this many
        rows = position["rows"] if isinstance(position["rows"], list) else [position["rows"]] * replicas
    made = replace(made, rows=rows[place[0]], every_rows=tuple(rows))
    if dealt is not None and speaks and position["index"] < made.per_epoch(dealt.epoch):
        print(f"data: epoch {dealt.epoch}, begun over {dealt.replicas} replica{'s' if dealt.replicas > 1 else ''}, "
              f"goes on over {replicas} to its step {made.per_epoch(dealt.epoch)}: each step's global batch is the "
              f"one it began with ({_began(dealt)} micro-batches of "
              f"{cfg.micro_batch_size}), {_each(shares, cfg.num_micro_batches)}; no sample trained twice or left out",
              file=sys.stderr, flush=True)
    if shares and speaks:
        sizes = datalib.shard_sizes(len(train_set), cfg.micro_batch_size, shares)[0]
        print(f"data: replicas take {','.join(map(str, shares))} micro-batches a step (micro_batch_shares), each from "
              f"a shard sized to its share ({', '.join(map(str, sizes))} samples), the average weighed to match; "
              f"{len(train_set) - sum(sizes)} samples left out", file=sys.stderr, flush=True)
    return made


def _began(dealt: Dealt) -> str:
    return f"{dealt.replicas} x {dealt.num_micro_batches}" if dealt.shares is None else \
        f"{dealt.replicas} replicas taking {','.join(map(str, dealt.shares))}"


def _each(shares: list[int] | None, num_micro_batches: int) -> str:
    return f"micro-batches {','.join(map(str, shares))} by replica" if shares else \
        f"{num_micro_batches} micro-batches a replica"
