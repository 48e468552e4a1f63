"""Fault injection for reliability tests and drills: AQPIPE_FAULT=KIND:RANK:STEP.

Before training step STEP (1-based), rank RANK
  kill   SIGKILLs itself (a crash, an out-of-memory kill),
  raise  raises RuntimeError (a bug on one rank),
  hang   sleeps forever with its heartbeat running (a rank that is alive but stuck),
  nan    makes its stage's output NaN for that step (a numeric blow-up).
Unset: nothing happens. A bad value is refused up front like any other setting. Under torchrun's `--max_restarts`
the fault comes in the first attempt only: the restarted run is the recovery a drill measures, not a second fault.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("kill", "raise", "hang", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse(value: str | None) -> Fault | None:
    """The fault AQPIPE_FAULT describes; ValueError naming the value and the expected form."""
    if not value:
        return None
    parts = value.split(":")
    try:
        kind, rank, step = parts[0], int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        kind, rank, step = "", -1, -1
    if len(parts) != 3 or kind not in KINDS or rank < 0 or step < 1:
        raise ValueError(f"AQPIPE_FAULT={value!r}: expected KIND:RANK:STEP with KIND one of {', '.join(KINDS)}, "
                         "RANK >= 0 and STEP >= 1")
    return Fault(kind, rank, step)


def from_env() -> Fault | None:
    return parse(os.environ.get("AQPIPE_FAULT"))


class Injector:
    """Called before each step; does the fault when its rank and step come."""

    def __init__(self, fault: Fault | None, rank: int, stage_module: Any) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.fault = fault if fault is not None and fault.rank == rank and first_attempt else None
        self.armed = False
        if self.fault is not None and self.fault.kind == "nan":
            stage_module.register_forward_hook(self._poison)

    def _poison(self, module: Any, inputs: Any, output: Any) -> Any:
        if not self.armed:
            return output
        if isinstance(output, torch.Tensor):
            return output * float("nan")
        return type(output)(output.loss * float("nan"), output.logits)  # the last stage's (loss, logits)

    def before_step(self, step: int) -> None:
        fault = self.fault
        self.armed = fault is not None and fault.kind == "nan" and step == fault.step
        if fault is None or step != fault.step:
            return
        if fault.kind == "kill":  # the moment said first, for a drill that times the recovery (wall clock)
            print(f"AQPIPE_FAULT: rank {fault.rank} killed before step {step} at {time.time():.3f}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "raise":
            raise RuntimeError(f"injected fault (AQPIPE_FAULT) at step {step}")
        if fault.kind == "hang":
            while True:
                time.sleep(3600)
