"""Sample ids and batches: each replica's fixed shard, shuffled by (seed, epoch) identically in every process,
so every stage of a replica loads the same micro-batches without talking; evaluation in index order."""
from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from aqpipe.compression.fields import check_int, is_int

# what an epoch's last, partial batch becomes: dropped, filled up from the start of the shard's epoch order, or kept
# as it is (HF's and TRL's way: fewer micro-batches, the last of them shorter)
LAST_BATCHES = ("drop", "fill", "keep")


def shard_size(num_samples: int, count: int) -> int:
    """Samples in each of `count` replicas' fixed shards (the rows of its AQ-SGD buffers): equal for
    all, so every replica takes as many steps; the last `num_samples % count` are not trained on."""
    for name, value, low in (("num_samples", num_samples, 0), ("count", count, 1)):
        check_int(name, value, low, what=f"an int >= {low}")
    return num_samples // count


def split_by(count: int, shares: Sequence[int]) -> list[int]:
    """`count` items in parts as `shares` weigh them (largest remainders, the first replicas first among equals, so
    equal shares split as numpy's array_split does), then at least one each, taken from the largest part."""
    if count < len(shares):
        raise ValueError(f"{count} samples over {len(shares)} replicas: expected at least one a replica")
    total = sum(shares)
    quotas = [count * s / total for s in shares]
    parts = [math.floor(q) for q in quotas]
    for r in sorted(range(len(shares)), key=lambda r: (-(quotas[r] - parts[r]), r))[:count - sum(parts)]:
        parts[r] += 1
    for r in range(len(parts)):
        if parts[r] == 0:
            parts[max(range(len(parts)), key=lambda x: parts[x])] -= 1
            parts[r] = 1
    return parts


def check_shares(shares: Sequence[int], count: int) -> tuple[int, ...]:
    """`shares` (micro-batches a step, one per replica) checked against `count` replicas; ValueError naming them."""
    shares = tuple(shares)
    if len(shares) != count or not all(is_int(s) and s >= 1 for s in shares):
        raise ValueError(f"micro_batch_shares={list(shares)}: expected {count} counts of micro-batches >= 1, one a "
                         "replica")
    return shares


def shard_sizes(num_samples: int, micro_batch_size: int, shares: Sequence[int]) -> tuple[list[int], int]:
    """(each replica's shard size, steps an epoch) where replica r takes `shares[r]` micro-batches a step and every
    epoch visits its whole shard (last="keep"). Equal shares: `shard_size` each, as always. Unequal: the same
    `num_samples % replicas` left out, every step but the last takes each replica's share of micro-batches, and the
    last, partial global batch is split as the shares weigh it (`split_by`), so every replica takes as many steps
    (a last batch with fewer samples than replicas is left out)."""
    count = len(shares)
    if len(set(shares)) == 1:
        size = shard_size(num_samples, count)
        return [size] * count, math.ceil(size / (micro_batch_size * shares[0]))
    usable, per_step = num_samples - num_samples % count, micro_batch_size * sum(shares)
    steps = math.ceil(usable / per_step)
    last = usable - (steps - 1) * per_step
    if last < count:
        steps, last = steps - 1, per_step
    if steps < 1:
        raise ValueError(f"the dataset has {num_samples} samples, fewer than the {count} replicas: expected at least "
                         "one sample a replica")
    return [(steps - 1) * micro_batch_size * s + part for s, part in zip(shares, split_by(last, shares))], steps


def steps_per_epoch(dataset: Dataset, micro_batch_size: int, num_micro_batches: int, shard_count: int = 1,
                    *, last: str = "drop", shares: Sequence[int] | None = None) -> int:
    """Optimizer steps in one epoch: one global batch (micro_batch_size x num_micro_batches x
    shard_count samples) per step, each replica's part taken from its own shard (`shard_size`); a
    partial last batch as `last` says (LAST_BATCHES). The same for every replica, so they stay in step.
    `shares`: each replica's micro-batches a step where they differ (last="keep" alone: `shard_sizes`)."""
    if shares is not None and len(set(shares)) > 1:
        if last != "keep":
            raise ValueError(f"micro_batch_shares={list(shares)} with last={last!r}: expected last='keep'")
        return shard_sizes(len(dataset), micro_batch_size, check_shares(shares, shard_count))[1]
    for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches),
                        ("shard_count", shard_count)):
        check_int(name, value, 1, what="an int >= 1")
    if last not in LAST_BATCHES:
        raise ValueError(f"last={last!r}: expected one of {', '.join(LAST_BATCHES)}")
    size = micro_batch_size * num_micro_batches * shard_count
    keep_partial = last == "keep"
    if keep_partial and len(dataset) < shard_count:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than the {shard_count} replicas: expected at "
                         "least one sample a replica")
    if not keep_partial and len(dataset) < size:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one global batch of {size} "
                         f"(micro_batch_size={micro_batch_size} x num_micro_batches={num_micro_batches} x "
                         f"shard_count={shard_count}): expected a larger dataset or smaller batches")
    shard, per_replica = shard_size(len(dataset), shard_count), micro_batch_size * num_micro_batches
    return shard // per_replica if last == "drop" else math.ceil(shard / per_replica)


def sequential_batches(dataset: Dataset, micro_batch_size: int,
                       num_micro_batches: int) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Every sample once, in index order, for evaluation: the last step and micro-batch may be short."""
    for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches)):
        check_int(name, value, 1, what="an int >= 1")
    n, per_step = len(dataset), micro_batch_size * num_micro_batches
    for start in range(0, n, per_step):
        chunk = range(start, min(start + per_step, n))
        yield [_gather(dataset, chunk[i:i + micro_batch_size]) for i in range(0, len(chunk), micro_batch_size)]


def micro_batches(dataset: Dataset, micro_batch_size: int, num_micro_batches: int, epoch: int, seed: int,
                  shard: tuple[int, int] = (0, 1), *, last: str = "drop", shuffle: bool = True,
                  shares: Sequence[int] | None = None) -> Iterator[list[dict[str, Any]]]:
    """Per optimizer step, this replica's `num_micro_batches` micro-batches of `micro_batch_size`; the epoch's
    partial last step as `last` says (LAST_BATCHES: with "keep", what is left of the shard, as many micro-batches
    as it fills, the last of them shorter).

    `shard=(index, count)`: replica `index` of `count` trains on a fixed shard of
    `shard_size(len(dataset), count)` samples drawn from `seed` alone, so a sample stays in one
    replica's AQ-SGD buffers for the whole run (one new to a replica's buffers is sent whole); the
    `len(dataset) % count` samples left over are not trained on. Each epoch the shard is shuffled
    by (seed, epoch), the same in every process that asks (`shuffle=False`: dataset order within
    the shard, for evaluation); with one replica the shard is the whole dataset, in the order
    earlier versions gave. `sample_id` is the sample's position in the shard, its row in this
    replica's buffers (with one replica, the dataset index). `shares`: each replica's micro-batches a step where
    the replicas differ in speed (their shards as `shard_sizes` weighs them; `num_micro_batches` is then
    `shares[index]`). Arguments are checked here, not at the first `next()`.
    """
    index, count = _check_shard(shard)
    for name, value in (("epoch", epoch), ("seed", seed)):
        check_int(name, value, 0, what="an int >= 0")
    if shares is not None:
        num_micro_batches = check_shares(shares, count)[index]
    steps = steps_per_epoch(dataset, micro_batch_size, num_micro_batches, count, last=last, shares=shares)
    members = _shard_members(len(dataset), seed, index, count, shares, micro_batch_size)
    visits = len(members) if last == "keep" else steps * micro_batch_size * num_micro_batches
    order = _epoch_order(len(members), seed, epoch, visits, shuffle)
    return _steps(dataset, members, order, steps, micro_batch_size, num_micro_batches)


def _epoch_order(size: int, seed: int, epoch: int, visits: int, shuffle: bool = True) -> np.ndarray:
    """The shard positions an epoch visits, in order: the shard shuffled by (seed, epoch), cut to `visits` (a
    dropped partial batch) or filled up from its start."""
    order = np.random.default_rng([seed, epoch]).permutation(size) if shuffle else np.arange(size)
    return np.concatenate([order, order[: visits - size]]) if visits > size else order[:visits]


def visit_counts(dataset: Dataset, micro_batch_size: int, num_micro_batches: int, seed: int, shard_count: int,
                 total_steps: int, *, last: str = "drop", shares: Sequence[int] | None = None,
                 index: int = 0) -> np.ndarray:
    """How often a run of `total_steps` steps visits each position of replica `index`'s shard (with equal shares
    the same for every replica: each shuffles its shard alike), in the order `micro_batches` gives: which samples
    AQ-SGD's buffers will read back (those visited twice or more), and how often."""
    check_int("total_steps", total_steps, 0)
    if shares is not None:
        num_micro_batches = check_shares(shares, shard_count)[index]
    per_epoch = steps_per_epoch(dataset, micro_batch_size, num_micro_batches, shard_count, last=last, shares=shares)
    size = shard_sizes(len(dataset), micro_batch_size, shares or (1,) * shard_count)[0][index]
    per_step = micro_batch_size * num_micro_batches
    counts = np.zeros(size, dtype=np.int64)
    for epoch in range(math.ceil(total_steps / per_epoch)):
        steps = min(per_epoch, total_steps - epoch * per_epoch)
        np.add.at(counts, _epoch_order(size, seed, epoch, min(steps * per_step, size) if last == "keep"
                                       else steps * per_step), 1)
    return counts


def _shard_members(num_samples: int, seed: int, index: int, count: int, shares: Sequence[int] | None = None,
                   micro_batch_size: int = 1) -> np.ndarray:
    """Dataset indices of replica `index`'s shard, sorted; never the epoch's, so shards stay put.
    With one replica: every index. The draw's entropy is not [seed] alone, which numpy pads to
    [seed, 0], the stream of epoch 0's order. `shares`: the replicas' micro-batches a step (None: equal)."""
    sizes = shard_sizes(num_samples, micro_batch_size, shares or (1,) * count)[0]
    start = sum(sizes[:index])
    drawn = np.random.default_rng([seed, 0, 1]).permutation(num_samples)
    return np.sort(drawn[start: start + sizes[index]])


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    try:
        index, count = shard
    except (TypeError, ValueError):
        raise ValueError(f"shard={shard!r}: expected (index, count)") from None
    if not all(is_int(v) for v in (index, count)) or not 0 <= index < count:
        raise ValueError(f"shard={shard!r}: expected (index, count) with integers 0 <= index < count")
    return index, count


def _steps(dataset: Dataset, members: np.ndarray, order: np.ndarray, steps: int, micro_batch_size: int,
           num_micro_batches: int) -> Iterator[list[dict[str, Any]]]:
    """Consecutive slices of `order` (positions in the shard `members`), one per step."""
    per_replica = micro_batch_size * num_micro_batches
    for step in range(steps):
        mine = order[step * per_replica: (step + 1) * per_replica]  # a kept partial step's: what is left
        yield [_shard_batch(dataset, members, mine[m: m + micro_batch_size])
               for m in range(0, len(mine), micro_batch_size)]


def _shard_batch(dataset: Dataset, members: np.ndarray, positions: np.ndarray) -> dict[str, Any]:
    """The shard's samples at `positions`; `sample_id` is overwritten with those positions, their
    rows in this replica's AQ-SGD buffers (a dataset's own sample_id is its global index)."""
    batch = _gather(dataset, members[positions])
    batch["sample_id"] = torch.tensor(positions, dtype=torch.int64)
    return batch


def _gather(dataset: Dataset, indices: np.ndarray) -> dict[str, Any]:
    """The samples at `indices` stacked per field; `sample_id` added where a dataset lacks it."""
    if hasattr(dataset, "batch"):  # TensorDictDataset, lm.TokenBlocks: one gather per field
        return dataset.batch(indices)
    items = [dataset[int(i)] for i in indices]
    batch = {key: _stack([item[key] for item in items]) for key in items[0]}
    batch.setdefault("sample_id", torch.as_tensor(indices, dtype=torch.int64))
    return batch


def _stack(values: Iterable[Any]) -> Any:
    values = list(values)
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values)
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
        return torch.as_tensor(values)
    return values
