"""The interface every data-parallel algorithm implements, and the registry that names them.

The engine calls, for each stage, around its optimizer step:

    loss.backward()            (gradients of this stage's parameters are ready)
    algorithm.after_backward() (e.g. average gradients, or average the model with a peer)
    optimizer.step()           (the optimizer returned by algorithm.wrap_optimizer)
    algorithm.after_step()     (e.g. send the quantized change of the model)

Everything goes through `self.comm` (a `Comm` over the stage's replicas), which counts
the bytes. An algorithm knows nothing of pipelines: any training loop can drive it.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from .comm import Comm

REGISTRY: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
    REGISTRY[cls.name] = cls
    return cls


class Algorithm:
    name: ClassVar[str] = ""
    OPTIONS: ClassVar[tuple[str, ...]] = ()  # the options `DataParallelConfig.create` passes it
    # whether it averages the replicas' gradients (each first scaled by the engine to its share of the step's
    # micro-batches or tokens), so replicas may take unequal shares; one that averages models or their changes after
    # the optimizer's step (which Adam makes blind to a gradient's scale) cannot weight them
    WEIGHTS: ClassVar[bool] = False

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, **options: Any) -> None:
        if options:
            raise ValueError(f"{self.name}: unknown option(s) {', '.join(sorted(options))}")
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.step_count = 0

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step with (QAdam replaces Adam with its own); the given one by default."""
        return optimizer

    def after_backward(self) -> None:
        """Called with this step's gradients in place, before the optimizer step."""

    def after_step(self) -> None:
        """Called after the optimizer step; the step counter advances here."""
        self.step_count += 1

    def restart(self, step_count: int) -> None:
        """Start afresh from the parameters as they are now, `step_count` steps into the run: a resume on another
        shape loads its stage's weights after the algorithm was built, and its saved memories were of other
        parameters. Memories taken lazily (an anchor at the first step) or zero at the start need nothing more."""
        self.step_count = int(step_count)

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])


def create(name: str, params: list[torch.nn.Parameter], comm: Comm, **options: Any) -> Algorithm:
    """The algorithm registered under `name`; ValueError listing the known ones otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"dp_algorithm={name!r}: expected one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](params, comm, **options)
