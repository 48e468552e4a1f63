"""Run by test_cuda_path under torchrun (strict_job.py): `python -m aqpipe`'s job with every action of a step's
schedule (forwards, backwards, sends, receives, the tied weights' and boundaries' `begin`) run under torch's sync
debug mode "error", from the second training step on (the first primes the tie and fills buffers once). A
synchronizing CUDA call there raises, naming its site; what a step reads once at its end (the loss, the order
check) stays outside. Each rank writes the count of actions it ran strictly to `strict_actions.<rank>` in the
working directory at exit (a file, not stdout, where two ranks' lines can interleave in one pipe: CI once lost one).
With PLANT_SYNC set, GPT2's stages read their position ids back on the host: the check's own check. Without a GPU
(the suite's check of this harness) the actions are counted alone."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from aqpipe.cli import leave, main
from aqpipe.pipeline import step_run, ties, transport
from aqpipe.pipeline.stages import gpt2, heads
from tests.gpu.strict_job import STRICT_FROM_STEP

ACTIONS = ("recv_act", "forward", "send_act", "recv_grad", "backward", "backward_input", "backward_weight",
           "send_grad")
checked = [0]


def strict(method, runtime_of):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        runtime = runtime_of(self)
        if runtime is None or runtime.step < STRICT_FROM_STEP:
            return method(self, *args, **kwargs)
        on_gpu = torch.cuda.is_available()  # without one (the suite's check of this harness), counted alone
        if on_gpu:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return method(self, *args, **kwargs)
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode("default")
            checked[0] += 1
    return run


current: list = [None]  # the runtime of the step running now


def _tracking(run):
    @functools.wraps(run)
    def tracked(self, actions):
        current[0] = self.runtime if self.training else None
        try:
            return run(self, actions)
        finally:
            current[0] = None
    return tracked


step_run.StepRun.run = _tracking(step_run.StepRun.run)
for name in ACTIONS:
    setattr(step_run.StepRun, name, strict(getattr(step_run.StepRun, name), lambda self: current[0]))
for cls in (ties.TiedWeights, transport.Boundary):
    cls.begin = strict(cls.begin, lambda self: current[0])

if os.environ.get("PLANT_SYNC"):  # the test's check that a sync in a stage's forward is caught
    _positions = heads.position_ids

    def reading_positions(hidden, batch):
        out = _positions(hidden, batch)
        int(out.max())  # reads a device value on the host
        return out

    gpt2.position_ids = reading_positions

if __name__ == "__main__":
    code = main(sys.argv[1:])
    Path(f"strict_actions.{os.environ['RANK']}").write_text(str(checked[0]))
    leave(code)
