"""A training step reads device values on the host a fixed number of times, however many micro-batches it runs:
losses, finiteness flags and counts stay on the device through the schedule (a GPU runs ahead of the Python that
queues its work) and are read together at the step's table."""
import collections

import pytest
import torch

from pipeline import CompressionConfig, Grid, PipelineEngine, build_groups
from tests.helpers.processes import spawn
from tests.helpers.toy import toy_batches, toy_stages, toy_ties

READS = ("item", "tolist", "__bool__", "__float__", "__int__")  # every way a tensor's value reaches Python


def reads_per_step(rank: int, world: int, micro: int, compression: CompressionConfig) -> dict[str, int]:
    """The host reads of this rank's second training step, by method."""
    torch.set_num_threads(1)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = toy_stages(world)[groups.stage]
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5), compression=compression,
                            num_samples=32, seq_len=8, ties=toy_ties(world), gradient_clipping=0.5)
    first, second = list(toy_batches(32, 8, 2, micro, 0))[:2]
    engine.train_batch(first)  # the first step's one-time work (receive buffers, optimizer state) is not counted
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        metrics = engine.train_batch(second)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    assert metrics.loss == metrics.loss and metrics.grad_norm > 0.5  # a real step, clipped
    return dict(counts)


@pytest.mark.parametrize("world", [1, 2])
def test_host_reads_do_not_grow_with_the_micro_batches(world):
    few, many = (spawn(reads_per_step, world, micro, CompressionConfig()) for micro in (2, 6))
    for rank in range(world):
        assert few[rank] == many[rank], f"rank {rank}: {few[rank]} reads with 2 micro-batches, {many[rank]} with 6"
        assert sum(few[rank].values()) <= 6, few[rank]  # the settle, the norm's flags, the table, the clip
