"""Which torch.distributed backend a run uses, and which device each process computes on.

- `nccl`: one GPU per process on each machine (NCCL refuses two ranks on one GPU); tensors go GPU to GPU.
- `gloo`: any number of processes per machine. On GPUs every tensor a rank sends or receives is staged through
  pinned host memory (compression.staging), so 2-4 stages can share one GPU, and TCP is the robust choice over a
  WAN. Process `local_rank` computes on GPU `local_rank % GPUs` (all on cuda:0 with one GPU).
- `auto` (the default): nccl where every process on this machine has a GPU of its own, else gloo. It decides per
  machine: machines with different GPU counts name the backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .environment import launch

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    backend: str  # gloo or nccl
    device: torch.device  # where this process's stage computes
    transport: torch.device  # where the backend moves tensors from: cpu for gloo, the GPU for NCCL


def place(backend: str, local_rank: int, local_world_size: int, gpus: int) -> Placement:
    """The placement of process `local_rank` of `local_world_size` on a machine with `gpus` GPUs; ValueError in one
    line when `backend` cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "nccl" and gpus == 0:
        raise ValueError("backend=nccl: no CUDA GPU on this machine; expected gloo (or auto) on CPUs")
    if backend == "nccl" and local_world_size > gpus:
        raise ValueError(f"backend=nccl with {local_world_size} processes on this machine but {gpus} GPU(s): NCCL "
                         "takes one GPU per process; start fewer processes per machine, or use --backend gloo "
                         "(stages share a GPU, tensors staged through host memory)")
    if backend == "auto":
        backend = "nccl" if gpus and local_world_size <= gpus else "gloo"
    device = torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu")
    transport = device if backend == "nccl" else torch.device("cpu")
    return Placement(backend, device, transport)


def place_here(backend: str) -> Placement:
    """This process's placement, from its launcher's variables and this machine's GPUs."""
    here = launch()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return place(backend, here.local_rank, here.local_world_size, gpus)
