"""The rest of an epoch dealt over another replica count than the one it began with (a resume on fewer or more
replicas, an elastic restart): every sample the epoch had still to train is trained once, none it trained is again.

An epoch is dealt when it begins (`Dealt`: over R shards, M micro-batches each a step) and keeps that dealing to its
end: its step k trains the same global batch (every shard's part of step k, in shard order) whatever the replica
count that takes it, which cuts it into equal parts (the global batch is kept: R x M = R' x M'). So a run regrouped
mid-epoch takes that epoch's global batches as the uninterrupted run would; from the next epoch each replica deals
its own new shard (batches.micro_batches).

A regrouped sample's `sample_id`, its row in the AQ-SGD buffers, is past the new shard's rows (`first_row` + its
position in the epoch): rows the new shards never use, so a buffer row never mixes two samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from .batches import _epoch_order, _gather, _shard_members, shard_size, steps_per_epoch


@dataclass(frozen=True)
class Dealt:
    """How epoch `epoch` was dealt when it began: over `replicas` shards, `num_micro_batches` a shard a step."""

    epoch: int
    replicas: int
    num_micro_batches: int


def epoch_order(dataset: Dataset, micro_batch_size: int, dealt: Dealt, seed: int) -> list[np.ndarray]:
    """The epoch's global batches, step by step, as dataset indices: step k's is every shard's part of its step k
    (batches.micro_batches with last="keep"), in shard order."""
    n, count = len(dataset), dealt.replicas
    steps = steps_per_epoch(dataset, micro_batch_size, dealt.num_micro_batches, count, last="keep")
    per = micro_batch_size * dealt.num_micro_batches
    order = _epoch_order(shard_size(n, count), seed, dealt.epoch, shard_size(n, count))
    shards = [_shard_members(n, seed, r, count) for r in range(count)]
    return [np.concatenate([members[order[k * per:(k + 1) * per]] for members in shards]) for k in range(steps)]


def rows(dataset: Dataset, dealt: Dealt) -> int:
    """The AQ-SGD rows a regrouped epoch adds past the new shard's: one for each position of its global order."""
    return shard_size(len(dataset), dealt.replicas) * dealt.replicas


def rest_of_epoch(dataset: Dataset, micro_batch_size: int, dealt: Dealt, seed: int, shard: tuple[int, int],
                  done: int, first_row: int) -> Iterator[list[dict[str, Any]]]:
    """Replica `shard[0]` of `shard[1]`'s micro-batches for the epoch's steps after the first `done`: its equal part
    of each global batch (a partial last one in parts as equal as they come), cut into micro-batches of
    `micro_batch_size`; sample ids from `first_row` on (the module's docstring)."""
    index, count = shard
    batches = epoch_order(dataset, micro_batch_size, dealt, seed)
    if done < len(batches) and len(batches[-1]) < count:
        raise ValueError(f"regrouped epoch {dealt.epoch}: its last step has {len(batches[-1])} samples, fewer than the "
                         f"{count} replicas; expected at most {len(batches[-1])} replicas until the epoch ends (or "
                         "--max_train_samples a multiple of the global batch)")
    return _rest(dataset, micro_batch_size, batches, index, count, done, first_row)


def _rest(dataset: Dataset, micro_batch_size: int, batches: list[np.ndarray], index: int, count: int, done: int,
          first_row: int) -> Iterator[list[dict[str, Any]]]:
    starts = np.cumsum([0] + [len(b) for b in batches])
    for k in range(done, len(batches)):
        part = np.array_split(np.arange(len(batches[k])), count)[index]
        positions = starts[k] + part  # in the epoch's global order
        mine = batches[k][part]
        yield [_regrouped_batch(dataset, mine[m:m + micro_batch_size], first_row + positions[m:m + micro_batch_size])
               for m in range(0, len(mine), micro_batch_size)]


def _regrouped_batch(dataset: Dataset, indices: np.ndarray, ids: np.ndarray) -> dict[str, Any]:
    batch = _gather(dataset, indices)
    batch["sample_id"] = torch.as_tensor(ids, dtype=torch.int64)
    return batch
