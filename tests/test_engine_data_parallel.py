"""Replicas of the pipeline (2 stages x 2 replicas on gloo) synchronized by the data_parallel algorithms."""
import pytest
import torch

import data_parallel
from distributed_helpers import spawn
from pipeline import CompressionConfig, Grid, PipelineEngine, build_groups
from toy_stages import toy_batches, toy_stages, toy_ties

SEQ, MBS, MICRO, SAMPLES = 8, 4, 2, 32


def train(rank, world, stages, algorithm, options, steps=4):
    grid = Grid.for_world(world, stages)
    groups = build_groups(grid, rank, toy_ties(stages))
    stage = toy_stages(stages)[groups.stage]
    algo = None
    if grid.replicas > 1:
        comm = data_parallel.Comm(groups.data_parallel, grid.data_parallel_ranks(groups.stage))
        algo = data_parallel.create(algorithm, list(stage.parameters()), comm, **options)
    engine = PipelineEngine(stage, groups, torch.optim.SGD(stage.parameters(), lr=0.5), compression=CompressionConfig(),
                            num_samples=SAMPLES, seq_len=SEQ, ties=toy_ties(stages), data_parallel=algo)
    per_replica = MICRO * 2 // grid.replicas  # the global batch is always 2 x MICRO micro-batches
    log = []
    for mbs in toy_batches(SAMPLES, SEQ, MBS, MICRO * 2, 0):
        if len(log) == steps:
            break
        mine = mbs[groups.replica * per_replica:(groups.replica + 1) * per_replica]
        engine.train_batch(mine, 0)
        log.append(engine.last_metrics)
    return {"log": log, "params": [p.detach().clone() for p in stage.parameters()]}


def test_allreduce_two_replicas_match_one_replica_at_the_same_global_batch():
    single = spawn(train, 1, 1, "allreduce", {})[0]["log"]
    grid = spawn(train, 4, 2, "allreduce", {})
    assert [s["loss"] for s in grid[0]["log"]] == pytest.approx([s["loss"] for s in single], rel=1e-5)
    # replicas of a stage hold identical weights; dp bytes = ring allreduce of each stage's gradients
    for stage in (0, 1):
        a, b = grid[stage]["params"], grid[stage + 2]["params"]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    numel = sum(p.numel() for s in toy_stages(2) for p in s.parameters())
    assert grid[0]["log"][0]["dp_bytes"] == 2 * numel * 4 * 2 * (2 - 1) // 2  # 2 replicas, each sends (R-1)/R x 2


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="dp_algorithm='gossip': expected one of"):
        data_parallel.create("gossip", [], data_parallel.Comm())
