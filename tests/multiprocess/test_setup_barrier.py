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
from tests.helpers.processes import PRELOAD, free_port

COLLECTIVE_TIMEOUT = 2.0  # also the rendezvous' limit: shorter ones failed to connect on a busy machine
SLOW = 5.0  # rank 0's set-up: more than twice the collective timeout
PEER_TIMEOUT = 2.0


def _rank(rank: int, port: int, dies: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # held by the parent, as torchrun's agent holds it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    world = World(rank, 2, rank, torch.device("cpu"))
    world.watchdog = Watchdog(rank, 2, lambda r: f"stage {r}", "test", prefix="aqpipe/test/", peer_timeout=PEER_TIMEOUT,
                              interval=0.2).start()
    if rank == 0:
        time.sleep(SLOW)
        if dies:
            os._exit(9)  # the slow rank dies during its set-up
    started = time.monotonic()
    barrier(world)
    waited = time.monotonic() - started
    total = torch.ones(1)
    dist.all_reduce(total)  # the group still works after the wait
    queue.put((rank, waited, float(total)))
    world.watchdog.stop()
    dist.destroy_process_group()


def _run(dies: bool) -> tuple[dict[int, tuple], list[int], list[float]]:
    ctx = mp.get_context("forkserver")  # the ranks fork from the server the other tests' ranks fork from
    ctx.set_forkserver_preload(PRELOAD)
    queue, port = ctx.Queue(), free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # outlives a dead rank 0
    procs = [ctx.Process(target=_rank, args=(r, port, dies, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ended = [0.0, 0.0]
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if not p.is_alive() and not ended[r]:
                ended[r] = time.monotonic()
        time.sleep(0.05)
    for r, p in enumerate(procs):
        ended[r] = ended[r] or time.monotonic()
        p.join(timeout=5)
    del store
    results = {}
    while not queue.empty():
        rank, *rest = queue.get()
        results[rank] = tuple(rest)
    return results, [p.exitcode for p in procs], ended


def test_a_set_up_longer_than_the_collective_timeout_is_waited_for():
    results, codes, _ = _run(dies=False)
    assert codes == [0, 0] and set(results) == {0, 1}, (codes, results)
    waited, total = results[1]
    assert waited > SLOW - 1.0 and total == 2.0, results  # rank 1 waited out rank 0's whole set-up


def test_a_rank_that_dies_during_set_up_ends_the_wait_of_the_others():
    results, codes, ended = _run(dies=True)
    assert codes == [9, 1] and not results, (codes, results)  # rank 1's watchdog ends it, status 1
    assert PEER_TIMEOUT - 1 < ended[1] - ended[0] < PEER_TIMEOUT + 3  # the missing heartbeat, not forever
