"""Where the training loop is and what it has seen: what a checkpoint carries besides the engine's state."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WIRES = ("fwd_bytes", "bwd_bytes", "tie_bytes", "dp_bytes")


@dataclass
class Progress:
    """The data position (epoch, steps of it done), the step count, the last losses, the last evaluation, the bytes
    every wire carried and the seconds trained, as of the last step."""

    epoch: int = 0
    index: int = 0
    step: int = 0
    elapsed: float = 0.0
    losses: list[float] = field(default_factory=list)
    evals: dict[str, float] = field(default_factory=dict)
    eval_step: int = -1  # the step `evals` were taken at
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WIRES, 0))
    num_tokens: int = 0  # a causal LM's input tokens trained on (TRL's num_tokens)
    samples: int | None = 0  # samples trained on, over every replica (None: a checkpoint from before the count)
    dealing: dict[str, Any] | None = None  # how the epoch in progress is dealt (dealing.Dealing.note)

    def done_in(self, epoch: int) -> int:
        """Steps of `epoch` already taken (a resumed run continues after them)."""
        return self.index if epoch == self.epoch else 0

    def add(self, metrics: Any, epoch: int, index: int, elapsed: float, samples: int) -> None:
        """One step taken: step `index` of `epoch` of `samples` (an epoch's last may be partial), its metrics (a
        skipped step's loss is not a loss)."""
        self.step, self.epoch, self.index, self.elapsed = self.step + 1, epoch, index, elapsed
        if self.samples is not None:
            self.samples += samples
        for key in self.totals:
            self.totals[key] += getattr(metrics, key)
        self.num_tokens += getattr(metrics, "input_tokens", None) or 0
        if metrics.skipped is None:
            self.losses.append(metrics.loss)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "step": self.step, "losses": self.losses[-10:],
                "evals": dict(self.evals), "eval_step": self.eval_step, "totals": dict(self.totals),
                "elapsed": self.elapsed, "num_tokens": self.num_tokens, "samples": self.samples,
                "dealing": self.dealing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self.step = int(state["epoch"]), int(state["index"]), int(state["step"])
        self.elapsed, self.losses = float(state["elapsed"]), list(state["losses"])
        self.evals, self.totals = dict(state["evals"]), dict(state["totals"])
        self.eval_step = int(state.get("eval_step", -1))  # checkpoints from before it: an evaluation is taken again
        self.num_tokens = int(state.get("num_tokens", 0))  # from before it: counted from the resume on
        self.samples = state.get("samples")  # from before it: None, and the rate assumes full steps
        self.dealing = state.get("dealing")
