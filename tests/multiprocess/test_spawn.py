"""The helper every multi-process test stands on sees every rank fail: an error, a late error, an exit status."""
import multiprocessing.util
import os

import pytest
import torch.distributed as dist

from tests.helpers.processes import spawn


def returns_rank(rank, world):
    return rank * 10


def exits_7_after_returning(rank, world):
    if rank == 1:  # runs as the process ends, after its result was queued and the closing barrier passed
        multiprocessing.util.Finalize(None, os._exit, args=(7,), exitpriority=100)
    return rank


def fails_at_the_closing_barrier(rank, world):
    if rank == 1:  # its result is queued; the barrier after it raises
        dist.destroy_process_group()
    return rank


def raises(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_results_come_back_by_rank():
    assert spawn(returns_rank, 2) == [0, 10]


@pytest.mark.parametrize("fn,says", [(exits_7_after_returning, "rank 1 failed: its process ended with status 7"),
                                     (fails_at_the_closing_barrier, "Default process group has not been initialized"),
                                     (raises, "boom on rank 1")])
def test_a_rank_that_fails_in_any_way_is_named(fn, says):
    with pytest.raises(RuntimeError) as info:
        spawn(fn, 2, timeout=60)
    assert str(info.value).startswith("rank 1 failed") and says in str(info.value)  # the cause before its echoes


def sees_its_test(rank, world):
    return os.environ.get("AQPIPE_SPAWN_PROBE"), os.getcwd()


def test_workers_take_the_tests_environment_and_directory_though_their_server_started_earlier(monkeypatch, tmp_path):
    spawn(returns_rank, 2)  # the fork server runs from here on
    monkeypatch.setenv("AQPIPE_SPAWN_PROBE", "this test's")
    monkeypatch.chdir(tmp_path)
    assert spawn(sees_its_test, 2) == [("this test's", str(tmp_path))] * 2
