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
from dataclasses import dataclass
from typing import Any, Iterator

from . import data as datalib
from .data import regroup
from .data.regroup import Dealt


@dataclass(frozen=True)
class Dealing:
    """This replica's dealing: `place` (replica, replicas); `dealt`: the epoch begun over another replica count, or
    None; `rows`: the AQ-SGD rows its sample ids index; `launched`: num_micro_batches as this launch was given it
    (before a regroup rescaled it: checkpoint._regrouped)."""

    train_set: Any
    micro_batch_size: int
    num_micro_batches: int
    seed: int
    place: tuple[int, int]
    dealt: Dealt | None = None
    rows: int = 0
    launched: int = 0

    def begun_elsewhere(self, epoch: int) -> Dealt | None:
        """How `epoch` was dealt where it began over another replica count than this run's; else None."""
        return self.dealt if self.dealt is not None and epoch == self.dealt.epoch else None

    def per_epoch(self, epoch: int) -> int:
        """Steps in `epoch`: at the count it began with where that was another."""
        by = self.begun_elsewhere(epoch)
        return datalib.steps_per_epoch(self.train_set, self.micro_batch_size,
                                       by.num_micro_batches if by else self.num_micro_batches,
                                       by.replicas if by else self.place[1], last="keep")  # HF keeps the last batch

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
                                         datalib.shard_size(len(self.train_set), self.place[1]))
        return itertools.islice(datalib.micro_batches(self.train_set, self.micro_batch_size, self.num_micro_batches,
                                                      epoch=epoch, seed=self.seed, shard=self.place, last="keep"),
                                done, None)

    def note(self, epoch: int) -> dict[str, Any]:
        """What a checkpoint in `epoch` records of the dealing (its manifest's position, beside the epoch and index)."""
        by = self.begun_elsewhere(epoch)
        return {"dealt": [by.replicas, by.num_micro_batches] if by else [self.place[1], self.num_micro_batches],
                "rows": self.rows, "launched": self.launched}


def dealing(cfg: Any, train_set: Any, place: tuple[int, int], manifest: dict[str, Any], regroups: bool,
            speaks: bool) -> Dealing:
    """The run's dealing, resumed from a checkpoint's `manifest` (empty: from the start); `regroups`: the checkpoint
    had another replica count (its codecs start fresh, so the rows are this run's own). Rank 0 (`speaks`) says a
    regrouped epoch in one line."""
    replicas, position = place[1], manifest.get("position")
    # num_micro_batches as the first launch was given it, which every later one's flags give again
    launched = cfg.num_micro_batches if not manifest else (position or {}).get(
        "launched", manifest["fingerprint"].get("num_micro_batches", cfg.num_micro_batches))
    dealt = None
    if position is not None and position.get("dealt") is not None and position["dealt"][0] != replicas:
        dealt = Dealt(position["epoch"], *position["dealt"])
    rows = datalib.shard_size(len(train_set), replicas) + (regroup.rows(train_set, dealt) if dealt else 0)
    if position is not None and not regroups and position.get("rows"):
        rows = position["rows"]  # the codecs carried hold this many
    made = Dealing(train_set, cfg.micro_batch_size, cfg.num_micro_batches, cfg.seed, place, dealt, rows, launched)
    if dealt is not None and speaks and position["index"] < made.per_epoch(dealt.epoch):
        print(f"data: epoch {dealt.epoch}, begun over {dealt.replicas} replica{'s' if dealt.replicas > 1 else ''}, "
              f"goes on over {replicas} to its step {made.per_epoch(dealt.epoch)}: each step's global batch is the "
              f"one it began with ({dealt.replicas} x {dealt.num_micro_batches} micro-batches of "
              f"{cfg.micro_batch_size}), {cfg.num_micro_batches} micro-batches a replica; no sample trained twice or "
              "left out", file=sys.stderr, flush=True)
    return made
