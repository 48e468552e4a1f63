"""The process group a launcher describes, and what a rank does when another fails.

`deepspeed --num_gpus N`, `torchrun --nproc_per_node N` and plain `python` all come here: the launchers set
RANK / WORLD_SIZE / MASTER_ADDR (deepspeed also passes --local_rank), plain python runs one process holding
the whole model as a single stage. In a multi-process run a watchdog (watchdog.py) and `stop_after_failure`
make every rank stop within a bounded time, naming the rank that failed, when one dies or raises.
"""
from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from aqpipe.pipeline import Grid
from aqpipe.pipeline.emulated_link import LinkMatrix

from .config import RunConfig
from .environment import compute_slowdown, launch, link_latency_s, link_matrix, link_mbit, show_tracebacks
from . import interrupts
from .host_memory import keep_freed_memory, map_large_blocks
from .launch_round import join_group
from .placement import place_here
from .plan.cluster import read as read_cluster
from .watchdog import Watchdog


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    transport: torch.device = torch.device("cpu")  # where the backend moves tensors from (placement.py)
    watchdog: Watchdog | None = None  # a multi-process run's; its store holds the barriers set-up waits at
    round_prefix: str = "aqpipe/0/"  # this launch's keys in the launcher's store (a restart gets new ones)
    link_latency_s: float = 0.0  # an emulated one-way link delay (AQPIPE_LINK_LATENCY_MS), for the benchmarks
    link_mbit: float | None = None  # an emulated link rate (AQPIPE_LINK_MBIT; None: the link as it is)
    link_matrix: LinkMatrix | None = None  # or every pair's emulated link (AQPIPE_LINK_MATRIX)
    compute_slowdown: float = 1.0  # an emulated slower device (AQPIPE_COMPUTE_SLOWDOWN)
    grid: Grid | None = None  # who holds which (stage, replica), once the run has placed its ranks

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(cfg: RunConfig) -> World:
    """Join the process group the launcher described with the backend `cfg.distributed.backend` places this process on
    (placement.py), or run alone."""
    here = launch()  # config.resolve checked its world size is stages x replicas
    size, rank, local_rank = here.world_size, here.rank, here.local_rank
    placed = place_here(cfg.distributed.backend)  # preflight checked it can run here
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores among this machine's stages, not oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // here.local_world_size))
    if cfg.lora.load_in_4bit:  # its dequantized weights, one size per layer, would pile up in a heap that kept them
        map_large_blocks()  # (+0.4 GB), or fragment glibc's default one (+0.1-0.15 GB): each mapped and unmapped
    else:  # a step's large tensors are reused, not page-faulted in anew each micro-batch
        keep_freed_memory()
    if placed.device.type == "cuda":
        torch.cuda.set_device(placed.device)
    prefix = "aqpipe/0/"
    if size > 1:
        prefix = join_group(placed.backend, rank, size, timedelta(seconds=cfg.distributed.dist_timeout))
    matrix = link_matrix()
    links = None
    if matrix is not None:
        table = read_cluster(matrix, size)
        links = LinkMatrix(rank, table.latency, table.rate)
    return World(rank, size, local_rank, placed.device, placed.transport, link_latency_s=link_latency_s(),
                 link_mbit=link_mbit(), round_prefix=prefix, link_matrix=links,
                 compute_slowdown=compute_slowdown(rank, size))


def watched(world: World, cfg: RunConfig, prog: str) -> World:
    """`world` with its watchdog started under the round's keys (launch_round.py), where it has peers."""
    if not world.distributed:
        return world
    watched = replace(world)
    watched.watchdog = Watchdog(world.rank, world.size, describer(watched, cfg), prog, prefix=world.round_prefix,
                                peer_timeout=cfg.distributed.peer_timeout).start()
    return watched


def barrier(world: World) -> None:
    """Every rank waits for all: through the watchdog's store where there is one (no deadline while the ranks
    live: one rank may be building caches, downloading a model or writing the merged model for all)."""
    if not world.distributed:
        return
    if world.watchdog is not None:
        world.watchdog.barrier()
    else:
        dist.barrier()


def describer(world: World, cfg: RunConfig) -> Callable[[int], str]:
    """Where a rank sits, as failure lines name it: by the run's placement once it has one (`world.grid`), by rank
    order before."""
    def describe(rank: int) -> str:
        grid = world.grid or Grid.for_world(world.size, int(cfg.distributed.pipeline_stages))
        return grid.describe(rank)
    return describe


def _is_comm_error(exc: BaseException) -> bool:
    """A failed send, receive or collective: usually the consequence of another rank's failure."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                            "timed out", "gloo/transport", "NCCL"))


def stop_after_failure(exc: BaseException, world: World, cfg: RunConfig, watchdog: Watchdog | None,
                        prog: str) -> None:
    """Tell the other ranks, say what failed where in one line, and end this process (status 2 for bad input
    found late, 1 otherwise) without waiting on peers that may never answer."""
    me = f"rank {world.rank} ({describer(world, cfg)(world.rank)})"
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    signal_name = interrupts.received()  # a peer interrupted first may have broken this rank's collective
    culprit = watchdog.peer_failure() if signal_name == "SIGTERM" and watchdog is not None else None
    if culprit is not None:  # the launcher stopping the survivors of a real failure: name that failure
        watchdog.exit_for(culprit)
    if signal_name is not None or isinstance(exc, KeyboardInterrupt):  # Ctrl-C, SIGINT/SIGTERM from a launcher
        interrupts.say_once(interrupts.line(prog, me))
        if watchdog is not None:  # a rank interrupted alone: the others stop now, naming it
            watchdog.report("interrupted")
            watchdog.leave()  # rank 0's process, which may hold the store, ends last
        os._exit(130)
    if _is_comm_error(exc) and watchdog is not None:
        watchdog.wait_for_verdict()  # exits this process once it names the rank that failed
        _say(prog, f"{me} stopping: communication with its peers failed and no peer reported a failure: {first_line}")
        watchdog.report(f"stopped after a communication error: {first_line}")
        os._exit(1)
    bad_input = isinstance(exc, (ValueError, FileNotFoundError))  # found late: the data, a model's files
    expected = bad_input or isinstance(exc, FloatingPointError)
    if not expected or show_tracebacks():
        traceback.print_exception(exc)
    # bad input: one line, as for a bad flag, and the other ranks stop quietly with the same status. Said before the
    # others hear of it: a launcher stops every process once one has ended
    _say(prog, f"{first_line} (found by {me})" if bad_input else f"{me} failed: {type(exc).__name__}: {first_line}")
    if watchdog is not None:
        watchdog.report(f"{type(exc).__name__}: {first_line}", bad_input=bad_input)
        watchdog.linger()
    os._exit(2 if bad_input else 1)


def _say(prog: str, line: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"{prog}: error: {line}\n")  # one write: ranks sharing a terminal do not interleave a line
    sys.stderr.flush()
