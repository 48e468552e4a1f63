"""What the trainer reads from the environment besides the launcher's variables, each in one place: the quantizer's
kernels and an emulated link delay (for the benchmarks)."""
from __future__ import annotations

import os


def configure_kernels(environ: dict[str, str] | None = None) -> None:
    """The quantizer's kernels as the environment asks: AQPIPE_KERNELS (auto, native or torch), AQPIPE_CACHE (where
    the compiled ones are kept) and CC (the C compiler)."""
    from compression import kernels

    env = os.environ if environ is None else environ
    kernels.configure(env.get("AQPIPE_KERNELS", "auto"), env.get("AQPIPE_CACHE"), env.get("CC", "cc"))


def link_latency_s(environ: dict[str, str] | None = None) -> float:
    """The emulated one-way link delay AQPIPE_LINK_LATENCY_MS asks for, in seconds (0: none)."""
    raw = (os.environ if environ is None else environ).get("AQPIPE_LINK_LATENCY_MS", "0")
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms >= 0:
        raise ValueError(f"AQPIPE_LINK_LATENCY_MS={raw!r}: expected a number of milliseconds >= 0")
    return ms / 1000.0
