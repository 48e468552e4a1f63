"""Qsparse-local-SGD (Basu et al., NeurIPS 2019): local steps, then a sparsified, quantized, error-fed average.

Every replica r runs the given optimizer locally for H = `local_steps` steps, without a byte on
the wire. After every H-th optimizer step (in `after_step`) the replicas synchronize, with the
parameters flattened into one vector (the order of `params`):

    Δ_r = m_r + θ - θ̂_r                 the drift since the last sync (θ: the model at the last
                                         sync, θ̂_r: this replica's model now) plus the memory
    c_r = Q_s(Comp_k(Δ_r))               Comp_k: compression.topk (or randk) with
                                         k = ceil(topk_ratio * numel); Q_s: SparseTensor.quantize(bits)
                                         (skipped when bits is None)
    m_r <- Δ_r - c_r                     error feedback: what was not sent is sent later
    θ <- θ - (1/R) Σ_r c_r               on every replica; then θ̂_r <- θ

The sign follows the paper: Δ is θ - θ̂ (what the local steps subtracted), and the new model
subtracts the average of what arrived. Each replica sends c_r once, through an allgather of its
bytes: k indices (4 bytes each, 8 beyond 2^32 elements, little-endian whatever the machine) then
the values (QuantizedTensor.to_bytes(), or float32 when bits is None), exactly SparseTensor.nbytes.
Every replica decodes the R messages in group order and sums them in that order, so θ is
bit-identical everywhere. With R = 1 the same compression applies (the paper's algorithm on one
worker); nothing is sent.

θ is taken from the parameters at the first after_backward (just before the first optimizer
step), or restored by load_state_dict, so weights loaded after construction are respected.
Replicas must start identical (as with every algorithm here that averages changes, not models).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from aqpipe.compression import QuantizedTensor, SparseTensor, randk, topk
from aqpipe.compression.fields import check_int

from .base import Algorithm, register
from .comm import Comm
from .flat import assign, flatten, worker_seed

SPARSIFIERS = ("topk", "randk")


def encode_indices(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian `width`-byte unsigned integers as uint8, independent of the machine's byte order."""
    idx = indices.to(torch.int64)
    return torch.stack([(idx >> (8 * b)) & 0xFF for b in range(width)], dim=1).to(torch.uint8).reshape(-1)


def decode_indices(buf: torch.Tensor, width: int) -> torch.Tensor:
    cols = buf.to(torch.int64).view(-1, width)
    out = torch.zeros(cols.shape[0], dtype=torch.int64, device=buf.device)
    for b in range(width):
        out |= cols[:, b] << (8 * b)
    return out


@register
class QsparseLocalSGD(Algorithm):
    """Options: local_steps (H, int >= 1, default 4), topk_ratio (float in (0, 1], default 0.01),
    sparsifier ("topk" or "randk"), bits (1..8, default 8; None: no quantization), seed (int >= 0)."""

    name = "qsparse_local_sgd"
    OPTIONS = ("local_steps", "topk_ratio", "bits", "seed")

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, *, local_steps: int = 4,
                 topk_ratio: float = 0.01, sparsifier: str = "topk", bits: int | None = 8, seed: int = 0,
                 **options: Any) -> None:
        super().__init__(params, comm, **options)
        check_int(f"{self.name}: local_steps", local_steps, 1)
        if (isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float))
                or not 0 < topk_ratio <= 1):
            raise ValueError(f"{self.name}: topk_ratio={topk_ratio!r}: expected a number in (0, 1]")
        if sparsifier not in SPARSIFIERS:
            raise ValueError(f"{self.name}: sparsifier={sparsifier!r}: expected one of {', '.join(SPARSIFIERS)}")
        if bits is not None:
            check_int(f"{self.name}: bits", bits, 1, 8, what="an integer from 1 to 8, or None (no quantization)")
        check_int(f"{self.name}: seed", seed, 0, 2**63 - 1, what="an integer from 0 to 2**63 - 1")
        self.local_steps, self.topk_ratio, self.sparsifier, self.bits, self.seed = (
            local_steps, float(topk_ratio), sparsifier, bits, seed)
        self.numel = sum(p.numel() for p in self.params)
        # rounded first: 0.1 * 420 is 42.000000000000004 in floating point, and its ceiling 43
        self.k = min(self.numel, max(1, math.ceil(round(self.topk_ratio * self.numel, 6)))) if self.numel else 0
        self.generator = torch.Generator().manual_seed(worker_seed(seed, comm.rank))
        self.anchor: torch.Tensor | None = None  # θ, the model at the last sync (float32, flat)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.memory = torch.zeros(self.numel, dtype=torch.float32, device=self.device)  # m_r
        self.syncs = 0

    # ------------------------------------------------------------------ helpers
    def _flat(self) -> torch.Tensor:
        return flatten(self.params, torch.float32)

    @property
    def index_width(self) -> int:
        return 4 if self.numel <= 1 << 32 else 8

    def message_nbytes(self) -> int:
        """Bytes of one replica's message: k indices and the k values (quantized or float32)."""
        values = self.k * 4 if self.bits is None else QuantizedTensor.wire_nbytes((self.k,), self.bits)
        return self.k * self.index_width + values

    def compress(self, delta: torch.Tensor) -> SparseTensor:
        """c = Q_s(Comp_k(delta)) (the sparse tensor, values quantized unless bits is None)."""
        if self.sparsifier == "topk":
            sparse = topk(delta, self.k)
        else:
            sparse = randk(delta, self.k, generator=self.generator)
        if self.bits is not None:
            sparse = sparse.quantize(self.bits, generator=self.generator)
        return sparse

    def encode(self, sparse: SparseTensor) -> torch.Tensor:
        values = sparse.values
        value_bytes = (values.to_bytes() if isinstance(values, QuantizedTensor)
                       else values.to(torch.float32).view(torch.uint8))
        payload = torch.cat([encode_indices(sparse.indices, self.index_width), value_bytes.reshape(-1)])
        assert payload.numel() == sparse.nbytes == self.message_nbytes(), (payload.numel(), sparse.nbytes)
        return payload

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The dense float32 vector a message stands for."""
        cut = self.k * self.index_width
        indices = decode_indices(payload[:cut], self.index_width)
        if self.bits is None:
            values: torch.Tensor | QuantizedTensor = payload[cut:].clone().view(torch.float32)
        else:
            values = QuantizedTensor.from_bytes(payload[cut:], (self.k,), torch.float32, self.bits)
        return SparseTensor(indices, values, torch.Size([self.numel]), torch.float32).to_dense()

    # ------------------------------------------------------------------ hooks
    def after_backward(self) -> None:
        if self.anchor is None:
            self.anchor = self._flat()

    def after_step(self) -> None:
        super().after_step()
        if self.anchor is None:
            raise RuntimeError(f"{self.name}: after_backward() must run before the first optimizer step")
        if self.step_count % self.local_steps == 0:
            self.synchronize()

    def synchronize(self) -> None:
        """One Qsparse round: compress drift + memory, keep the residual, average, reset every replica to θ."""
        if self.numel == 0:
            return
        delta = self.memory + (self.anchor - self._flat())
        payload = self.encode(self.compress(delta))
        gathered = self.comm.allgather(payload)
        total = None
        for buf in gathered:  # group order: the same sum on every replica
            part = self.decode(buf)
            total = part if total is None else total + part
        self.memory = delta - self.decode(gathered[self.comm.rank])
        assign(self.params, self.anchor - total / len(gathered))
        self.anchor = self._flat()
        self.syncs += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(anchor=None if self.anchor is None else self.anchor.clone(), memory=self.memory.clone(),
                     generator=self.generator.get_state(), syncs=self.syncs)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        memory = state["memory"]
        if memory.numel() != self.numel:
            raise ValueError(f"{self.name}: the checkpoint's memory has {memory.numel()} elements, "
                             f"the parameters {self.numel}")
        super().load_state_dict(state)
        self.anchor = None if state["anchor"] is None else state["anchor"].to(self.device, torch.float32).clone()
        self.memory = memory.to(self.device, torch.float32).clone()
        self.generator.set_state(state["generator"])
        self.syncs = int(state["syncs"])
