"""A training step reads device values on the host a fixed number of times, however many micro-batches it runs:
losses, finiteness flags and counts stay on the device through the schedule (a GPU runs ahead of the Python that
queues its work) and are read together at the step's table."""
import collections
import functools

import pytest
import torch

from aqpipe.compression import quantizer
from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups
from aqpipe.pipeline import micro_batch, step_run
from tests.helpers.processes import spawn
from tests.helpers.toy import toy_batches, toy_stages, toy_ties

READS = ("item", "tolist", "__bool__", "__float__", "__int__")  # every way a tensor's value reaches Python
# what reads the host's own tensors, never a device's: a quantizer's dither key (from a generator on the host), and
# what a step reads of the loader's micro-batches before they leave it (their masks' forms, their token counts)
HOST_SIDE = [(quantizer, "_dither_key"), (micro_batch, "step_facts"), (step_run, "input_counts")]


def reads_per_step(rank: int, world: int, micro: int, compression: CompressionConfig) -> dict[str, int]:
    """The host reads of this rank's second training step, by method."""
    torch.set_num_threads(1)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = toy_stages(world)[groups.stage]
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5),
                            EngineSettings(num_samples=32, seq_len=8, gradient_clipping=0.5), compression=compression,
                            ties=toy_ties(world))
    first, second = list(toy_batches(32, 8, 2, micro, 0))[:2]
    engine.train_batch(first)  # the first step's one-time work (receive buffers, optimizer state) is not counted
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    host_draws = [0]

    def counted(name):
        def read(self, *args, **kwargs):
            counts[name] += 0 if host_draws[0] else 1
            return originals[name](self, *args, **kwargs)
        return read

    def on_the_host(fn):  # reads that only ever read host tensors: not a sync
        @functools.wraps(fn)
        def read(*args, **kwargs):
            host_draws[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                host_draws[0] -= 1
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    for module, name in HOST_SIDE:
        setattr(module, name, on_the_host(getattr(module, name)))
    host_side = [(module, name, getattr(module, name)) for module, name in HOST_SIDE]
    try:
        metrics = engine.train_batch(second)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for module, name, wrapped in host_side:
            setattr(module, name, wrapped.__wrapped__)
    assert metrics.loss == metrics.loss and metrics.grad_norm > 0.5  # a real step, clipped
    return dict(counts)


# cache-free codecs on both wires: their quantizers' checks wait for the step's read too (AQ-SGD's buffers, the
# tie's too, live in host memory: their messages copy rows to and from the host, so they are not counted here)
QUANTIZED = CompressionConfig(forward="hadamard", forward_bits=4, backward="direct", backward_bits=4, tie="none")


@pytest.mark.parametrize("world,compression", [(1, CompressionConfig()), (2, CompressionConfig()), (2, QUANTIZED)],
                         ids=["1-stage", "2-stages", "2-stages-quantized"])
def test_host_reads_do_not_grow_with_the_micro_batches(world, compression):
    few, many = (spawn(reads_per_step, world, micro, compression) for micro in (2, 6))
    for rank in range(world):
        assert few[rank] == many[rank], f"rank {rank}: {few[rank]} reads with 2 micro-batches, {many[rank]} with 6"
        assert sum(few[rank].values()) <= 6, few[rank]  # the device values read, the norm's flags, the table, the clip
