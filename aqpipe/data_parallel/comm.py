"""Communication among one stage's replicas, with every byte sent counted.

Algorithms talk through this and nothing else, so `sent_bytes` is exactly what they
put on the wire: point-to-point payloads are counted as they are, an allreduce as the
bandwidth-optimal ring moves it (2 (R-1)/R of the tensor per rank, what gloo's ring
algorithm sends for large tensors). Ranks are positions in the group (0..size-1).

`quantized_mean` is the compressed collective: a reduce-scatter then an allgather of quantized
shards, so a replica sends 2 (R-1)/R of the tensor at `bits` bits whatever R is, where an
allgather of whole quantized tensors sends R-1 copies.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from aqpipe.compression import QuantizedTensor, dequantize, quantize
from aqpipe.compression.staging import HostStaging


class Comm:
    def __init__(self, group: object | None = None, ranks: list[int] | None = None,
                 transport: torch.device | str | None = None,
                 pace: Callable[[float, list[int], float, str], None] | None = None) -> None:
        """`group` and its global `ranks` in order; both None for a single replica (no process group). `transport`:
        the device the backend moves tensors from (cpu for gloo), where tensors computed elsewhere are staged; None:
        the backend takes them where they are. `pace`: emulated links' (a trainer's LinkMatrix.pace), which holds
        each exchange until (started, global ranks, bytes a member, "ring", "gather" or "peers") would have ended."""
        self.group, self.pace = group, pace
        self.staging = HostStaging(transport) if transport is not None else None
        self.ranks = ranks or [dist.get_rank() if dist.is_initialized() else 0]
        here = dist.get_rank() if dist.is_initialized() else self.ranks[0]
        if here not in self.ranks:
            raise ValueError(f"global rank {here} is not in the data-parallel group {self.ranks}")
        self.rank, self.size = self.ranks.index(here), len(self.ranks)
        self.sent_bytes = 0

    def take_bytes(self) -> int:
        """Bytes sent since the last call (the engine reads this once per step)."""
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def sendrecv(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Send sends[p] to each member p and fill receives[q] (buffers of the right size) from each q.

        Every send is posted before any receive is waited on, so any pattern that pairs each send
        with the peer's receive completes (a ring, a shift, all to all).
        """
        ops, started = [], time.monotonic()
        for p, tensor in sends.items():
            tensor = self._out(tensor.contiguous())
            ops.append(dist.P2POp(dist.isend, tensor, self.ranks[p], group=self.group))
            self.sent_bytes += self._nbytes(tensor)
        landed = {q: self._landing(buf) for q, buf in receives.items()}
        ops += [dist.P2POp(dist.irecv, buf, self.ranks[q], group=self.group) for q, buf in landed.items()]
        # one batch: NCCL then runs the sends and receives as one group, so a ring cannot deadlock on it
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        for q, buf in landed.items():
            if buf is not receives[q]:
                receives[q].copy_(buf)
        if self.pace is not None and (sends or receives):
            peers = sorted({self.ranks[p] for p in (*sends, *receives)})
            largest = max([self._nbytes(t) for t in (*sends.values(), *receives.values())])
            self.pace(started, [self.ranks[self.rank], *peers], largest, "peers")
        return receives

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return self.staging.outgoing(t) if self.staging is not None else t

    def _landing(self, like: torch.Tensor) -> torch.Tensor:
        """A receive buffer for `like` where the backend writes (`like` itself when that is its device)."""
        if self.staging is None or like.device == self.staging.transport:
            return like
        return self.staging.landing(like.numel(), like.dtype, like.device).view(like.shape)

    def exchange(self, tensor: torch.Tensor, peers: list[int]) -> list[torch.Tensor]:
        """Send `tensor` to each peer (group positions) and receive theirs; returns them in `peers` order.

        Receivers learn shapes from `tensor`: every participant exchanges tensors of one shape and dtype.
        """
        got = self.sendrecv({p: tensor for p in peers}, {p: torch.empty_like(tensor) for p in peers})
        return [got[p] for p in peers]

    def shards(self, numel: int, align: int = 1) -> list[tuple[int, int]]:
        """Member i's slice [start, end) of a flat tensor of `numel` elements: contiguous, as equal as
        `align` allows (every start a multiple of it, so quantization groups never straddle two shards)."""
        units = -(-numel // align)
        per, extra = divmod(units, self.size)
        bounds, start = [], 0
        for i in range(self.size):
            end = min(numel, start + (per + (i < extra)) * align)
            bounds.append((start, end))
            start = end
        return bounds

    def reduce_scatter_allgather(self, pieces: list[torch.Tensor], reduce: Callable[[list[torch.Tensor]], torch.Tensor],
                                 sizes: list[int]) -> list[torch.Tensor]:
        """The two phases of a sharded average, with payloads the caller encodes.

        pieces[i] (uint8) goes to member i, which owns shard i; every member's piece for shard i has
        sizes[i] bytes. reduce(received) turns the pieces of this member's shard (in group order,
        its own included) into its result (uint8); the results are exchanged and returned in group
        order, so every member holds every shard's result. Bytes sent: the pieces for the others,
        then the own result to each other member. Receive buffers live on the pieces' device.
        """
        me = self.rank
        others = [j for j in range(self.size) if j != me]
        like = pieces[me]
        empty = like.new_empty(0, dtype=torch.uint8)
        got = self.sendrecv({j: pieces[j] for j in others if sizes[j]},  # an empty shard: nothing to send
                            {j: like.new_empty(sizes[me], dtype=torch.uint8) for j in others if sizes[me]})
        mine = reduce([pieces[me] if j == me else got.get(j, empty) for j in range(self.size)])
        results = self.sendrecv({j: mine for j in others if sizes[me]},
                                {j: like.new_empty(sizes[j], dtype=torch.uint8) for j in others if sizes[j]})
        return [mine if j == me else results.get(j, empty) for j in range(self.size)]

    def quantized_mean(self, x: torch.Tensor, bits: int, *, group_size: int, generator: torch.Generator,
                       server_error: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean over the group of flat float32 `x`, with every byte on the wire quantized.

        Each member quantizes its tensor shard by shard and sends shard i to member i; member i
        decodes the R quantized shards, averages them in group order, adds `server_error` (its
        error feedback, updated in place, as long as its shard; None: none), quantizes the average
        and sends it to every member. Returns (mean, sent): the mean, bit-identical on every member
        (all decode the same bytes), and this member's x as the others decoded it (x - sent is the
        error a caller feeds back). Sends 2 (R-1)/R of x (on average over the members, as shards may
        differ by a group) at `bits` bits plus 8 bytes per group. Everything stays on x's device.
        """
        if self.size == 1:
            return x.clone(), x.clone()
        bounds = self.shards(x.numel(), group_size)
        numels = [e - s for s, e in bounds]
        sizes = [QuantizedTensor.wire_nbytes((n,), bits, group_size) for n in numels]
        # a tensor shorter than R groups leaves some shards empty: nothing is quantized or sent for them
        codes = [quantize(x[s:e], bits, group_size=group_size, generator=generator) if e > s else None
                 for s, e in bounds]
        payloads = [q.to_bytes() if q is not None else x.new_empty(0, dtype=torch.uint8) for q in codes]
        sent = torch.cat([dequantize(q) if q is not None else x.new_zeros(0) for q in codes])

        def decode(buf: torch.Tensor, n: int) -> torch.Tensor:
            if n == 0:
                return x.new_zeros(0)
            return dequantize(QuantizedTensor.from_bytes(buf, (n,), torch.float32, bits, group_size))

        def reduce(received: list[torch.Tensor]) -> torch.Tensor:
            n = numels[self.rank]
            if n == 0:
                return x.new_empty(0, dtype=torch.uint8)
            total = decode(received[0], n)
            for buf in received[1:]:
                total = total + decode(buf, n)
            mean = total / self.size
            if server_error is not None:
                mean = mean + server_error
            q = quantize(mean, bits, group_size=group_size, generator=generator)
            if server_error is not None:
                server_error.copy_(mean - dequantize(q))
            return q.to_bytes()

        results = self.reduce_scatter_allgather(payloads, reduce, sizes)
        return torch.cat([decode(buf, n) for buf, n in zip(results, numels)]), sent

    def allreduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place mean over the group (float); counted as a ring allreduce."""
        if self.size == 1:
            return tensor
        started = time.monotonic()
        if self.staging is not None:
            self.staging.all_reduce_(tensor, self.group)
        else:
            dist.all_reduce(tensor, group=self.group)
        if self.pace is not None:
            self.pace(started, sorted(self.ranks), self._nbytes(tensor), "ring")  # gloo's ring: by global rank
        tensor.div_(self.size)
        self.sent_bytes += 2 * (self.size - 1) * self._nbytes(tensor) // self.size
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor (same shape), in group order; counted as a ring allgather."""
        if self.size == 1:
            return [tensor]
        moved = self._out(tensor.contiguous())
        out = [torch.empty_like(moved) for _ in range(self.size)]
        started = time.monotonic()
        dist.all_gather(out, moved, group=self.group)
        if self.pace is not None:
            self.pace(started, sorted(self.ranks), self._nbytes(tensor), "gather")
        self.sent_bytes += (self.size - 1) * self._nbytes(tensor)
        by_rank = sorted(self.ranks)  # torch numbers a group's members by global rank: back to this group's order
        return [out[by_rank.index(r)].to(tensor.device) for r in self.ranks]
