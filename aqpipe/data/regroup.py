"""The rest of an epoch dealt over another replica count than the one it began with (a resume on fewer or more
replicas, an elastic restart): every sample the epoch had still to train is trained once, none it trained is again.

An epoch is dealt when it begins (`Dealt`: over R shards, M micro-batches each a step, or each replica its share of
micro-batches) and keeps that dealing to its end: its step k trains the same global batch (every shard's part of
step k, in shard order) whatever the replica count that takes it, which cuts it into parts as the new replicas'
shares weigh them (equal parts where they are equal; the global batch is kept: R x M = R' x M'). So a run regrouped
mid-epoch takes that epoch's global batches as the uninterrupted run would; from the next epoch each replica deals
its own new shard (batches.micro_batches).

A regrouped sample's `sample_id`, its row in the AQ-SGD buffers, is past the new shard's rows (`first_row` + its
position in the epoch): rows the new shards never use, so a buffer row never mixes two samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .batches import _epoch_order, _gather, _shard_members, shard_sizes, split_by


@dataclass(frozen=True)
class Dealt:
    """How epoch `epoch` was dealt when it began: over `replicas` shards, `num_micro_batches` a shard a step, or
    each replica its `shares` of micro-batches where they differed."""

    epoch: int
    replicas: int
    num_micro_batches: int
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.shares is not None:
            object.__setattr__(self, "shares", tuple(self.shares))

    def each(self) -> tuple[int, ...]:
        """Every replica's micro-batches a step."""
        return self.shares or (self.num_micro_batches,) * self.replicas


def epoch_order(dataset: Dataset, micro_batch_size: int, dealt: Dealt, seed: int) -> list[np.ndarray]:
    """The epoch's global batches, step by step, as dataset indices: step k's is every shard's part of its step k
    (batches.micro_batches with last="keep"), in shard order."""
    n, count, each = len(dataset), dealt.replicas, dealt.each()
    sizes, steps = shard_sizes(n, micro_batch_size, each)
    parts = []
    for r in range(count):
        order, per = _epoch_order(sizes[r], seed, dealt.epoch, sizes[r]), micro_batch_size * each[r]
        members = _shard_members(n, seed, r, count, dealt.shares, micro_batch_size)
        parts.append([members[order[k * per:(k + 1) * per]] for k in range(steps)])
    return [np.concatenate([shard[k] for shard in parts]) for k in range(steps)]


def rows(dataset: Dataset, dealt: Dealt, micro_batch_size: int = 1) -> int:
    """The AQ-SGD rows a regrouped epoch adds past the new shard's: one for each position of its global order."""
    return sum(shard_sizes(len(dataset), micro_batch_size, dealt.each())[0])


def rest_of_epoch(dataset: Dataset, micro_batch_size: int, dealt: Dealt, seed: int, shard: tuple[int, int],
                  done: int, first_row: int, shares: Sequence[int] | None = None) -> Iterator[list[dict[str, Any]]]:
    """Replica `shard[0]` of `shard[1]`'s micro-batches for the epoch's steps after the first `done`: its part of
    each global batch as `shares` (the new replicas' micro-batches a step; None: equal) weighs it, a partial last one
    as `batches.split_by` cuts it, cut into micro-batches of `micro_batch_size`; sample ids from `first_row` on (the
    module's docstring)."""
    index, count = shard
    batches = epoch_order(dataset, micro_batch_size, dealt, seed)
    if done < len(batches) and len(batches[-1]) < count:
        raise ValueError(f"regrouped epoch {dealt.epoch}: its last step has {len(batches[-1])} samples, fewer than the "
                         f"{count} replicas; expected at most {len(batches[-1])} replicas until the epoch ends (or "
                         "--max_train_samples a multiple of the global batch)")
    return _rest(dataset, micro_batch_size, batches, index, tuple(shares or (1,) * count), done, first_row)


def _rest(dataset: Dataset, micro_batch_size: int, batches: list[np.ndarray], index: int, shares: tuple[int, ...],
          done: int, first_row: int) -> Iterator[list[dict[str, Any]]]:
    starts = np.cumsum([0] + [len(b) for b in batches])
    for k in range(done, len(batches)):
        cuts = np.cumsum([0] + split_by(len(batches[k]), shares))
        part = np.arange(cuts[index], cuts[index + 1])
        positions = starts[k] + part  # in the epoch's global order
        mine = batches[k][part]
        yield [_regrouped_batch(dataset, mine[m:m + micro_batch_size], first_row + positions[m:m + micro_batch_size])
               for m in range(0, len(mine), micro_batch_size)]


def _regrouped_batch(dataset: Dataset, indices: np.ndarray, ids: np.ndarray) -> dict[str, Any]:
    batch = _gather(dataset, indices)
    batch["sample_id"] = torch.as_tensor(ids, dtype=torch.int64)
    return batch
