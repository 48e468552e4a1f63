"""What `--placement auto` measures at start, on every rank alike: its device on one block of the run's model at the
run's shape, the memory it has, and each of its links, with messages sized from the run's boundary messages.

- **The device**: one block alone (a middle stage of three, from the model's config with random weights), its
  forward and backward on one micro-batch of the run's shape from a hidden state, the median of a few after one
  warm-up, frozen where LoRA freezes the base. A machine's ranks take turns (they share its host). An
  emulated slower device (AQPIPE_COMPUTE_SLOWDOWN) is stretched here as in the steps.
- **The links**: every pair at once in n - 1 rounds of disjoint pairs (a round-robin tournament). A pair's latency
  is half its fastest round trip of a byte; each direction's rate: a boundary message and one four times its size
  sent back to back, the second's bytes over the gap between their arrivals (`second_rate`). Emulated links
  (AQPIPE_LINK_MATRIX) hold each message as the steps' messages are held.
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
from aqpipe.pipeline import emulated_device
from aqpipe.pipeline.emulated_link import EmulatedLink, Landing
from aqpipe.pipeline.loading import build_stage

from .cluster import Cluster, Machine

REPEATS = 3  # timed forward-backward passes, and round trips per pair
SMALLEST, LARGEST = 64 << 10, 4 << 20  # the probes' bytes: a boundary message's and 4x, within these


def one_block_config(config: Any) -> Any:
    """The model's config with three blocks: stage 1 of three then holds one block and nothing else."""
    small = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(small, name):
            setattr(small, name, 3)
    for name in ("layer_types",):  # per-block lists (sliding windows) follow the count
        value = getattr(small, name, None)
        if isinstance(value, list):
            setattr(small, name, value[:3])
    return small


class OneBlock:
    """One block of the run's model alone (stage 1 of three, random weights) on `device`, with a micro-batch of the
    run's shape: what the profile times and the trials (trials.py) run as many times as a stage holds blocks. Frozen
    where LoRA freezes the base (`frozen`): its backward is then the input's gradient alone."""

    def __init__(self, cfg: Any, model_class: type, config: Any, device: torch.device, frozen: bool = False) -> None:
        self.device, self.bf16 = device, cfg.bf16
        self.dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        self.stage, _, _ = build_stage(model_class, one_block_config(config), 1, 3, seed=cfg.seed, dtype=self.dtype,
                                       device=device)
        if frozen or cfg.lora.enabled:
            self.stage.requires_grad_(False)
        self.shape = (cfg.micro_batch_size, cfg.data.seq_len, self.stage.hidden_size)
        vocab = int(getattr(config, "vocab_size", 2) or 2)
        rows, seq = self.shape[:2]
        self.batch = {"input_ids": torch.randint(0, vocab, (rows, seq), device=device),
                      "attention_mask": torch.ones(rows, seq, dtype=torch.long, device=device)}

    def hidden(self) -> torch.Tensor:
        """A hidden state that takes a gradient, as a stage's input does."""
        return torch.randn(*self.shape, device=self.device, dtype=self.dtype, requires_grad=True)

    def forward(self, hidden: torch.Tensor, times: int = 1) -> torch.Tensor:
        """The block `times` over, as a stage of that many blocks runs its micro-batch."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for _ in range(times):
                hidden = self.stage(hidden, self.batch)
        return hidden


def block_seconds(cfg: Any, model_class: type, config: Any, device: torch.device, slowdown: float = 1.0) -> float:
    """One block's forward and backward of one micro-batch at the run's shape, on `device` (median of REPEATS, after
    a warm-up): the block alone, from a hidden state that takes a gradient (the input's only where LoRA freezes the
    base), stretched by an emulated slowdown."""
    block = OneBlock(cfg, model_class, config, device)
    times = []
    for _ in range(REPEATS + 1):
        hidden = block.hidden()
        synchronize(device)
        started = emulated_device.began()
        out = block.forward(hidden)
        out.backward(torch.randn_like(out))
        synchronize(device)
        own = emulated_device.own_seconds(started, device) if slowdown > 1 else time.perf_counter() - started[0]
        times.append(own * slowdown)
    return statistics.median(times[1:])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _round_trip(peer: int, nbytes: int, sending: bool, matrix: Any, device: torch.device) -> float:
    """`nbytes` from the sender to its peer, a byte back: on the sender's side, the round trip's seconds (0 on the
    other's). Under emulated links each message is held as the steps' are, from when it landed. The messages live
    where the backend moves them from (`device`: the GPU under NCCL)."""
    message = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    reply = torch.zeros(1, dtype=torch.uint8, device=device)
    if sending:  # the peer says it is ready first (not held), so the clock starts with its receive posted
        dist.recv(reply, peer)
        synchronize(device)
        started = time.monotonic()
        dist.send(message, peer)
        dist.recv(reply, peer)
        synchronize(device)
        _hold(matrix, peer, 1)
        return time.monotonic() - started
    dist.send(reply, peer)
    dist.recv(message, peer)
    synchronize(device)
    _hold(matrix, peer, nbytes)
    dist.send(reply, peer)
    return 0.0


def _two_messages(peer: int, sizes: tuple[int, int], sending: bool, matrix: Any, device: torch.device) -> float:
    """Two messages of `sizes` bytes back to back: on the receiver's side, the seconds between their arrivals (0 on
    the sender's). The second crosses right behind the first, so that gap is its own bytes' time on the link, with
    no round trip in it; it is taken where they land (a byte back to the sender would queue behind the second on
    gloo's pair). Under emulated links each is held as the steps' messages are (`EmulatedLink`: from when it
    landed, behind the one before it)."""
    first, second = (torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes)
    ready = torch.zeros(1, dtype=torch.uint8, device=device)
    if sending:
        dist.recv(ready, peer)  # the peer's receives are posted
        synchronize(device)
        for work in [dist.isend(first, peer), dist.isend(second, peer)]:
            work.wait()
        return 0.0
    works = [dist.irecv(first, peer), dist.irecv(second, peer)]
    marks = [Landing(work, blocking=device.type == "cpu") for work in works]  # gloo's complete only when waited on
    dist.send(ready, peer)
    landed = [mark.wait() for mark in marks]
    if matrix is not None:  # when the emulated link would have delivered each
        link = EmulatedLink(matrix=matrix)
        landed = [at + link.hold(peer, n, at, at) for at, n in zip(landed, sizes)]
    return landed[1] - landed[0]


def _hold(matrix: Any, src: int, nbytes: int) -> None:
    """An emulated link's delivery of `nbytes` from `src`, landed just now (nothing without a matrix)."""
    if matrix is not None:
        time.sleep(matrix.seconds(src, matrix.me, nbytes))


def link_row(me: int, n: int, nbytes: float, matrix: Any = None,
             device: torch.device = torch.device("cpu")) -> dict[int, tuple[float, float]]:
    """This rank's links as measured: peer -> (latency s, rate bytes/s from this rank to the peer). A pair's
    latency is half its fastest byte's round trip; a direction's rate, from a boundary message and one four times
    its size sent back to back, read where they land and handed back (`probe_sizes`, `second_rate`)."""
    sizes = probe_sizes(nbytes)
    out: dict[int, tuple[float, float]] = {}
    for pairs in rounds(n):
        pair = next(((a, b) for a, b in pairs if me in (a, b)), None)
        if pair is None:
            continue
        first = me == pair[0]
        peer = pair[1] if first else pair[0]
        tiny = [_round_trip(peer, 1, first, matrix, device) for _ in range(REPEATS)]
        gap = 0.0  # the peer's messages to this rank, then this rank's to the peer
        for sender_first in (True, False):
            gap += _two_messages(peer, sizes, first != sender_first, matrix, device)
        inbound = torch.tensor([second_rate(sizes[1], gap)], dtype=torch.float64, device=device)
        outbound = torch.zeros(1, dtype=torch.float64, device=device)  # what the peer read of this rank's messages
        shared = torch.tensor([min(tiny) if first else 0.0], dtype=torch.float64, device=device)
        if first:
            dist.send(shared, peer)
            dist.send(inbound, peer)
            dist.recv(outbound, peer)
        else:
            dist.recv(shared, peer)
            dist.recv(outbound, peer)
            dist.send(inbound, peer)
        out[peer] = (float(shared[0]) / 2, float(outbound[0]))
    return out


def probe_sizes(message_bytes: float) -> tuple[int, int]:
    """The two probes' bytes: a boundary message's (within SMALLEST and a quarter of LARGEST), and four times it."""
    small = int(min(max(message_bytes, SMALLEST), LARGEST // 4))
    return small, 4 * small


def second_rate(nbytes: int, gap: float) -> float:
    """Bytes a second of a link from two messages sent back to back, the second of `nbytes`, landing `gap` seconds
    apart: what its bytes cost and nothing a message pays once (a round trip; tc's token bucket sends a 16 kB burst
    at line rate after an idle moment, which the first spends; a window opening): the rate the replicas' megabytes
    meet."""
    return nbytes / max(gap, 1e-6)


def measure(cfg: Any, world: Any, model_class: type, config: Any, message_bytes: float) -> tuple[Cluster, float]:
    """Every rank's table, the same on all (call on every rank at once); the seconds it took."""
    started = time.perf_counter()
    here = launch()
    block = 0.0
    turns = torch.tensor([here.local_world_size], device=world.transport)
    if world.size > 1:  # as many turns on every machine, the most ranks any holds (barriers must pair up)
        dist.all_reduce(turns, op=dist.ReduceOp.MAX)
    for turn in range(int(turns.item())):  # a machine's ranks in turn: they share its host (one host, all)
        if turn == here.local_rank:
            block = block_seconds(cfg, model_class, config, world.device, world.compute_slowdown)
        if world.size > 1:
            dist.barrier()
    memory = free_memory(world.device, here.local_world_size)
    links = link_row(world.rank, world.size, message_bytes, world.link_matrix, world.transport) \
        if world.size > 1 else {}
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
