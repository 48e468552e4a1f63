"""Set-up has no deadline: a rank that waits for another one's long set-up (tokenizing a large corpus, a model
download) is not cut off by the collective timeout, and still stops at once when the slow rank dies."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aqpipe.watchdog import Watchdog
from aqpipe.world import World, barrier
from tests.conftest import free_port

COLLECTIVE_TIMEOUT = 1.0
SLOW = 4.0  # rank 0's set-up: four times the collective timeout


def _rank(rank: int, port: int, patient: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
        world = World(rank, 2, rank, torch.device("cpu"))
        if patient:
            world.watchdog = Watchdog(rank, 2, lambda r: f"stage {r}", "test", peer_timeout=30, interval=0.2).start()
        if rank == 0:
            time.sleep(SLOW)
        started = time.monotonic()
        barrier(world)
        waited = time.monotonic() - started
        total = torch.ones(1)
        dist.all_reduce(total)  # the group still works after the wait
        queue.put((rank, waited, float(total), None))
        if world.watchdog is not None:
            world.watchdog.stop()
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        queue.put((rank, None, None, f"{type(exc).__name__}: {str(exc)[:200]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(patient: bool) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, patient, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = queue.get(timeout=120)
        results[rank] = tuple(rest)
    for p in procs:
        p.join(timeout=30)
    return results


def test_a_set_up_longer_than_the_collective_timeout_is_waited_for():
    results = _run(patient=True)
    assert all(error is None for _, _, error in results.values()), results
    waited, total, _ = results[1]
    assert waited > SLOW - 1.0 and total == 2.0, results  # rank 1 waited out rank 0's whole set-up


def test_without_the_store_barrier_the_collective_timeout_cuts_the_set_up_off():
    """The reason for the store barrier: a collective barrier gives up after the collective timeout."""
    results = _run(patient=False)
    assert results[1][2] is not None, results
