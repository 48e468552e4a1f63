"""The learning rate of every step as a table, and what a resume that changes the run's length does to it.

Any schedule (DeepSpeed's, transformers') is run once on a stand-in optimizer for the run's planned steps, giving
the rate of each step. A resume at step s that changes the number of steps from T to T' (`--epochs`, `--max_steps`)
lays the rest of the schedule over the new length: step t > s takes the rate the old plan had at
s + (t - s)(T - s)/(T' - s), interpolated between steps. The rate is continuous at s, the schedule keeps its shape
(a cosine stays a cosine) and still ends where it ended. A run whose schedule already ended at a rate of 0 is not
stretched: its resume with more steps is refused (there is nothing left of the schedule to lay over them).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

Schedule = Callable[[torch.optim.Optimizer, int], Any]  # (optimizer, total steps) -> a scheduler on it


def rates(schedule: Schedule, total: int, lr: float) -> list[float]:
    """The rate of optimizer steps 1..total (index k: step k + 1), and one more, from `schedule` run on a
    stand-in optimizer."""
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = schedule(stand_in, total)
    out = []
    for _ in range(total + 1):
        out.append(float(stand_in.param_groups[0]["lr"]))
        stand_in.step()
        scheduler.step()
    return out


class PlannedLR:
    """Sets the optimizer's rate before each step from the plan; `state_dict` holds the step and how the plan was
    stretched, so a resume continues it exactly."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule, total: int, lr: float) -> None:
        self.optimizer, self.schedule, self.lr = optimizer, schedule, lr
        self.scales = [group["lr"] / lr if lr else 1.0 for group in optimizer.param_groups]
        self.base_total, self.total, self.step_count = total, total, 0
        self.stretches: list[tuple[int, int, int]] = []  # (at step s, steps T before, steps T' after)
        self._table = rates(schedule, total, lr)
        self._apply()

    def rate(self, done: int) -> float:
        """The rate of the step after `done` steps."""
        t = float(done)
        for s, before, after in reversed(self.stretches):  # undo the latest stretch first
            if t > s:
                t = s + (t - s) * (before - s) / (after - s)
        t = min(max(t, 0.0), len(self._table) - 1.0)
        lo = math.floor(t)
        hi = min(lo + 1, len(self._table) - 1)
        return self._table[lo] + (self._table[hi] - self._table[lo]) * (t - lo)

    def _apply(self) -> None:
        rate = self.rate(self.step_count)
        for group, scale in zip(self.optimizer.param_groups, self.scales):
            group["lr"] = rate * scale

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, "base_total": self.base_total, "total": self.total,
                "stretches": [list(s) for s in self.stretches]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved plan, stretched from its total to this run's where they differ. Raises ValueError when the
        saved schedule ended at a rate of 0 and this run asks for more steps."""
        if "last_batch_iteration" in state:  # a checkpoint of DeepSpeed's scheduler: iteration k = step k
            state = {"step": int(state["last_batch_iteration"]) - 1, "base_total": self.base_total,
                     "total": self.base_total, "stretches": []}
        wanted = self.total
        self.step_count, self.total = int(state["step"]), int(state["total"])
        self.stretches = [tuple(s) for s in state["stretches"]]
        if int(state["base_total"]) != self.base_total:
            self.base_total = int(state["base_total"])
            self._table = rates(self.schedule, self.base_total, self.lr)
        if wanted != self.total:
            s = self.step_count
            if wanted < s:
                raise ValueError(f"the checkpoint is at step {s}; expected --epochs/--max_steps that give more "
                                 f"steps than that, not {wanted}")
            if self.total <= s and self.rate(s) == 0.0:
                raise ValueError(f"the checkpoint's learning-rate schedule ended at step {s} with rate 0, so no "
                                 f"step after it would learn; expected a new run from its model to train further")
            if wanted > s:
                self.stretches.append((s, self.total, wanted))
            self.total = wanted
        self._apply()
