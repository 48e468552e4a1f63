"""Communication among one stage's replicas, with every byte sent counted.

Algorithms talk through this and nothing else, so `sent_bytes` is exactly what they
put on the wire: point-to-point payloads are counted as they are, an allreduce as the
bandwidth-optimal ring moves it (2 (R-1)/R of the tensor per rank, what gloo's ring
algorithm sends for large tensors). Ranks are positions in the group (0..size-1).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, group: object | None = None, ranks: list[int] | None = None) -> None:
        """`group` and its global `ranks` in order; both None for a single replica (no process group)."""
        self.group = group
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

    def exchange(self, tensor: torch.Tensor, peers: list[int]) -> list[torch.Tensor]:
        """Send `tensor` to each peer (group positions) and receive theirs; returns them in `peers` order.

        Receivers learn shapes from `tensor`: every participant exchanges tensors of one shape and dtype.
        """
        tensor = tensor.contiguous()
        works = []
        for p in peers:
            works.append(dist.isend(tensor, self.ranks[p], group=self.group))
            self.sent_bytes += self._nbytes(tensor)
        received = []
        for p in peers:
            buf = torch.empty_like(tensor)
            dist.recv(buf, self.ranks[p], group=self.group)
            received.append(buf)
        for w in works:
            w.wait()
        return received

    def allreduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place mean over the group (float); counted as a ring allreduce."""
        if self.size == 1:
            return tensor
        dist.all_reduce(tensor, group=self.group)
        tensor.div_(self.size)
        self.sent_bytes += 2 * (self.size - 1) * self._nbytes(tensor) // self.size
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor (same shape), in group order; counted as a ring allgather."""
        if self.size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        self.sent_bytes += (self.size - 1) * self._nbytes(tensor)
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place from group position `src`; counted as sent once to each other member by src."""
        if self.size > 1:
            dist.broadcast(tensor, self.ranks[src], group=self.group)
            if self.rank == src:
                self.sent_bytes += (self.size - 1) * self._nbytes(tensor)
        return tensor
