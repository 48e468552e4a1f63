"""An epoch dealt over another replica count mid-way (aqpipe/data/regroup.py): every sample the epoch had left is
trained once and none it trained is again, step k's global batch is the one the epoch began with, and the regrouped
samples' buffer rows are past the new shards' and never shared."""
import numpy as np
import pytest
import torch

from aqpipe import data
from aqpipe.data.regroup import Dealt, epoch_order, rest_of_epoch, rows


def toy(n: int) -> data.TensorDictDataset:
    return data.TensorDictDataset({"input_ids": torch.arange(n * 2).view(n, 2), "sample_id": torch.arange(n)},
                                  seq_len=2, split="train")


def trained(steps) -> list[int]:
    """The dataset indices a replica's steps train (input_ids' first column / 2)."""
    return [int(i) // 2 for step in steps for mb in step for i in mb["input_ids"][:, 0]]


# (samples, micro-batch size, the count the epoch began over and its micro-batches, the new count, steps done):
# shrinking, growing, to a count that is no divisor of the old, and a partial last step (50 = 2 x 25, 25 = 6 x 4 + 1)
CASES = [(48, 2, (2, 2), 1, 2), (48, 2, (1, 4), 2, 3), (48, 2, (2, 3), 3, 1), (50, 2, (2, 2), 1, 4),
         (50, 2, (2, 2), 2, 6), (48, 2, (4, 1), 2, 0)]


@pytest.mark.parametrize("n, mb, began, now, done", CASES)
def test_the_rest_of_the_epoch_trains_every_sample_it_had_left_once(n, mb, began, now, done):
    ds, dealt, seed = toy(n), Dealt(1, *began), 3
    before = [data.micro_batches(ds, mb, began[1], 1, seed, (r, began[0]), last="keep") for r in range(began[0])]
    before = [list(steps) for steps in before]
    epoch = sorted(i for steps in before for i in trained(steps))
    taken = [i for steps in before for i in trained(steps[:done])]
    rest = [list(rest_of_epoch(ds, mb, dealt, seed, (r, now), done, first_row=1000)) for r in range(now)]
    left = [i for steps in rest for i in trained(steps)]
    assert sorted(taken + left) == epoch  # every sample the epoch trains, once: none twice, none left out
    assert len(set(epoch)) == len(epoch)
    assert {len(steps) for steps in rest} == {len(before[0]) - done}  # every replica steps alike, to the epoch's end
    for k in range(len(before[0]) - done):  # step done + k's global batch is the one the epoch began with
        began_with = sorted(i for steps in before for i in trained(steps[done + k:done + k + 1]))
        assert sorted(i for steps in rest for i in trained(steps[k:k + 1])) == began_with


@pytest.mark.parametrize("n, mb, began, now, done", CASES)
def test_regrouped_rows_are_past_the_new_shards_and_never_shared(n, mb, began, now, done):
    ds, dealt = toy(n), Dealt(0, *began)
    shard = data.shard_size(n, now)
    for r in range(now):
        ids = [int(i) for step in rest_of_epoch(ds, mb, dealt, 5, (r, now), done, shard) for m in step
               for i in m["sample_id"]]
        assert len(set(ids)) == len(ids) and all(shard <= i < shard + rows(ds, dealt) for i in ids)


def test_the_epoch_order_is_the_replicas_steps_side_by_side():
    ds, seed = toy(48), 9
    order = epoch_order(ds, 2, Dealt(2, 2, 3), seed)
    steps = [list(data.micro_batches(ds, 2, 3, 2, seed, (r, 2), last="keep")) for r in range(2)]
    assert len(order) == len(steps[0]) == 4
    for k, batch in enumerate(order):
        assert batch.tolist() == trained(steps[0][k:k + 1]) + trained(steps[1][k:k + 1])
    other_epoch = epoch_order(ds, 2, Dealt(3, 2, 3), seed)
    assert not all(np.array_equal(a, b) for a, b in zip(order, other_epoch))


def test_a_last_step_too_small_for_the_new_replicas_is_refused_in_one_line():
    """50 samples over 2 replicas end the epoch with a step of 2 (25 = 6 x 4 + 1 each): 4 replicas cannot share it."""
    with pytest.raises(ValueError, match="regrouped epoch 0: its last step has 2 samples, fewer than the 4 replicas"):
        rest_of_epoch(toy(50), 2, Dealt(0, 2, 2), 1, (0, 4), 6, 25)
    assert list(rest_of_epoch(toy(50), 2, Dealt(0, 2, 2), 1, (0, 4), 7, 25)) == []  # the epoch ended: nothing left


# (samples, micro-batch size, how the epoch began, the new count, its shares (None: equal), steps done): an epoch
# begun over unequal shares regrouped over one replica and over three; an equal one over two unequal replicas
SHARED = [(50, 2, Dealt(1, 2, 2, (3, 1)), 1, None, 2), (52, 2, Dealt(1, 2, 2, (3, 1)), 3, (2, 1, 1), 1),
          (48, 2, Dealt(1, 1, 4), 2, (3, 1), 1), (61, 3, Dealt(1, 2, 3, (5, 1)), 2, (1, 5), 0)]


@pytest.mark.parametrize("n, mb, dealt, now, shares, done", SHARED)
def test_an_epoch_begun_or_going_on_over_unequal_shares_trains_every_sample_once(n, mb, dealt, now, shares, done):
    ds, seed = toy(n), 4
    before = [list(data.micro_batches(ds, mb, dealt.num_micro_batches, 1, seed, (r, dealt.replicas), last="keep",
                                      shares=dealt.shares)) for r in range(dealt.replicas)]
    epoch = sorted(i for steps in before for i in trained(steps))
    taken = [i for steps in before for i in trained(steps[:done])]
    rest = [list(rest_of_epoch(ds, mb, dealt, seed, (r, now), done, 1000, shares)) for r in range(now)]
    assert sorted(taken + [i for steps in rest for i in trained(steps)]) == epoch and len(set(epoch)) == len(epoch)
    weights = shares or (1,) * now
    for k in range(len(before[0]) - done):
        began_with = sorted(i for steps in before for i in trained(steps[done + k:done + k + 1]))
        parts = [trained(steps[k:k + 1]) for steps in rest]
        assert sorted(i for part in parts for i in part) == began_with  # the global batch the epoch began with
        if k < len(before[0]) - done - 1:  # each replica its share of it (the last, partial one as split_by cuts)
            assert [len(p) for p in parts] == [len(began_with) * w // sum(weights) for w in weights]
