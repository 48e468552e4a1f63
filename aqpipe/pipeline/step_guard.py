"""What a training step may have to take back: a step that found a NaN/inf (or an activation its AQ-SGD buffer
cannot hold) leaves no trace, so every rank undoes what it changed before it raises or skips alike.

The guard notes what was found and where (`Findings`, which travels in the step's table), keeps a restore for
every codec buffer row the step is about to update (newest last) and the dither generators' states as the step
began; `undo` puts them all back.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from aqpipe.compression import Codec

from .step_table import Findings


def finite_or_zeros(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, or zeros of its shape where it holds a NaN/inf; whether it was all finite, a 0-dim bool), both chosen on
    x's device: what is sent instead of a NaN (the peer waits for a message of a known size), with no host read."""
    ok = torch.isfinite(x).all()
    return torch.where(ok, x, torch.zeros((), dtype=x.dtype, device=x.device)), ok


class StepGuard:
    def __init__(self, codecs: dict[str, Codec]) -> None:
        """`codecs`: this rank's stateful codecs by name (their dither generators are put back too)."""
        self.codecs = codecs
        self.generators = {name: codec.dither_state() for name, codec in codecs.items()}
        self.findings = Findings()
        self.restores: list[Callable[[], None]] = []  # what puts back each change the step made, newest last

    def note(self, kind: int, mb: int) -> None:
        self.findings.note(kind, mb)

    def finite(self, x: torch.Tensor, kind: int, mb: int) -> torch.Tensor:
        """Whether x is all finite, as a 0-dim bool on x's device (no host sync inside the schedule); noted with
        what and where once the step's device values are read (`Findings.resolve`)."""
        ok = torch.isfinite(x).all()
        self.findings.check(kind, mb, ok)
        return ok

    def zeros_unless(self, x: torch.Tensor, kind: int, mb: int) -> torch.Tensor:
        """`finite_or_zeros(x)`, its flag noted as `kind` at `mb` (the step is rejected after the schedule)."""
        x, ok = finite_or_zeros(x)
        self.findings.check(kind, mb, ok)
        return x

    def remember(self, codec: Any, sample_ids: Any) -> None:
        """Before a message that changes `codec`'s state (AQ-SGD's buffer rows, error feedback's residual), keep
        what it will change."""
        self.restores.append(codec.undo_point(sample_ids))

    def undo(self) -> None:
        """Every change the step made, newest first, and the generators as the step began."""
        for restore in reversed(self.restores):
            restore()
        for name, codec in self.codecs.items():
            codec.set_dither_state(self.generators[name])
