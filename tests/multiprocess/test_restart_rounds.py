"""Two machines of one launch whose restart counts differ (one was restarted, the other not) rejoin and watch each
other: every key they meet under, the process group's and the watchdog's, comes from the round they agree on
(launch_round.py), never from TORCHELASTIC_RESTART_COUNT, which counts each machine's own restarts."""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aqpipe.config import DistributedSettings, RunConfig
from aqpipe.world import init_world, watched
from tests.helpers.processes import PRELOAD, free_port

PEER_TIMEOUT = 1.5  # a watchdog that cannot see its peer's beats stops the run after this


def _rank(rank: int, port: int, restarts: int, role: str, stay: float, queue) -> None:
    """One worker as torchrun's agent starts it: the agent's store, this machine's restart count."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(restarts), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    cfg = RunConfig(task="causal_lm", distributed=DistributedSettings(pipeline_stages=2, dist_timeout=20.0,
                                                                      peer_timeout=PEER_TIMEOUT))
    world = watched(init_world(cfg), cfg, "test")
    world.watchdog.interval = 0.2
    if role == "fail":  # the earlier round: this rank fails, and its report stays in the store
        world.watchdog.report("RuntimeError: the earlier round's failure")
        os._exit(1)
    if role == "leave":  # the earlier round's other rank: stopped by its agent
        os._exit(0)
    time.sleep(stay)  # several peer timeouts of heartbeats: each must see the other's
    total = torch.ones(1)
    dist.all_reduce(total)
    queue.put((rank, world.round_prefix, float(total)))
    world.watchdog.stop()
    dist.destroy_process_group()


def _round(ctx, port: int, restarts: list[int], roles: list[str], stay: float = 0.0):
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, restarts[r], roles[r], stay, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    results = {}
    while not queue.empty():
        rank, prefix, total = queue.get()
        results[rank] = (prefix, total)
    return [p.exitcode for p in procs], results


def test_machines_with_different_restart_counts_rejoin_and_see_each_others_heartbeats():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the agent's: outlives rounds
    # round one: both machines at their first start; rank 1 fails and leaves its report (and beats) in the store
    codes, _ = _round(ctx, port, [0, 0], ["leave", "fail"])
    assert codes == [0, 1], codes
    # round two: machine 0 was restarted once, machine 1 (its failure came from elsewhere) counts none of its own
    codes, results = _round(ctx, port, [1, 0], ["work", "work"], stay=4 * PEER_TIMEOUT)
    assert codes == [0, 0], (codes, results)
    (p0, t0), (p1, t1) = results[0], results[1]
    assert p0 == p1 and p0 not in ("aqpipe/0/", "aqpipe/1/"), results  # the agreed round, not a restart count
    assert t0 == t1 == 2.0
    del store
