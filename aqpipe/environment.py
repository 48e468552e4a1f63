"""What the trainer reads from the environment, each in one place: the launcher's variables (rank, world size,
processes on this machine), the quantizer's kernels, and emulated links and devices (for the benchmarks)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Launch:
    """What a launcher (torchrun, deepspeed, mpirun-style LOCAL_SIZE) says about this process; one process alone
    without one."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def launch(environ: dict[str, str] | None = None) -> Launch:
    env = os.environ if environ is None else environ
    return Launch(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
                  int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1))


def configure_kernels(environ: dict[str, str] | None = None) -> None:
    """The quantizer's kernels as the environment asks: AQPIPE_KERNELS (auto, native, triton or torch), AQPIPE_CACHE
    (where the compiled ones are kept) and CC (the C compiler)."""
    import torch

    from aqpipe.compression import kernels  # deferred: the launch settings are read before torch loads

    env = os.environ if environ is None else environ
    choice = env.get("AQPIPE_KERNELS", "auto")
    interpret = triton_interprets(env)
    kernels.configure(choice, env.get("AQPIPE_CACHE"), env.get("CC", "cc"), interpret=interpret)
    if choice == "triton" and not torch.cuda.is_available() and not interpret:
        raise ValueError("AQPIPE_KERNELS=triton: Triton's kernels need a CUDA GPU (or TRITON_INTERPRET=1, its CPU "
                         "interpreter, for tests); this machine has none")


def triton_interprets(environ: dict[str, str] | None = None) -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (TRITON_INTERPRET, as Triton reads it)."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")


def check_liger(device: Any, environ: dict[str, str] | None = None) -> None:
    """--use_liger_kernel's kernels are Triton's: a ValueError in one line where `device` cannot run them."""
    if getattr(device, "type", device) != "cuda" and not triton_interprets(environ):
        raise ValueError(f"--use_liger_kernel on {device}: Liger Kernel's kernels need a CUDA GPU (or "
                         "TRITON_INTERPRET=1, Triton's CPU interpreter, for tests)")


def _number(raw: str) -> float:
    """`raw` as a number; NaN where it is none, so that every range check refuses it."""
    try:
        return float(raw)
    except ValueError:
        return float("nan")


def link_latency_s(environ: dict[str, str] | None = None) -> float:
    """The emulated one-way link delay AQPIPE_LINK_LATENCY_MS asks for, in seconds (0: none)."""
    raw = (os.environ if environ is None else environ).get("AQPIPE_LINK_LATENCY_MS", "0")
    ms = _number(raw)
    if not ms >= 0:
        raise ValueError(f"AQPIPE_LINK_LATENCY_MS={raw!r}: expected a number of milliseconds >= 0")
    return ms / 1000.0


def link_mbit(environ: dict[str, str] | None = None) -> float | None:
    """The emulated link rate AQPIPE_LINK_MBIT asks for, in Mbit/s (None: unset, the link as it is)."""
    raw = (os.environ if environ is None else environ).get("AQPIPE_LINK_MBIT", "")
    if not raw:
        return None
    rate = _number(raw)
    if not 0 < rate < float("inf"):
        raise ValueError(f"AQPIPE_LINK_MBIT={raw!r}: expected a rate in Mbit/s > 0")
    return rate


def link_matrix(environ: dict[str, str] | None = None) -> str | None:
    """AQPIPE_LINK_MATRIX: a cluster file whose links the transport emulates between every pair of ranks (None:
    unset)."""
    return (os.environ if environ is None else environ).get("AQPIPE_LINK_MATRIX") or None


def compute_slowdown(rank: int, world_size: int, environ: dict[str, str] | None = None) -> float:
    """AQPIPE_COMPUTE_SLOWDOWN: rank `rank`'s factor in a comma-separated list of one per rank, or one for every rank
    (a world whose size changes: an elastic launch) (an emulated slower device: its compute stretched by waiting); 1
    where unset."""
    raw = (os.environ if environ is None else environ).get("AQPIPE_COMPUTE_SLOWDOWN", "")
    if not raw:
        return 1.0
    factors = [_number(part) for part in raw.split(",")]
    if len(factors) not in (1, world_size) or not all(1.0 <= f < float("inf") for f in factors):
        raise ValueError(f"AQPIPE_COMPUTE_SLOWDOWN={raw!r}: expected {world_size} factors >= 1, one per rank, "
                         "comma-separated, or one for every rank")
    return factors[rank if len(factors) > 1 else 0]


def show_tracebacks(environ: dict[str, str] | None = None) -> bool:
    """AQPIPE_TRACEBACK set: errors the trainer reports in one line raise with their traceback instead."""
    return bool((os.environ if environ is None else environ).get("AQPIPE_TRACEBACK"))
