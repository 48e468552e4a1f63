"""The model's best few placements measured at start (`--placement_trials`), the fastest measured taken.

The model prices a step within some 15% on the links this project measures against (RESULTS.md), so placements it
prices within that of each other (search.py keeps them: `Plan.candidates`) are told apart by playing them on the
machines the run has. A trial is one rank's part of a step under a candidate, with the step's real pieces and none of
its weights:

- **compute**: one block of the model (profile.OneBlock: random weights, the run's shape), run as many times as the
  stage holds blocks and its extras in blocks (the embeddings, the head), forward and backward in the schedule's
  order; a zb1 weight gradient as a forward's worth; an emulated slower device stretched as in the steps;
- **each boundary's messages** of the run's bytes (`Workload.forward_bytes`, `backward_bytes`) to and from the ranks
  holding the neighbouring stages, every receive posted at the step's start as the engine posts them, on the wire the
  steps use (emulated links hold them alike);
- **the tied rows** between each replica's first and last stage, and **the step's table** over the pipeline (a round
  of direct messages);
- **the replicas' sync**: the algorithm's collective of its bytes over the stage's replicas (`Comm`, on a group made
  for the trial), paced as emulated links pace it.

The job-wide table round is every placement's alike and is left out. Every rank plays every candidate (the
candidates share the machines); a candidate's step is its slowest rank's, the faster of `STEPS` (the first meets
cold links and allocations).

The messages travel on the job's default group, told apart by their tags, so that a candidate costs no process
groups but its replicas' (a group over a WAN costs round trips to the store). That takes gloo: NCCL ignores tags and
runs a pair's messages on one stream in issue order (pipeline/topology.py's channels), so under NCCL the run takes
the model's best unplayed (seat.py).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from aqpipe.data_parallel import Comm
from aqpipe.pipeline import Grid, emulated_device
from aqpipe.pipeline.schedule import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_ACT, RECV_GRAD,
                                      SEND_ACT, SEND_GRAD, train_schedule)
from aqpipe.pipeline.transport import Wire

from .profile import OneBlock, synchronize
from .search import Candidate
from .workload import Workload

STEPS = 2
ACTIVATION, GRADIENT, TIE, TABLE = range(1, 5)  # the trial's message tags, one per kind


def run(candidates: tuple[Candidate, ...], work: Workload, stages: int, world: Any, cfg: Any, model_class: type,
        config: Any) -> list[Candidate]:
    """Every candidate played on every rank (call on every rank at once, with the same candidates), with its measured
    step: its slowest rank's, the faster of STEPS. The same list on all."""
    block = OneBlock(cfg, model_class, config, world.device, frozen=work.schedule == "zb1")
    # its messages are made where the backend moves them from: no departures' thread (pipeline/departures.py)
    wire = Wire(latency_s=world.link_latency_s, transport=world.transport, mbit=world.link_mbit, device=world.device,
                defer=False, matrix=world.link_matrix)
    out = []
    for candidate in candidates:
        grid = Grid.for_world(world.size, stages, candidate.placement)
        comm = _replicas(grid, world)  # every rank makes every candidate's groups, in one order
        times = []
        for _ in range(STEPS):
            dist.barrier()
            started = time.perf_counter()
            _step(grid, candidate, work, world, block, wire, comm)
            took = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=world.transport)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took.item()))
        out.append(replace(candidate, measured=min(times)))
        if comm.group is not None:  # every rank is past its last use (the all_reduce above): its sockets closed
            dist.destroy_process_group(comm.group)
    return out


def _replicas(grid: Grid, world: Any) -> Comm:
    """This rank's stage's replicas under `grid`, on a group of their own (made on every rank, as torch asks)."""
    stage, _ = grid.coords(world.rank)
    mine = None
    for s in range(grid.stages):
        ranks = grid.data_parallel_ranks(s)
        group = dist.new_group(ranks) if grid.replicas > 1 else None
        if s == stage:
            mine = Comm(group, ranks, world.transport, None if world.link_matrix is None else world.link_matrix.pace)
    return mine


def _step(grid: Grid, candidate: Candidate, work: Workload, world: Any, block: OneBlock, wire: Wire,
          comm: Comm) -> None:
    """This rank's part of one step under `grid`."""
    S, me, device = grid.stages, world.rank, world.transport
    stage, replica = grid.coords(me)
    before = grid.rank(stage - 1, replica) if stage > 0 else None
    after = grid.rank(stage + 1, replica) if stage < S - 1 else None
    times = max(1, round(candidate.partition[stage] + work.stage_extra(stage, S)))
    forward, backward = max(1, round(work.forward_bytes)), max(1, round(work.backward_bytes))
    shares = candidate.predicted.shares  # this replica's micro-batches, as the candidate deals them
    actions = train_schedule(work.schedule, stage, S, shares[replica] if shares else work.micro_batches)
    posted = {(a.op, a.micro_batch): wire.post(forward, before, device, tag=ACTIVATION) if a.op == RECV_ACT else
              wire.post(backward, after, device, tag=GRADIENT)
              for a in actions if a.op in (RECV_ACT, RECV_GRAD)}
    held: dict[int, torch.Tensor] = {}
    for op, mb in actions:
        began = emulated_device.began()
        if op in (RECV_ACT, RECV_GRAD):
            posted[op, mb].wait()
        elif op == SEND_ACT:
            wire.send(torch.zeros(forward, dtype=torch.uint8, device=device), after, tag=ACTIVATION)
        elif op == SEND_GRAD:
            wire.send(torch.zeros(backward, dtype=torch.uint8, device=device), before, tag=GRADIENT)
        elif op == FORWARD:
            held[mb] = block.forward(block.hidden(), times)
        elif op in (BACKWARD, BACKWARD_INPUT):
            out = held.pop(mb)
            out.backward(torch.ones_like(out))
        elif op == BACKWARD_WEIGHT:  # a weight gradient's matmuls: about a forward's
            with torch.no_grad():
                block.forward(block.hidden().detach(), times)
        if op in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            synchronize(world.device)
            if world.compute_slowdown > 1:
                emulated_device.stretch(began, world.compute_slowdown, world.device)
    wire.flush()
    pipeline = grid.pipeline_ranks(replica)
    if work.tie_bytes and S > 1 and stage in (0, S - 1):  # the tied rows, between the first and the last stage
        _exchange(wire, [pipeline[-1] if stage == 0 else pipeline[0]], max(1, round(work.tie_bytes / 2)), TIE, device)
    # the step's table over the pipeline: each rank's row to every other at once
    _exchange(wire, [peer for peer in pipeline if peer != me], work.table_bytes, TABLE, device)
    _sync(comm, work, work.dp_bytes_per_parameter * work.stage_trained(stage, S, candidate.partition[stage]), device)


def _exchange(wire: Wire, peers: list[int], nbytes: int, tag: int, device: torch.device) -> None:
    """`nbytes` each way between this rank and each of `peers`, all at once."""
    incoming = [wire.post(nbytes, peer, device, tag=tag) for peer in peers]
    for peer in peers:
        wire.send(torch.zeros(nbytes, dtype=torch.uint8, device=device), peer, tag=tag)
    for message in incoming:
        message.wait()
    wire.flush()


def _sync(comm: Comm, work: Workload, nbytes: float, device: torch.device) -> None:
    """The replicas' sync of `nbytes` a member, as their algorithm's collective runs (`Workload.dp_kind`)."""
    k = comm.size
    if k < 2 or nbytes < 1:
        return
    if work.dp_kind == "ring":
        comm.allreduce_mean_(torch.zeros(max(1, round(nbytes / 4)), dtype=torch.float32, device=device))
    elif work.dp_kind == "gather":
        comm.allgather(torch.zeros(max(1, round(nbytes)), dtype=torch.uint8, device=device))
    elif work.dp_kind == "alltoall":
        size = max(1, round(nbytes / k))
        pieces = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(k)]
        comm.reduce_scatter_allgather(pieces, lambda got: got[comm.rank], [size] * k)
    else:  # "peers": an exchange with the ring's neighbours
        peers = sorted({(comm.rank - 1) % k, (comm.rank + 1) % k} - {comm.rank})
        comm.exchange(torch.zeros(max(1, round(nbytes)), dtype=torch.uint8, device=device), peers)
    synchronize(device)
