"""A spot warning that reaches one rank stops every rank after the same step: the request travels in the step's own
table (no message of its own), so a rank that heard nothing learns it in the step that carried it."""
import torch

from aqpipe.pipeline import EngineSettings, Grid, PipelineEngine, build_groups, owned_parameters
from tests.helpers.processes import spawn
from tests.helpers.toy import toy_batches, toy_stages, toy_ties


def steps(rank: int, world: int) -> list[bool]:
    torch.set_num_threads(1)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = toy_stages(world)[groups.stage]
    asked = {"now": False}
    engine = PipelineEngine(stage, groups, torch.optim.SGD(owned_parameters(stage, toy_ties(world)), lr=0.1),
                            EngineSettings(num_samples=32, seq_len=8, stop_asked=lambda: asked["now"]),
                            ties=toy_ties(world))
    seen = []
    for step, mbs in enumerate(toy_batches(32, 8, 2, 2, epoch=0)):
        asked["now"] = rank == world - 1 and step == 2  # the last stage alone hears it, before step 3's table
        seen.append(engine.train_batch(mbs).stop)
    return seen


def test_one_ranks_request_stops_every_rank_after_the_same_step():
    for seen in spawn(steps, 3):
        assert seen[:4] == [False, False, True, False], seen
