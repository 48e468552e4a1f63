"""Micro-batches (aqpipe/data/batches.py): deterministic in any process, one shard per replica, stable sample
ids, padded tails, sequential evaluation batches."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from aqpipe import data
from tests.helpers.processes import ROOT, checkout_env
from tests.helpers.shakespeare import SEQ



def toy(n: int = 50) -> data.TensorDictDataset:
    ids = torch.arange(n * 4).view(n, 4)
    return data.TensorDictDataset({"input_ids": ids, "sample_id": torch.arange(n)}, seq_len=4, split="train")


def order(batches) -> list[list[int]]:
    return [[i for mb in step for i in mb["sample_id"].tolist()] for step in batches]


def test_micro_batches_shapes_and_contents(shakespeare_lm):
    ds = shakespeare_lm["eval"]
    steps = list(data.micro_batches(ds, 4, 3, epoch=0, seed=0))
    assert len(steps) == data.steps_per_epoch(ds, 4, 3) == len(ds) // 12
    for step in steps[:5]:
        assert len(step) == 3
        for mb in step:
            assert mb["input_ids"].shape == mb["labels"].shape == (4, SEQ) and mb["sample_id"].shape == (4,)
            assert torch.equal(mb["input_ids"], ds.batch(mb["sample_id"])["input_ids"])
    seen = [i for step in order(steps) for i in step]
    assert len(seen) == len(set(seen)) == len(steps) * 12


def test_micro_batches_are_deterministic_and_differ_across_epochs_and_seeds():
    ds = toy()
    first = order(data.micro_batches(ds, 2, 2, epoch=3, seed=7))
    assert first == order(data.micro_batches(ds, 2, 2, epoch=3, seed=7))
    assert first != order(data.micro_batches(ds, 2, 2, epoch=4, seed=7))
    assert first != order(data.micro_batches(ds, 2, 2, epoch=3, seed=8))


def test_micro_batches_are_the_same_in_another_process():
    code = ("import torch; from aqpipe import data; "
            "ds = data.TensorDictDataset({'input_ids': torch.arange(200).view(50, 4), 'sample_id': torch.arange(50)}, "
            "seq_len=4, split='train'); "
            "print([[mb['sample_id'].tolist(), mb['input_ids'][:, 0].tolist()] "
            "for s in data.micro_batches(ds, 2, 2, 3, 7, (1, 2)) for mb in s])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
                         check=True).stdout
    here = [[mb["sample_id"].tolist(), mb["input_ids"][:, 0].tolist()]
            for s in data.micro_batches(toy(), 2, 2, 3, 7, (1, 2)) for mb in s]
    assert json.loads(out) == here


def global_ids(batches) -> list[list[int]]:
    """Per step, the dataset indices of a toy() dataset's samples, read from their input_ids."""
    return [[i // 4 for mb in step for i in mb["input_ids"][:, 0].tolist()] for step in batches]


def flat(steps: list[list[int]]) -> list[int]:
    return [i for step in steps for i in step]


def test_each_replica_keeps_one_shard_every_epoch_and_shards_split_the_data():
    ds, replicas = toy(50), 3
    assert data.shard_size(50, replicas) == 16 and data.steps_per_epoch(ds, 2, 2, replicas) == 4
    shards = []
    for r in range(replicas):
        per_epoch = [flat(global_ids(data.micro_batches(ds, 2, 2, epoch=e, seed=0, shard=(r, replicas))))
                     for e in range(4)]
        assert all(len(ids) == len(set(ids)) == 16 and set(ids) == set(per_epoch[0]) for ids in per_epoch)
        shards.append(set(per_epoch[0]))
    covered = set().union(*shards)
    assert sum(map(len, shards)) == len(covered) == 48  # disjoint; 50 % 3 = 2 samples left out
    assert covered != set(range(48))  # drawn at random, not the first 48
    other_seed = set(flat(global_ids(data.micro_batches(ds, 2, 2, epoch=0, seed=1, shard=(0, replicas)))))
    assert other_seed != shards[0]


def test_order_within_a_shard_changes_every_epoch():
    ds = toy(50)
    orders = {tuple(flat(global_ids(data.micro_batches(ds, 2, 2, epoch=e, seed=0, shard=(1, 3))))) for e in range(4)}
    assert len(orders) == 4


def test_one_replica_keeps_the_order_of_earlier_versions():
    ds, n, per_step = toy(50), 50, 6
    for seed, epoch in ((0, 0), (7, 3)):
        expected = np.random.default_rng([seed, epoch]).permutation(n)
        steps = list(data.micro_batches(ds, 3, 2, epoch=epoch, seed=seed))
        assert order(steps) == global_ids(steps) == [expected[k * per_step:(k + 1) * per_step].tolist()
                                                     for k in range(n // per_step)]
        padded = order(data.micro_batches(ds, 3, 2, epoch, seed, last="fill"))
        filled = np.concatenate([expected, expected[:4]])  # 9 steps of 6: the last takes 4 from the start
        assert padded == [filled[k * per_step:(k + 1) * per_step].tolist() for k in range(9)]
    assert data.shard_size(50, 1) == 50


def test_sample_ids_are_positions_in_the_shard_each_always_the_same_sample():
    ds, replicas = toy(50), 3
    for r in range(replicas):
        rows = []
        for epoch in range(3):
            steps = list(data.micro_batches(ds, 2, 2, epoch, 0, (r, replicas)))
            assert sorted(flat(order(steps))) == list(range(16))
            rows.append(dict(zip(flat(order(steps)), flat(global_ids(steps)))))
        assert rows[0] == rows[1] == rows[2]  # one buffer row, one sample
        assert [rows[0][i] for i in range(16)] == sorted(rows[0].values())  # the shard in dataset order
        unshuffled = list(data.micro_batches(ds, 2, 2, 5, 0, (r, replicas), shuffle=False))
        assert flat(order(unshuffled)) == list(range(16))
        assert flat(global_ids(unshuffled)) == sorted(rows[0].values())


def test_padding_fills_the_last_batch_from_the_start_of_the_shards_epoch_order():
    ds, replicas = toy(50), 3
    assert data.steps_per_epoch(ds, 2, 2, replicas, last="fill") == 4  # 16 per shard: nothing to fill
    assert data.steps_per_epoch(ds, 3, 2, replicas) == 2  # 16 // 6
    assert data.steps_per_epoch(ds, 3, 2, replicas, last="fill") == 3  # the last with 2 from the start
    with pytest.raises(ValueError, match="last='pad': expected one of drop, fill, keep"):
        data.steps_per_epoch(ds, 3, 2, replicas, last="pad")
    for r in range(replicas):
        dropped = flat(order(data.micro_batches(ds, 3, 2, 1, 0, (r, replicas))))
        padded = order(data.micro_batches(ds, 3, 2, 1, 0, (r, replicas), last="fill"))
        assert [len(step) for step in padded] == [6, 6, 6]
        ids = flat(padded)
        assert ids[:12] == dropped and sorted(ids[:16]) == list(range(16)) and ids[16:] == ids[:2]


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_last_partial_batch_of_an_epoch_is_kept_as_hf_keeps_it(replicas):
    """27 samples in micro-batches of 2, 2 a step (TRL's count: ceil, not floor): every sample of a replica's shard
    once an epoch, the last step with the micro-batches it fills, the last of them shorter; as many steps on every
    replica; the run's visit counts are these visits."""
    ds = toy(27 + replicas - 1)  # 2 replicas: 28 samples, shards of 14
    shard = data.shard_size(len(ds), replicas)
    steps = data.steps_per_epoch(ds, 2, 2, replicas, last="keep")
    assert steps == -(-shard // 4) and steps > data.steps_per_epoch(ds, 2, 2, replicas)
    for r in range(replicas):
        batches = list(data.micro_batches(ds, 2, 2, epoch=1, seed=3, shard=(r, replicas), last="keep"))
        assert len(batches) == steps
        sizes = [[len(mb["sample_id"]) for mb in step] for step in batches]
        assert sizes[:-1] == [[2, 2]] * (steps - 1) and sum(sizes[-1]) == shard - 4 * (steps - 1)
        assert sizes[-1] == ([2] * ((shard % 4) // 2) + [1] * (shard % 2))  # the micro-batches it fills
        seen = sorted(i for step in order(batches) for i in step)
        assert seen == list(range(shard))  # positions in the shard: each once
    counts = data.visit_counts(ds, 2, 2, seed=3, shard_count=replicas, total_steps=2 * steps, last="keep")
    assert counts.tolist() == [2] * shard
    counts = data.visit_counts(ds, 2, 2, seed=3, shard_count=replicas, total_steps=steps + 1, last="keep")
    first = order(data.micro_batches(ds, 2, 2, epoch=1, seed=3, shard=(0, replicas), last="keep"))[0]
    assert sorted(np.flatnonzero(counts == 2).tolist()) == sorted(first)  # epoch 1's first step, visited again


def test_unshuffled_batches_and_limit_keep_dataset_order(cls_tok):
    assert order(data.micro_batches(toy(12), 2, 3, epoch=5, seed=1, shuffle=False)) == [list(range(6)),
                                                                                      list(range(6, 12))]
    full = data.classification_dataset("next_line", cls_tok, SEQ, max_samples=40)
    part = data.limit(full, 10)
    assert len(part) == 10 and part.num_labels == 2 and part.examples == full.examples[:10]
    assert torch.equal(part.tensors["input_ids"], full.tensors["input_ids"][:10])
    assert data.limit(full, None) is full and data.limit(full, 1000) is full
    with pytest.raises(ValueError, match="max_samples=0"):
        data.limit(full, 0)


def test_plain_datasets_get_sample_ids():
    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": torch.full((3,), i), "label": i % 2}

    (step,) = list(data.micro_batches(Plain(), 5, 2, epoch=0, seed=0))
    for mb in step:
        assert torch.equal(mb["x"][:, 0], mb["sample_id"]) and mb["label"].tolist() == (mb["sample_id"] % 2).tolist()

    class WithIds(Plain):
        def __getitem__(self, i):
            return {"x": torch.full((3,), i), "sample_id": i}

    (step,) = list(data.micro_batches(WithIds(), 5, 1, epoch=0, seed=0, shard=(1, 2)))
    (mb,) = step
    rows = dict(zip(mb["sample_id"].tolist(), mb["x"][:, 0].tolist()))
    assert sorted(rows) == list(range(5))  # positions in the shard, not the dataset's own ids
    assert [rows[i] for i in range(5)] == sorted(rows.values())


def test_batch_arguments_are_checked_at_the_call():
    ds = toy(10)
    cases = [((0, 1), {}, "micro_batch_size=0"), ((2, 0), {}, "num_micro_batches=0"),
             ((2, 1), {"shard": (2, 2)}, r"shard=\(2, 2\)"), ((2, 1), {"shard": (0, 0)}, r"shard=\(0, 0\)"),
             ((4, 2), {"shard": (0, 2)}, "10 samples, fewer than one global batch of 16"),
             ((2, 1), {"epoch": -1}, "epoch=-1")]
    for (mbs, nmb), kw, message in cases:
        kw = {"epoch": 0, "seed": 0, **kw}
        with pytest.raises(ValueError, match=message):
            data.micro_batches(ds, mbs, nmb, **kw)
    with pytest.raises(ValueError, match="shard_count=0"):
        data.steps_per_epoch(ds, 1, 1, 0)


def test_sequential_batches_cover_every_sample_once_in_order_with_short_tails():
    ds = data.TensorDictDataset({"sample_id": torch.arange(11), "input_ids": torch.arange(22).view(11, 2)},
                                seq_len=2, split="eval")
    steps = list(data.sequential_batches(ds, 3, 2))
    sizes = [[len(mb["sample_id"]) for mb in step] for step in steps]
    assert sizes == [[3, 3], [3, 2]]
    assert torch.cat([mb["sample_id"] for step in steps for mb in step]).tolist() == list(range(11))
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        list(data.sequential_batches(ds, 0, 2))


def indices(batches) -> list[list[int]]:
    """Each step's dataset indices (a shard's sample ids are positions in it)."""
    return [[int(i) // 4 for mb in step for i in mb["input_ids"][:, 0]] for step in batches]


# (samples, micro-batch size, shares): a faster replica taking 3 micro-batches a step to the other's 1; three
# replicas; a last global batch too small to give each of three replicas a sample (52 = 5 steps of 10 and 2 left)
SHARES = [(50, 2, (3, 1)), (101, 4, (5, 3)), (200, 3, (1, 2, 5)), (8, 1, (2, 1)), (98, 8, (3, 2, 1)),
          (52, 2, (3, 1, 1))]


@pytest.mark.parametrize("n, mb, shares", SHARES)
def test_unequal_shares_deal_every_sample_once_an_epoch_each_replica_its_share(n, mb, shares):
    ds, count = toy(n), len(shares)
    runs = [[indices(data.micro_batches(ds, mb, 1, epoch, 7, (r, count), last="keep", shares=shares))
             for r in range(count)] for epoch in (0, 1)]
    steps = data.steps_per_epoch(ds, mb, 1, count, last="keep", shares=shares)
    for epoch in runs:
        assert [len(replica) for replica in epoch] == [steps] * count  # every replica steps alike
        for replica, share in zip(epoch, shares):  # every step but the last: its share of micro-batches
            assert all(len(step) == mb * share for step in replica[:-1]) and 1 <= len(replica[-1]) <= mb * share
        seen = [i for replica in epoch for step in replica for i in step]
        assert len(seen) == len(set(seen))  # no sample twice
        left_out = n - len(seen)
        assert left_out < 2 * count  # at most the remainder of n / replicas, and a last batch too small to split
    shards = [sorted(i for step in replica for i in step) for replica in runs[0]]
    assert shards == [sorted(i for step in replica for i in step) for replica in runs[1]]  # shards stay put
    assert [len(s) for s in shards] == [len(set(s)) for s in shards]


def test_equal_shares_given_as_a_list_deal_as_the_replica_count_alone():
    ds = toy(53)
    for r in range(3):
        assert order(data.micro_batches(ds, 2, 2, 1, 5, (r, 3), last="keep", shares=[2, 2, 2])) == \
            order(data.micro_batches(ds, 2, 2, 1, 5, (r, 3), last="keep"))


def test_visit_counts_under_unequal_shares_count_each_replicas_own_visits():
    ds, shares, steps = toy(60), (3, 1), 11  # 60 = 7 steps of 8, and a last of 4: 11 steps end mid-epoch 1
    for r in range(2):
        seen = np.zeros(data.visit_counts(ds, 2, 1, 3, 2, steps, last="keep", shares=shares, index=r).shape, int)
        positions = [int(i) for epoch in (0, 1) for step in data.micro_batches(ds, 2, 1, epoch, 3, (r, 2),
                                                                                 last="keep", shares=shares)
                     for mb in step for i in mb["sample_id"]]
        per_epoch = data.steps_per_epoch(ds, 2, 1, 2, last="keep", shares=shares)
        took = [p for e in (0, 1) for k, step in enumerate(data.micro_batches(ds, 2, 1, e, 3, (r, 2), last="keep",
                                                                               shares=shares))
                if e * per_epoch + k < steps for mb in step for p in mb["sample_id"].tolist()]
        np.add.at(seen, took, 1)
        assert len(positions) > len(took)  # the run ends inside the second epoch
        assert np.array_equal(seen, data.visit_counts(ds, 2, 1, 3, 2, steps, last="keep", shares=shares, index=r))


def test_unequal_shares_that_do_not_fit_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"micro_batch_shares=\[3, 1\]: expected 3 counts"):
        data.micro_batches(toy(50), 2, 1, 0, 0, (0, 3), last="keep", shares=(3, 1))
    with pytest.raises(ValueError, match="expected last='keep'"):
        data.steps_per_epoch(toy(50), 2, 1, 2, last="drop", shares=(3, 1))
