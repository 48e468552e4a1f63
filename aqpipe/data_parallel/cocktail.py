"""CocktailSGD (Wang et al., ICML 2023): model changes sent random-sparsified, top-k'd and quantized.

Every replica steps its own optimizer on its own gradients; after each step the replicas share
what their models learned, compressed three ways. θ is the model they agree on (bit-identical
everywhere), x_r replica r's own. The flattened parameters are cut into R shards, shard i owned
by replica i. In `after_step`, for each shard i:

    d_r   = x_r - θ                     on S_i: what r learned and has not shared yet
    S_i   = a random 1/c of shard i, c = ceil(1/random_ratio) (random_ratio itself when 1/random_ratio
            is whole), the same on every replica: drawn from the run's seed as a fresh permutation of
            the shard every c steps, dealt out in c slices, so every entry comes up once per cycle;
            no index crosses the wire for it
    c_r,i = Q(top-k of d_r on S_i)      k = topk_ratio x the shard's length, sent as a bitmap over
                                        S_i and k values quantized to `bits` bits; r -> owner i
    x_r  -= deQ(c_r,i)                  what r sent leaves its memory (error feedback on the worker:
                                        x_r - θ keeps exactly what was not sent)
    a_i   = mean_r deQ(c_r,i) + e_i     the owner averages in group order and adds its own error
    u_i   = Q(top-k of a_i on S_i);  e_i <- a_i - deQ(u_i)   (error feedback on the owner)
    x_r  += deQ(u_i);  θ += deQ(u_i)    on every replica, from the same bytes: owner i -> everyone

A replica sends its pieces of the other shards, then its shard's average to every other one:
2 (R-1)/R of a message over the whole model (on average: shards differ by at most an element),
where a message costs, per parameter, random_ratio/8 bytes for the bitmap plus topk_ratio x
(bits/8 + 8/group_size) for the values: at the defaults (10% random, 1% kept, 8 bits, groups of
128) 0.023 bytes per parameter, about 170x fewer than a float32 ring allreduce at any R.
Everything runs on the parameters' device; only the bitmaps are packed on the CPU.

With one replica nothing is sent and the model is the optimizer's (θ would follow x).
Replicas must start identical, as with every algorithm here that averages changes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from aqpipe.compression import QuantizedTensor, derive_seed, dequantize, quantize
from aqpipe.compression.kernels import pack_codes, unpack_codes
from aqpipe.compression.fields import check_int

from .base import Algorithm, register
from .comm import Comm
from .flat import assign, flatten, worker_seed

DEFAULT_GROUP_SIZE = 128  # values per quantization group: 8 bytes of min and step per 128 kept values


def _ratio(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"cocktail_sgd: {name}={value!r}: expected a fraction in (0, 1]")
    return float(value)


def _count(fraction: float, n: int) -> int:
    """ceil(fraction * n), at least 1 (rounded first: 0.1 * 420 is 42.000000000000004)."""
    return max(1, math.ceil(round(fraction * n, 6))) if n else 0


@register
class CocktailSGD(Algorithm):
    """Options: random_ratio (fraction of each shard considered a step, default 0.1), topk_ratio
    (fraction of each shard sent a step, at most random_ratio, default 0.01), bits (1..8, default 8),
    seed (int >= 0: the shared random subsets and this replica's dither), group_size (default 128)."""

    name = "cocktail_sgd"
    OPTIONS = ("random_ratio", "topk_ratio", "bits", "seed")

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, *, random_ratio: float = 0.1,
                 topk_ratio: float = 0.01, bits: int = 8, seed: int = 0, group_size: int = DEFAULT_GROUP_SIZE,
                 **options: Any) -> None:
        super().__init__(params, comm, **options)
        self.random_ratio, self.topk_ratio = _ratio("random_ratio", random_ratio), _ratio("topk_ratio", topk_ratio)
        if self.topk_ratio > self.random_ratio:
            raise ValueError(f"cocktail_sgd: topk_ratio={topk_ratio!r}: expected at most random_ratio="
                             f"{random_ratio!r} (the top entries are chosen from the random ones)")
        self.bits = check_int(f"{self.name}: bits", bits, 1, 8)
        self.seed = check_int(f"{self.name}: seed", seed, 0, 2**63 - 1)
        self.group_size = check_int(f"{self.name}: group_size", group_size, 1)
        self.numel = sum(p.numel() for p in self.params)
        self.bounds = comm.shards(self.numel) if comm.size > 1 else [(0, self.numel)]
        self.cycle = math.ceil(round(1 / self.random_ratio, 6))  # steps until every entry came up once
        self.k = [_count(self.topk_ratio, e - s) for s, e in self.bounds]
        self.generator = torch.Generator().manual_seed(worker_seed(seed, comm.rank))
        s, e = self.bounds[comm.rank]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.owner_error = torch.zeros(e - s, device=self.device)  # e_i of this replica's shard
        self.anchor: torch.Tensor | None = None  # θ (float32, flat)
        self._perms: tuple[int, list[torch.Tensor]] | None = None  # (cycle index, a permutation per shard)

    @property
    def active(self) -> bool:
        return self.comm.size > 1 and self.numel > 0

    # ------------------------------------------------------------------ the random subsets
    def subset(self, shard: int, step: int) -> torch.Tensor:
        """Positions within `shard` considered at `step` (sorted): slice step % cycle of the cycle's permutation."""
        index, slot = divmod(step, self.cycle)
        if self._perms is None or self._perms[0] != index:
            perms = []
            for i, (s, e) in enumerate(self.bounds):  # from the seed alone: the same on every replica
                g = torch.Generator().manual_seed(derive_seed(self.seed, "cocktail", "cycle", index, "shard", i))
                # drawn and kept on the CPU (the same permutation on every device; 8 bytes a parameter, which a GPU
                # shared by several stages should not hold): a step moves only its slice
                perms.append(torch.randperm(e - s, generator=g))
            self._perms = (index, perms)
        perm = self._perms[1][shard]
        n = perm.numel()
        return perm[slot * n // self.cycle:(slot + 1) * n // self.cycle].sort().values

    def message_nbytes(self, shard: int, subset_size: int) -> int:
        """A message for `shard`: the bitmap over its subset, then the k quantized values."""
        k = min(self.k[shard], subset_size)
        return -(-subset_size // 8) + (QuantizedTensor.wire_nbytes((k,), self.bits, self.group_size) if k else 0)

    # ------------------------------------------------------------------ one message
    def encode(self, values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of `values` (one shard's subset), quantized: (the message, the dense values it stands for)."""
        if values.numel() == 0:
            return values.new_empty(0, dtype=torch.uint8), values.clone()
        k = min(k, values.numel())
        keep = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
        keep[torch.topk(values.abs(), k, sorted=False).indices] = True
        q = quantize(values[keep], self.bits, group_size=self.group_size, generator=self.generator)
        bitmap = pack_codes(keep.to(torch.uint8), 1)  # on the values' device: no trip to the host
        dense = torch.zeros_like(values)
        dense[keep] = dequantize(q)
        return torch.cat([bitmap, q.to_bytes()]), dense

    def decode(self, message: torch.Tensor, subset_size: int, k: int) -> torch.Tensor:
        """The dense values over a subset of `subset_size` entries that `message` stands for."""
        if subset_size == 0:
            return message.new_zeros(0, dtype=torch.float32)
        cut = -(-subset_size // 8)
        keep = unpack_codes(message[:cut], 1, subset_size).bool()
        k = min(k, subset_size)
        dense = message.new_zeros(subset_size, dtype=torch.float32)
        dense[keep] = dequantize(QuantizedTensor.from_bytes(message[cut:], (k,), torch.float32, self.bits,
                                                            self.group_size))
        return dense

    # ------------------------------------------------------------------ hooks
    def after_backward(self) -> None:
        if self.anchor is None:
            self.anchor = flatten(self.params, torch.float32)

    def after_step(self) -> None:
        if self.anchor is None:
            raise RuntimeError(f"{self.name}: after_backward() must run before the first optimizer step")
        if self.active:
            self.synchronize(self.step_count)
        super().after_step()

    def synchronize(self, step: int) -> None:
        """One CocktailSGD exchange (see the module doc)."""
        x = flatten(self.params, torch.float32)
        subsets = [self.subset(i, step).to(x.device) for i in range(self.comm.size)]
        positions = [s + sub for (s, _), sub in zip(self.bounds, subsets)]  # into the flat vector
        pieces = []
        for i, pos in enumerate(positions):
            message, sent = self.encode(x[pos] - self.anchor[pos], self.k[i])
            x[pos] -= sent
            pieces.append(message)
        me = self.comm.rank
        sizes = [self.message_nbytes(i, sub.numel()) for i, sub in enumerate(subsets)]
        local = subsets[me]

        def reduce(received: list[torch.Tensor]) -> torch.Tensor:
            total = self.decode(received[0], local.numel(), self.k[me])
            for message in received[1:]:
                total = total + self.decode(message, local.numel(), self.k[me])
            average = total / self.comm.size + self.owner_error[local]
            message, sent = self.encode(average, self.k[me])
            self.owner_error[local] = average - sent
            return message

        results = self.comm.reduce_scatter_allgather(pieces, reduce, sizes)
        for i, (pos, message) in enumerate(zip(positions, results)):
            update = self.decode(message, pos.numel(), self.k[i])
            x[pos] += update
            self.anchor[pos] += update
        assign(self.params, x)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "anchor": None if self.anchor is None else self.anchor.clone(),
                "owner_error": self.owner_error.clone(), "generator": self.generator.get_state(),
                "random_ratio": self.random_ratio, "topk_ratio": self.topk_ratio, "bits": self.bits,
                "seed": self.seed, "group_size": self.group_size, "rank": self.comm.rank, "size": self.comm.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {"random_ratio": self.random_ratio, "topk_ratio": self.topk_ratio, "bits": self.bits,
                "size": self.comm.size}  # not the seed: state, taken as saved (the cycles continue its draws)
        later = {"group_size": self.group_size, "rank": self.comm.rank}  # saved since; older checkpoints lack them
        missing = [key for key in (*mine, "seed", "anchor", "owner_error", "generator", "step_count")
                   if key not in state]
        if missing:
            raise ValueError(f"{self.name}: checkpoint lacks {', '.join(missing)}: it was not saved by {self.name}")
        for key, value in {**mine, **later}.items():
            if state.get(key, value) != value:
                raise ValueError(f"{self.name}: checkpoint has {key}={state[key]!r}, this run has {value!r}")
        if state["owner_error"].numel() != self.owner_error.numel():
            raise ValueError(f"{self.name}: checkpoint's shard has {state['owner_error'].numel()} elements, "
                             f"this replica's {self.owner_error.numel()}")
        if state["anchor"] is not None and state["anchor"].numel() != self.numel:
            raise ValueError(f"{self.name}: checkpoint's model has {state['anchor'].numel()} parameters, "
                             f"this one {self.numel}")
        super().load_state_dict(state)
        self.anchor = None if state["anchor"] is None else state["anchor"].to(self.device).clone()
        self.owner_error = state["owner_error"].to(self.device).clone()
        self.generator.set_state(state["generator"])
        self.seed = int(state["seed"])
