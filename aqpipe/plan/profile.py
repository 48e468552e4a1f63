"""What `--placement auto` measures at start, on every rank alike: its device on one block of the run's model at the
run's shape, the memory it has, and each of its links, with messages the size of the run's boundary messages.

- **The device**: a stage of one block (and the embeddings, which cost next to nothing) built from the model's
  config with random weights, its forward and backward on one micro-batch of the run's shape, the median of a few
  after one warm-up, frozen where LoRA freezes the base. A machine's ranks take turns (they share its host). An
  emulated slower device (AQPIPE_COMPUTE_SLOWDOWN) is stretched here as in the steps.
- **The links**: every pair at once in n - 1 rounds of disjoint pairs (a round-robin tournament). A pair's latency
  is half its fastest round trip of a byte; each direction's rate is a boundary message's one-way time (a round
  trip with a byte back, less that latency) over its bytes. Emulated links (AQPIPE_LINK_MATRIX) hold each message
  as the steps' messages are held.
- Every rank's row is gathered, so all hold the same table (`Cluster`), which rank 0 also writes to
  `<output_dir>/cluster.yaml` for `--cluster` and `aqpipe plan`.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from aqpipe.buffer_plan import available_memory
from aqpipe.environment import launch
from aqpipe.pipeline.loading import build_stage

from .cluster import Cluster, Machine

REPEATS = 3  # timed forward-backward passes, and round trips per pair
SMALLEST, LARGEST = 64 << 10, 4 << 20  # the probe message's bytes: the boundary message's, within these


def one_block_config(config: Any) -> Any:
    """The model's config with two blocks (stage 0 of two then holds the embeddings and one block)."""
    small = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(small, name):
            setattr(small, name, 2)
    for name in ("layer_types",):  # per-block lists (sliding windows) follow the count
        value = getattr(small, name, None)
        if isinstance(value, list):
            setattr(small, name, value[:2])
    return small


def block_seconds(cfg: Any, model_class: type, config: Any, device: torch.device, slowdown: float = 1.0) -> float:
    """One block's forward and backward of one micro-batch at the run's shape, on `device` (median of REPEATS)."""
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    stage, _, _ = build_stage(model_class, one_block_config(config), 0, 2, seed=cfg.seed, dtype=dtype, device=device)
    if cfg.lora.enabled:
        stage.requires_grad_(False)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    batch = {"input_ids": torch.randint(0, vocab, (cfg.micro_batch_size, cfg.data.seq_len), device=device),
             "attention_mask": torch.ones(cfg.micro_batch_size, cfg.data.seq_len, dtype=torch.long, device=device)}
    times = []
    for _ in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = stage(None, batch)
        hidden = out if isinstance(out, torch.Tensor) else out.hidden
        if hidden.requires_grad:
            hidden.backward(torch.randn_like(hidden))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - started
        if slowdown > 1:
            time.sleep((slowdown - 1) * took)
        times.append(took * slowdown)
    return statistics.median(times[1:])


def free_memory(device: torch.device, local_ranks: int) -> float:
    """What this rank may hold: its GPU's free memory, or its share of the host's available memory."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    return available_memory() / max(1, local_ranks)


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """A round-robin tournament of `n` players: n - 1 rounds (n rounds for odd n) of disjoint pairs, every pair
    once."""
    players = list(range(n)) + ([None] if n % 2 else [])
    k = len(players)
    out = []
    for _ in range(k - 1):
        pairs = [(players[i], players[k - 1 - i]) for i in range(k // 2)]
        out.append([(a, b) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return out


def _round_trip(peer: int, nbytes: int, sending: bool, matrix: Any) -> float:
    """`nbytes` from the sender to its peer, a byte back: on the sender's side, the round trip's seconds (0 on the
    other's). Under emulated links each message is held as the steps' are, from when it landed."""
    message, reply = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    if sending:  # the peer says it is ready first (not held), so the clock starts with its receive posted
        dist.recv(reply, peer)
        started = time.monotonic()
        dist.send(message, peer)
        dist.recv(reply, peer)
        _hold(matrix, peer, 1)
        return time.monotonic() - started
    dist.send(reply, peer)
    dist.recv(message, peer)
    _hold(matrix, peer, nbytes)
    dist.send(reply, peer)
    return 0.0


def _hold(matrix: Any, src: int, nbytes: int) -> None:
    """An emulated link's delivery of `nbytes` from `src`, landed just now (nothing without a matrix)."""
    if matrix is not None:
        time.sleep(matrix.seconds(src, matrix.me, nbytes))


def link_row(me: int, n: int, nbytes: int, matrix: Any = None) -> dict[int, tuple[float, float]]:
    """This rank's links as measured: peer -> (latency s, rate bytes/s from this rank to the peer). A pair's
    latency is half its fastest byte's round trip; a direction's rate, a message's round trip less that (what the
    latencies and the byte back take) over its bytes."""
    out: dict[int, tuple[float, float]] = {}
    for pairs in rounds(n):
        pair = next(((a, b) for a, b in pairs if me in (a, b)), None)
        if pair is None:
            continue
        first = me == pair[0]
        peer = pair[1] if first else pair[0]
        tiny = [_round_trip(peer, 1, first, matrix) for _ in range(REPEATS)]
        mine = theirs = 0.0
        for sender_first in (True, False):  # the first's message out, then the peer's
            took = _round_trip(peer, nbytes, first == sender_first, matrix)
            mine = took if first == sender_first else mine
        shared = torch.tensor([min(tiny) if first else 0.0], dtype=torch.float64)
        if first:
            dist.send(shared, peer)
        else:
            dist.recv(shared, peer)
        round_trip = float(shared[0])
        theirs = max(mine - round_trip, 1e-9)
        out[peer] = (round_trip / 2, nbytes / theirs)
    return out


def measure(cfg: Any, world: Any, model_class: type, config: Any, message_bytes: float) -> tuple[Cluster, float]:
    """Every rank's table, the same on all (call on every rank at once); the seconds it took."""
    started = time.perf_counter()
    here = launch()
    block = 0.0
    for turn in range(here.local_world_size):  # a machine's ranks in turn: they share its host (one host, all)
        if turn == here.local_rank:
            block = block_seconds(cfg, model_class, config, world.device, world.compute_slowdown)
        if world.size > 1:
            dist.barrier()
    memory = free_memory(world.device, here.local_world_size)
    nbytes = int(min(max(message_bytes, SMALLEST), LARGEST))
    links = link_row(world.rank, world.size, nbytes, world.link_matrix) if world.size > 1 else {}
    rows: list[Any] = [None] * world.size
    mine = {"block_s": block, "memory": memory, "links": links}
    if world.size > 1:
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    n = world.size
    latency = [[0.0] * n for _ in range(n)]
    rate = [[float("inf")] * n for _ in range(n)]
    for i, row in enumerate(rows):
        for j, (lat, r) in row["links"].items():
            latency[i][j], rate[i][j] = lat, r
    machines = tuple(Machine(f"rank{i}", block_s=row["block_s"], memory_bytes=row["memory"])
                     for i, row in enumerate(rows))
    cluster = Cluster(machines, tuple(map(tuple, latency)), tuple(map(tuple, rate)), source="measured")
    return cluster, time.perf_counter() - started
