"""AQ-SGD's buffers at a user's dataset size: a row costs memory only once written and only for a sample the run
reads back; both sides keep the same samples; a checkpoint holds the rows that exist."""
import io

import numpy as np
import pytest
import torch

from aqpipe.compression import forward_codec, Message, SampleBuffer
from aqpipe.compression.row_store import RowStore

SHAPE = (4, 64)


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_buffer_for_a_large_dataset_costs_nothing_until_rows_are_written(tmp_path):
    before = resident_mb()
    buf = SampleBuffer(40_000, (64, 64))  # 8 kB a row: 328 MB were it filled up front
    assert resident_mb() - before < 32 and buf.nbytes == 0
    ids = torch.tensor([39_999, 7, 12_345])
    buf.store(ids, torch.ones(3, 64, 64))
    assert buf.nbytes == 3 * 64 * 64 * 2 and buf.used == 3
    assert torch.equal(buf.rows(ids), torch.ones(3, 64, 64, dtype=torch.float16))
    before = resident_mb()
    SampleBuffer(40_000, (64, 64), path=tmp_path / "rows.buf")
    assert resident_mb() - before < 32  # a file's rows are not read in either
    # its blocks are reserved at once: no write through the mapping can meet a full disk later (SIGBUS)
    assert (tmp_path / "rows.buf").stat().st_blocks * 512 >= 40_000 * 64 * 64 * 2


def test_a_sample_kept_out_is_sent_whole_every_visit_and_stored_nowhere():
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[2, 5]] = True
    kw = {"num_samples": 10, "sample_shape": SHAPE, "first_visit": "hadamard", "first_visit_bits": 3}
    planned = [forward_codec("aqsgd", 2, seed=1, buffer_keep=keep, **kw) for _ in range(2)]
    every = [forward_codec("aqsgd", 2, seed=1, **kw) for _ in range(2)]
    ids = torch.tensor([1, 2, 3])
    for visit in range(2):
        x = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(visit))
        sent = [s.encode(x, ids) for s, _ in (planned, every)]
        got = [r.decode(Message(m.payload.clone(), m.shape, m.dtype), ids) for (_, r), m in zip((planned, every), sent)]
        assert torch.equal(got[0], sent[0].decoded)
        if visit == 0:  # first visits: the same bytes and values either way
            assert torch.equal(sent[0].payload, sent[1].payload) and torch.equal(got[0], got[1])
    for side in planned:
        assert side.buffer.seen.nonzero().flatten().tolist() == [2]  # samples 1 and 3 never took a row
        assert side.buffer.nbytes == side.buffer.row_nbytes
    assert sent[0].nbytes > sent[1].nbytes  # the second visit: 1 and 3 whole again where every keeps them


def test_rows_kept_only_for_samples_read_back_change_nothing_the_run_computes():
    """Samples visited once hold no row in the planned buffers; every message and decoded value is the same as with
    a row for every sample."""
    n, g = 12, torch.Generator().manual_seed(0)
    visits = [torch.randperm(n, generator=g)[:8] for _ in range(3)]  # some samples once, some more often
    counts = torch.bincount(torch.cat(visits), minlength=n)
    keep = counts >= 2
    runs = []
    for k in (None, keep):
        send, recv = (forward_codec("aqsgd", 2, seed=1, num_samples=n, sample_shape=SHAPE, buffer_keep=k)
                      for _ in range(2))
        out = []
        for epoch, order in enumerate(visits):
            for ids in order.split(4):
                x = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(epoch * 100 + int(ids[0])))
                m = send.encode(x, ids)
                out.append((m.payload, recv.decode(Message(m.payload.clone(), m.shape, m.dtype), ids)))
        runs.append((out, send.buffer, recv.buffer))
    (every, *_), (planned, send, recv) = runs
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(every, planned))
    assert send.used == int(keep.sum()) < int((counts > 0).sum()) == runs[0][1].used
    assert all(torch.equal(a, b) for a, b in zip(send.held(), recv.held()))


def test_every_rank_keeps_the_samples_the_fewest_rows_any_rank_holds_allow():
    from aqpipe.buffer_plan import RankBudget, agree, kept_samples

    row, wanted = 1000, 40
    budgets = [RankBudget(1, 10**9, 0, False, "v"), RankBudget(2, 30_000, 10_000, False, "v"),
               RankBudget(0, 0, 0, False, "v")]  # rank 1: a middle stage, room for 15 samples' two rows
    assert agree(budgets, row, wanted) == 15
    assert agree(budgets[:1], row, wanted) == wanted  # all of them fit in memory
    assert agree([RankBudget(1, 10**9, 5_000, True, "v")], row, wanted) == 5  # --buffer_dir: its disk budget
    counts = np.array([1, 3, 2, 2, 0, 3, 2])
    assert kept_samples(counts, 3).nonzero().flatten().tolist() == [1, 2, 5]  # visited most, then lowest first
    assert kept_samples(counts, 9).nonzero().flatten().tolist() == [1, 2, 3, 5, 6]  # never a sample seen once
    # a resume keeps its checkpoint's count where the visits are counted alike and every rank still holds it
    assert agree(budgets, row, wanted, {"rows": 12, "visits": "v"}) == 12
    assert agree(budgets, row, wanted, {"rows": 16, "visits": "v"}) == 15  # a rank holds fewer now
    assert agree(budgets, row, wanted, {"rows": 12, "visits": "w"}) == 15  # another run length: planned anew
    refused = agree([RankBudget(1, 1, 1, False, "aaaaaaaaa1"), RankBudget(1, 1, 1, False, "bbbbbbbbb2")], row, 3)
    assert refused.startswith("the ranks count different visits per sample (digests by rank: ['aaaaaaaa', "
                              "'bbbbbbbb'])")


def test_storing_a_sample_kept_out_is_refused():
    keep = torch.tensor([True, False, True])
    buf = SampleBuffer(3, (2,), keep=keep)
    with pytest.raises(ValueError, match=r"samples \[1\] are kept out"):
        buf.store(torch.tensor([0, 1]), torch.ones(2, 2))
    assert buf.used == 0 and not buf.seen.any()
    with pytest.raises(ValueError, match="keep: expected a bool tensor of one value per sample"):
        SampleBuffer(3, (2,), keep=torch.ones(4, dtype=torch.bool))


def test_an_undone_step_frees_the_slots_it_took_and_the_next_takes_them_alike():
    a, b = SampleBuffer(8, (3,)), SampleBuffer(8, (3,))
    for buf in (a, b):
        buf.store(torch.tensor([5]), torch.full((1, 3), 1.0))
    undo = a.snapshot(torch.tensor([2, 5]))
    a.store(torch.tensor([2, 5]), torch.full((2, 3), 9.0))  # a step that is rejected
    assert a.used == 2
    a.restore(undo)
    assert a.used == 1 and a.seen.nonzero().flatten().tolist() == [5]
    assert torch.equal(a.rows(torch.tensor([5])), torch.full((1, 3), 1.0, dtype=torch.float16))
    for buf in (a, b):
        buf.store(torch.tensor([3, 2]), torch.full((2, 3), 4.0))
    assert torch.equal(a.values, b.values) and torch.equal(a.state_dict()["ids"], b.state_dict()["ids"])
    with pytest.raises(RuntimeError, match=r"samples \[7\] hold no row"):
        a.rows(torch.tensor([7]))


def test_a_checkpoint_holds_the_rows_that_exist_not_the_datasets_worth():
    buf = SampleBuffer(100_000, (64, 64))  # 819 MB of rows at float16 were every sample held
    ids = torch.tensor([99_999, 3, 50_000])
    buf.store(ids, torch.randn(3, 64, 64))
    saved = io.BytesIO()
    torch.save(buf.state_dict(), saved)
    assert len(saved.getvalue()) < 3 * 64 * 64 * 2 + 8 * 1024  # three rows, their ids, torch.save's framing
    again = SampleBuffer(100_000, (64, 64))
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert all(torch.equal(x, y) for x, y in zip(again.held(), buf.held())) and again.used == 3
    again.store(torch.tensor([8]), torch.zeros(1, 64, 64))  # slots go on from where the saved ones ended
    assert again.state_dict()["ids"].tolist() == [99_999, 3, 50_000, 8]


def test_a_checkpoint_from_before_slots_loads():
    seen = torch.tensor([False, True, False, True])
    values = torch.arange(4 * 3, dtype=torch.float16).view(4, 3)
    buf = SampleBuffer(4, (3,))
    buf.load_state_dict({"values": values, "seen": seen})
    assert torch.equal(buf.rows(torch.tensor([3, 1])), values[[3, 1]]) and buf.used == 2


def test_rows_a_checkpoint_brings_beyond_the_kept_samples_find_room():
    full = SampleBuffer(6, (2,))
    full.store(torch.arange(6), torch.arange(12.0).view(6, 2))
    keep = torch.tensor([True, False, False, False, False, False])
    fewer = SampleBuffer(6, (2,), keep=keep)  # a resume that plans rows for one sample
    fewer.load_state_dict(full.state_dict())
    assert fewer.used == 6 and torch.equal(fewer.rows(torch.arange(6)), full.rows(torch.arange(6)))
    assert fewer.store_rows.capacity == 6  # room made once, for the rows it brought and those to come
    fewer.store(torch.tensor([4]), torch.zeros(1, 2))  # a sample holding a row keeps it
    assert fewer.keeps(torch.tensor([4, 5])).tolist() == [True, True]


def test_a_store_prefix_saves_exactly_its_rows():
    store = RowStore(1000, (4,), torch.float32)
    store.values[:3] = torch.arange(12.0).view(3, 4)
    prefix = store.prefix(3)
    assert prefix.untyped_storage().nbytes() == 3 * 16 and torch.equal(prefix, store.values[:3])
    store.grow(2000, keep=3)
    assert store.capacity == 2000 and torch.equal(store.values[:3], torch.arange(12.0).view(3, 4))


@pytest.mark.parametrize("last", ["drop", "keep"])
def test_visit_counts_are_the_visits_the_batches_make(last):
    """The plan's counts against the visits the trainer's batches make, in every replica, for runs that end within
    an epoch, at its end, within a kept partial step, and two and a half epochs in (the trainer keeps the partial
    step: last="keep")."""
    from aqpipe import data
    from tests.helpers.toy import toy_dataset

    dataset = toy_dataset(51, 4)  # 25 a shard of 2 replicas (one sample left out), 6 a step
    per_epoch = data.steps_per_epoch(dataset, 2, 3, 2, last=last)
    assert per_epoch == (5 if last == "keep" else 4)  # keep: a fifth step of one sample
    for total in (3, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3):
        for replica in (0, 1):
            seen = np.zeros(25, dtype=np.int64)
            for epoch in range(3):
                steps = list(data.micro_batches(dataset, 2, 3, epoch, seed=5, shard=(replica, 2), last=last))
                for mbs in steps[:max(0, total - epoch * per_epoch)]:
                    for mb in mbs:
                        seen[mb["sample_id"].numpy()] += 1
            assert np.array_equal(data.visit_counts(dataset, 2, 3, 5, 2, total, last=last), seen), (total, replica)


def test_the_kept_samples_break_ties_by_position_on_every_machine():
    """Two ranks on different machines must keep the same rows: among samples visited equally often, the lowest
    shard positions, whatever the sort implementation. 20,000 samples in three counts, so that an unstable sort
    (numpy's quicksort) orders the ties otherwise; against Python's sort by (visits descending, position)."""
    from aqpipe.buffer_plan import kept_samples

    counts = np.random.default_rng(3).integers(1, 4, 20_000)
    for rows in (1, 7_001, 13_333, 20_000):
        want = sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:rows]
        want = sorted(i for i in want if counts[i] >= 2)
        assert kept_samples(counts, rows).nonzero().flatten().tolist() == want, rows


def _plan(tmp_path, counts, memory_gb, disk_gb, sides=1, row=1000, buffer_dir=None, saved=None):
    from dataclasses import replace

    from aqpipe import buffer_plan
    from aqpipe.config import CheckpointingSettings, RunConfig
    from aqpipe.world import World

    cfg = RunConfig(task="causal_lm", checkpointing=CheckpointingSettings(output_dir=str(tmp_path / "out")))
    cfg = replace(cfg, compression=replace(cfg.compression, buffer_memory_gb=memory_gb, buffer_disk_gb=disk_gb,
                                           buffer_dir=buffer_dir))
    return buffer_plan.plan(cfg, World(0, 1, 0, torch.device("cpu")), np.array(counts), sides, row, "float16",
                            saved)


def test_rows_go_to_an_asked_for_directory_even_where_memory_holds_them_and_a_resume_keeps_its_count(tmp_path):
    counts = [2, 2, 1, 2, 2, 2, 2, 2, 2]
    asked = _plan(tmp_path, counts, 1.0, 1.0, buffer_dir=str(tmp_path / "rows"))
    assert asked.keep.sum() == 8 and asked.directory == str(tmp_path / "rows")
    assert asked.line.endswith(f"rank 0 8 kB on disk under {tmp_path / 'rows'}")
    fresh = _plan(tmp_path, counts, 4e-6, 0.0)  # room for 4 samples' rows in memory
    digest = fresh.note["visits"]
    resumed = _plan(tmp_path, counts, 4e-6, 0.0, saved={"rows": 3, "visits": digest})  # its run kept 3
    assert fresh.keep.sum() == 4 and resumed.keep.nonzero().flatten().tolist() == [0, 1, 3]
    assert resumed.line.endswith("rank 0 3 kB in memory; as the resumed checkpoint's run kept, the other 5 samples "
                                 "sent whole at every visit")
    other = _plan(tmp_path, counts[:-1] + [3], 4e-6, 0.0, saved={"rows": 3, "visits": digest})  # other visits
    assert other.keep.sum() == 4


def test_the_plan_keeps_rows_for_the_samples_read_back_where_they_fit_and_says_so(tmp_path):
    once = _plan(tmp_path, [1] * 8, 1.0, 1.0)  # one epoch: nothing comes back
    assert not once.keep.any() and once.directory is None
    assert once.line == ("AQ-SGD buffers: none kept: no sample is visited twice in this run's 8 visits, so every "
                         "visit goes whole, as a first visit")
    counts = [2, 2, 1, 2, 2, 2, 2, 2, 2]  # two epochs of 9, sample 2 dropped from one
    memory = _plan(tmp_path, counts, 8e-6, 0.0)
    assert memory.keep.sum() == 8 and not memory.keep[2] and memory.directory is None
    assert memory.line == ("AQ-SGD buffers: rows for 8 of the 8 samples visited again (9 in a replica's shard), "
                           "1 kB each (float16): rank 0 8 kB in memory")
    disk = _plan(tmp_path, counts, 7e-6, 8e-6)
    assert disk.keep.sum() == 8 and disk.directory == str(tmp_path / "out" / "buffers")
    assert disk.line.endswith(f"rank 0 8 kB on disk under {tmp_path / 'out' / 'buffers'}")
    bounded = _plan(tmp_path, counts, 2e-6, 3e-6)  # room for 3 samples' rows, on disk
    assert bounded.keep.nonzero().flatten().tolist() == [0, 1, 3] and bounded.directory is not None
    assert bounded.line.endswith("rank 0 3 kB on disk under " + str(tmp_path / "out" / "buffers") + "; the budget "
                                 "holds no more (a rank with 1 side(s), 2 kB of memory and 3 kB of disk: "
                                 "--buffer_memory_gb, --buffer_disk_gb), so the other 5 samples are sent whole at "
                                 "every visit")


@pytest.mark.parametrize("across_filesystems", [False, True])
def test_a_runs_last_checkpoint_takes_the_buffer_file_itself(tmp_path, monkeypatch, across_filesystems):
    buf = SampleBuffer(50_000, (2, 3), path=tmp_path / "live.buf")  # a file mapped for 50,000 rows, 3 written
    buf.store(torch.tensor([10, 4, 49_999]), torch.randn(3, 2, 3))
    held, state = buf.held(), buf.state_dict()
    if across_filesystems:  # a rename cannot cross filesystems: the rows are copied, the live file removed
        monkeypatch.setattr("aqpipe.compression.row_store.os.replace",
                            lambda *_: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    buf.hand_over(tmp_path / "checkpoint.buf")
    assert not (tmp_path / "live.buf").exists() and (tmp_path / "checkpoint.buf").stat().st_size == 3 * 12
    again = SampleBuffer(50_000, (2, 3))
    again.load_state_dict({**state, "rows_file": tmp_path / "checkpoint.buf"})
    assert all(torch.equal(x, y) for x, y in zip(again.held(), held))
    with pytest.raises(RuntimeError, match="handed over to the run's last checkpoint"):
        buf.rows(torch.tensor([10]))  # spent: one line, not an index error


def test_a_hand_over_that_fails_other_than_across_filesystems_says_so(tmp_path, monkeypatch):
    buf = SampleBuffer(10, (2,), path=tmp_path / "live.buf")
    buf.store(torch.tensor([3]), torch.ones(1, 2))
    monkeypatch.setattr("aqpipe.compression.row_store.os.replace",
                        lambda *_: (_ for _ in ()).throw(PermissionError(13, "no")))
    with pytest.raises(PermissionError):
        buf.hand_over(tmp_path / "checkpoint.buf")
    assert not (tmp_path / "checkpoint.buf").exists() and (tmp_path / "live.buf").stat().st_size == 4  # rows kept


def test_on_shuffled_epochs_a_fixed_set_of_rows_hits_as_often_as_the_optimal_rule_and_lru_hardly_at_all():
    from benchmarks.buffer_eviction import hits

    fixed, lru, belady = (hits(2000, 500, 2, rule)[1] for rule in ("fixed", "lru", "belady"))
    assert fixed == belady == 0.25 and lru < 0.06  # room for a quarter: a quarter of the revisits hit


def test_rows_the_machine_cannot_map_are_one_line_naming_their_size():
    with pytest.raises(ValueError, match=r"^AQ-SGD buffer: cannot map 1000000000000 rows of 128 bytes "
                                         r"\(128 TB\) in memory \(.*\): expected a budget this machine holds"):
        RowStore(10**12, (64,), torch.float16)


def test_the_default_budgets_share_the_machine_and_leave_disk_for_the_checkpoints_copies(tmp_path, monkeypatch):
    from dataclasses import replace

    from aqpipe import buffer_plan
    from aqpipe.config import CheckpointingSettings, RunConfig

    monkeypatch.setattr(buffer_plan, "available_memory", lambda: 16e9)
    monkeypatch.setattr(buffer_plan, "free_disk", lambda path: 80e9)
    cfg = RunConfig(task="causal_lm", checkpointing=CheckpointingSettings(output_dir=str(tmp_path)))
    counts = np.array([2, 2])
    budget = buffer_plan.rank_budget(cfg, 1, 2, counts)  # half of each, two ranks on the machine
    assert (budget.memory, budget.disk) == (4e9, 20e9)
    saving = replace(cfg, checkpointing=replace(cfg.checkpointing, save_every=10, save_total_limit=2))
    assert buffer_plan.rank_budget(saving, 1, 2, counts).disk == 5e9  # the rows and three checkpoint copies of them
    every = replace(cfg, checkpointing=replace(cfg.checkpointing, save_every=10, save_total_limit=0))
    assert buffer_plan.rank_budget(every, 1, 2, counts).disk == 5e9  # keep all: room for two and one being written
