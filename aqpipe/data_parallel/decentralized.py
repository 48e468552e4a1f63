"""Decentralized data parallelism: replicas average their models with a few peers, never globally.

`decentralized` (seed 001): each step, once the local gradients are ready, a worker averages its
model with one peer, x <- (x + x_peer) / 2, and the optimizer then applies its local gradient to
the averaged model. Peer selection `shift_one` splits the R workers into halves [0, R/2) and
[R/2, R) and pairs worker i of the first half with R/2 + (i + s) mod R/2 of the second, where the
shift s = (communication round) mod R/2 changes every round: a worker meets a different peer each
round (for R >= 4) and everyone is paired. It needs an even R. `all` averages with everyone (the
global mean, one allreduce). `interval` communicates every `interval` steps only.

`low_precision_decentralized` (seeds 000, 001; "difference compression"): a fixed ring. Worker i
keeps replicas x̂ of itself and of the neighbours it listens to (all start as the common initial
model). Each step

    after_backward:  save x_t; set the parameters to sum_j W_ij x̂_j
    optimizer.step:  the local gradient step gives x_{t+1/2}
    after_step:      z = x_{t+1/2} - x_t; q = Q(z); x_{t+1} = x_t + deQ(q); x̂_i += deQ(q);
                     send q to the workers that listen to i, receive theirs, x̂_j += deQ(q_j).

`topology` picks W. `ring` is the seed's: i listens to i-1 and i+1, weights 1/3 each, and sends q
to both: 2 x q.nbytes per worker and step. `directed_ring` (the default): i listens to i-1 only,
weights 1/2, and sends q to i+1 only: one q.nbytes per worker and step at any R, a quarter of what
`decentralized` sends at 8 bits. W = (I + P)/2 (P the cyclic shift) is doubly stochastic, so the
replicas' mean moves only by their gradient steps, as with the ring, and its second singular
value cos(pi/R) < 1 makes them agree; it mixes more slowly than the ring's (1/3 at R = 4, 0.71
here), which the data-parallel table in RESULTS.md measures in loss. Only the quantized change
crosses the wire. Every holder of x̂_j applies the same deQ(q_j) to the same starting tensor in the
same dtype, so the replicas of a worker's model stay bit-identical (and x̂_i equals x_t on worker i).

With R == 2 both topologies are one edge: weights 1/2 self, 1/2 neighbour, and q sent once per
step (the ring would otherwise count the one neighbour twice and send it the same message twice).

Q is `compression.quantize` (per-group min-max, unbiased stochastic rounding) on the flattened
parameter vector with `group_size` consecutive elements per group (default 2048). The default
of the quantizer, one group per row of the last dimension, would make the whole flat vector one
group: the largest change anywhere (often a bias or a norm gain) would set the step for millions
of small weight changes, burying them in rounding noise. 2048-element groups keep each range
local (and mostly within one parameter tensor) while the float32 min and step per group cost
8 bytes per 2048 elements: 0.4% on top of the 8-bit codes, 3% at 1 bit.

Each worker's dither comes from its own torch.Generator, seeded from (`seed`, rank) so workers
draw independent rounding noise; its state is part of state_dict, as are the replicas.
"""
from __future__ import annotations

from typing import Any

import torch

from aqpipe.compression import QuantizedTensor, check_bits, dequantize, quantize
from aqpipe.compression.fields import check_int

from .base import Algorithm, register
from .comm import Comm
from .flat import assign, flat_dtype, flatten, worker_seed

PEER_SELECTIONS = ("shift_one", "all")
TOPOLOGIES = ("directed_ring", "ring")
DEFAULT_GROUP_SIZE = 2048


def shift_one_peer(rank: int, size: int, comm_round: int) -> int:
    """The peer of `rank` in communication round `comm_round` under `shift_one` (size must be even).

    Worker i < h = size/2 meets h + (i + s) mod h, and worker j >= h meets (j - h - s) mod h,
    with s = comm_round mod h: a perfect matching between the halves, different each round.
    """
    h = size // 2
    s = comm_round % h
    return h + (rank + s) % h if rank < h else (rank - h - s) % h


@register
class DecentralizedSGD(Algorithm):
    """x <- (x + x_peer) / 2 before the local optimizer step; peers by `shift_one` or `all`."""

    name = "decentralized"
    OPTIONS = ("peer_selection", "interval")

    def __init__(
        self, params: list[torch.nn.Parameter], comm: Comm, *, peer_selection: str = "shift_one",
        interval: int = 1, **options: Any,
    ) -> None:
        if peer_selection not in PEER_SELECTIONS:
            raise ValueError(
                f"{self.name}: peer_selection={peer_selection!r}: expected one of {', '.join(PEER_SELECTIONS)}"
            )
        check_int(f"{self.name}: interval", interval, 1)
        if peer_selection == "shift_one" and comm.size > 1 and comm.size % 2:
            raise ValueError(
                f"{self.name}: peer_selection='shift_one' pairs the two halves of the replicas and needs an "
                f"even replica count, got {comm.size} replicas; use peer_selection='all' or an even count"
            )
        super().__init__(params, comm, **options)
        self.peer_selection = peer_selection
        self.interval = interval
        self.dtype = flat_dtype(self.params)
        self.last_peer: int | None = None  # the peer of the latest shift_one exchange (diagnostics, tests)

    def communicates(self, step: int) -> bool:
        """Whether step `step` (0-based) averages models."""
        return self.comm.size > 1 and bool(self.params) and step % self.interval == 0

    def peer(self, step: int) -> int:
        """This worker's shift_one peer at step `step` (a communicating step)."""
        return shift_one_peer(self.comm.rank, self.comm.size, step // self.interval)

    def after_backward(self) -> None:
        if not self.communicates(self.step_count):
            return
        x = flatten(self.params, self.dtype)
        if self.peer_selection == "all":
            self.comm.allreduce_mean_(x)
        else:
            self.last_peer = self.peer(self.step_count)
            (x_peer,) = self.comm.exchange(x, [self.last_peer])
            x = (x + x_peer) / 2  # a + b == b + a in floating point: both partners get the same model
        assign(self.params, x)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(), "peer_selection": self.peer_selection, "interval": self.interval,
            "size": self.comm.size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine_all = {"peer_selection": self.peer_selection, "interval": self.interval, "size": self.comm.size}
        for key, mine in mine_all.items():
            if key in state and state[key] != mine:
                raise ValueError(f"{self.name}: checkpoint has {key}={state[key]!r}, this run has {mine!r}")
        super().load_state_dict(state)


@register
class LowPrecisionDecentralizedSGD(Algorithm):
    """Ring-decentralized SGD that sends only Q(x_{t+1/2} - x_t) to the workers averaging it (see the module doc)."""

    name = "low_precision_decentralized"
    OPTIONS = ("bits", "seed", "topology")

    def __init__(
        self, params: list[torch.nn.Parameter], comm: Comm, *, bits: int = 8, seed: int = 0,
        group_size: int = DEFAULT_GROUP_SIZE, topology: str = "directed_ring", **options: Any,
    ) -> None:
        try:
            check_bits(bits)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        check_int(f"{self.name}: seed", seed, 0, (1 << 64) - 1)
        check_int(f"{self.name}: group_size", group_size, 1)
        if topology not in TOPOLOGIES:
            raise ValueError(f"{self.name}: topology={topology!r}: expected one of {', '.join(TOPOLOGIES)}")
        super().__init__(params, comm, **options)
        self.bits, self.seed, self.group_size, self.topology = bits, seed, group_size, topology
        self.dtype = flat_dtype(self.params)
        r, n = comm.rank, comm.size
        # Fixed for the whole run: whose models this worker averages (sources) and who averages its own (targets).
        if n == 1:
            self.sources: list[int] = []
            self.targets: list[int] = []
        elif n == 2 or topology == "directed_ring":
            self.sources, self.targets = [(r - 1) % n], [(r + 1) % n]
        else:
            self.sources = self.targets = [(r - 1) % n, (r + 1) % n]
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(worker_seed(seed, r))
        x0 = flatten(self.params, self.dtype)
        self.replicas: dict[int, torch.Tensor] = (
            {j: x0.clone() for j in [r, *self.sources]} if self.active else {}
        )
        self._x_t: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.comm.size > 1 and bool(self.params)

    def weighted_average(self) -> torch.Tensor:
        """sum_j W_ij x̂_j over self and the sources, uniform weights 1/(1 + #sources)."""
        members = [self.comm.rank, *self.sources]
        total = self.replicas[members[0]].clone()
        for j in members[1:]:
            total += self.replicas[j]
        return total / len(members)

    def after_backward(self) -> None:
        if not self.active:
            return
        self._x_t = flatten(self.params, self.dtype)
        assign(self.params, self.weighted_average())

    def after_step(self) -> None:
        if self.active:
            if self._x_t is None:
                raise RuntimeError(f"{self.name}: after_step without after_backward in the same step")
            x_t, self._x_t = self._x_t, None
            z = flatten(self.params, self.dtype) - x_t
            q = quantize(z, self.bits, group_size=self.group_size, generator=self.generator)
            dz = dequantize(q)
            assign(self.params, x_t + dz)
            self.replicas[self.comm.rank] += dz
            payload = q.to_bytes()
            received = self.comm.sendrecv({j: payload for j in self.targets},
                                          {j: torch.empty_like(payload) for j in self.sources})
            for j in self.sources:
                qj = QuantizedTensor.from_bytes(received[j], z.shape, self.dtype, self.bits, self.group_size)
                self.replicas[j] += dequantize(qj)
        super().after_step()

    def restart(self, step_count: int) -> None:
        """Every replica's copy taken as this one's weights now: a reshaped resume averaged the replicas into one
        (aqpipe/reshape.py), so each neighbour holds the same."""
        super().restart(step_count)
        x = flatten(self.params, self.dtype)
        self.replicas = {j: x.clone() for j in self.replicas}
        self._x_t = None

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(), "bits": self.bits, "group_size": self.group_size, "seed": self.seed,
            "topology": self.topology, "rank": self.comm.rank, "size": self.comm.size,
            "generator": self.generator.get_state(),
            "replicas": {j: x.clone() for j, x in self.replicas.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (
            ("bits", self.bits), ("group_size", self.group_size), ("topology", self.topology), ("rank", self.comm.rank),
            ("size", self.comm.size),
        ):
            saved = state.get(key, "ring" if key == "topology" else mine)  # before topologies: both neighbours
            if key == "topology" and self.comm.size <= 2:
                continue  # with two replicas both topologies are the one neighbour
            if saved != mine:
                raise ValueError(f"{self.name}: checkpoint has {key}={saved!r}, this run has {mine!r}")
        replicas = state.get("replicas", {})
        if set(replicas) != set(self.replicas):
            raise ValueError(
                f"{self.name}: checkpoint holds replicas of workers {sorted(replicas)}, "
                f"expected {sorted(self.replicas)}"
            )
        for j, x in replicas.items():
            if x.shape != self.replicas[j].shape:
                raise ValueError(
                    f"{self.name}: checkpoint replica of worker {j} has {x.numel()} elements, the model has "
                    f"{self.replicas[j].numel()}"
                )
            self.replicas[j] = x.to(device=self.replicas[j].device, dtype=self.dtype).clone()  # checkpoints load on CPU
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])
        self.seed = state.get("seed", self.seed)
        self._x_t = None
