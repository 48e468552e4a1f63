"""The run's dealing (aqpipe/dealing.py): its length from where a checkpoint stopped, the epoch a resume found begun
over another replica count, and the AQ-SGD rows it carries."""
from types import SimpleNamespace

import torch

from aqpipe import data
from aqpipe.data_parallel.config import DataParallelConfig
from aqpipe.dealing import dealing

CFG = SimpleNamespace(micro_batch_size=2, num_micro_batches=2, seed=1, data_parallel=DataParallelConfig())


def toy(n: int) -> data.TensorDictDataset:
    return data.TensorDictDataset({"input_ids": torch.arange(n * 2).view(n, 2), "sample_id": torch.arange(n)},
                                  seq_len=2, split="train")


def manifest(step, epoch, index, dealt, rows=None, launched=None):
    position = {"epoch": epoch, "index": index, "dealt": dealt, **({"rows": rows} if rows else {}),
                **({"launched": launched} if launched else {})}
    return {"step": step, "position": position, "fingerprint": {"num_micro_batches": dealt[1]}}


def test_a_run_is_as_long_as_its_steps_taken_the_rest_of_its_epoch_and_the_later_ones_at_its_count():
    """49 samples: 6 steps an epoch over 2 replicas x 2 micro-batches, 7 over 1 x 4. Shrunk at step 2 of 2 epochs:
    2 + 4 + 7 = 13 (counting every epoch at the new count would say 14)."""
    ds = toy(49)
    fresh = dealing(CFG, ds, (0, 2), {}, False, False)
    assert fresh.total_steps(2, None, None, 0) == 12 and fresh.dealt is None and fresh.rows == 24
    shrunk_cfg = SimpleNamespace(micro_batch_size=2, num_micro_batches=4, seed=1, data_parallel=DataParallelConfig())
    shrunk = dealing(shrunk_cfg, ds, (0, 1), manifest(2, 0, 2, [2, 2]), True, False)
    assert shrunk.per_epoch(0) == 6 and shrunk.per_epoch(1) == 7
    assert shrunk.total_steps(2, None, manifest(2, 0, 2, [2, 2])["position"], 2) == 13
    assert shrunk.total_steps(2, 10, manifest(2, 0, 2, [2, 2])["position"], 2) == 10
    assert shrunk.rows == 49 + 48  # the new shard's, and one per position of the regrouped epoch's global order
    assert shrunk.note(0) == {"dealt": [2, 2], "rows": 97, "launched": 2}
    assert shrunk.note(1) == {"dealt": [1, 4], "rows": 97, "launched": 2}


def test_a_resume_at_the_same_count_carries_the_rows_and_an_epoch_begun_elsewhere():
    ds = toy(49)
    cfg = SimpleNamespace(micro_batch_size=2, num_micro_batches=4, seed=1, data_parallel=DataParallelConfig())
    later = manifest(10, 1, 4, [1, 4], rows=97, launched=2)
    again = dealing(cfg, ds, (0, 1), later, False, False)
    assert (again.rows, again.dealt, again.launched) == (97, None, 2)  # the codecs carried hold 97 rows
    assert again.total_steps(2, None, later["position"], 10) == 13
    mid = manifest(4, 0, 4, [2, 2], rows=97, launched=2)  # still in the epoch begun over 2 replicas
    resumed = dealing(cfg, ds, (0, 1), mid, False, False)
    assert resumed.dealt is not None and resumed.dealt.replicas == 2 and resumed.rows == 97
    assert [len(step) for step in resumed.batches(0, 4)] == [4, 4]  # its steps 5 and 6, dealt as it began
    regrouped = dealing(cfg, ds, (0, 1), later, True, False)
    assert regrouped.rows == 49  # another count: fresh codecs, this run's own rows


def test_an_epoch_begun_over_unequal_shares_is_regrouped_wherever_this_run_deals_otherwise():
    """48 samples over 2 replicas taking 3 and 1 micro-batches of 2 (shards of 36 and 12, 6 steps an epoch): a
    resume with the same shares goes on from the shards; one with equal shares (after a detour over one replica,
    the checkpoint's shares are not kept) deals the rest of the epoch as the shares began it, every sample once."""
    ds = toy(48)
    shared = SimpleNamespace(micro_batch_size=2, num_micro_batches=2, seed=1,
                             data_parallel=DataParallelConfig(replicas=2, shares=[3, 1]))
    began = manifest(3, 0, 3, [2, 2, [3, 1]])
    same = [dealing(shared, ds, (r, 2), began, False, False) for r in range(2)]
    assert same[0].dealt is None and (same[0].rows, same[1].rows) == (36, 12)
    assert same[0].note(0)["dealt"] == [2, 2, [3, 1]] and same[0].note(0)["rows"] == [36, 12]
    equal = [dealing(CFG, ds, (r, 2), began, True, False) for r in range(2)]
    assert equal[0].dealt is not None and equal[0].dealt.shares == (3, 1)
    rest = [int(i) // 2 for d in equal for step in d.batches(0, 3) for mb in step for i in mb["input_ids"][:, 0]]
    taken = [int(i) // 2 for r in range(2) for step in list(data.micro_batches(ds, 2, 2, 0, 1, (r, 2), last="keep",
                                                                               shares=(3, 1)))[:3]
             for mb in step for i in mb["input_ids"][:, 0]]
    assert sorted(rest + taken) == list(range(48))  # the epoch's every sample, once
