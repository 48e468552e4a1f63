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
