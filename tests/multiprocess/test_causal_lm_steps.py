"""A causal LM's steps through a 2-stage tied GPT2, as the loss path meets the schedule.

Liger's fused loss (--use_liger_kernel) on every schedule: zb1 runs a fused last stage's backward whole, since
Liger scales the gradients it saved in place by the incoming gradient and a split's second pass over its node
would scale the head's gradient twice. Trained by SGD (whose step is the gradient itself, so a scaled gradient
shows), it ends where 1f1b puts it, and where the chunked loss does. Triton's CPU interpreter here.

A micro-batch with no targets trains nothing: the step is the step of the others alone, not one rejected for 0/0
(the per-token average, the default); a step with no targets at all is skipped. Without Liger the loss here is HF's
whole one (a 96-token vocabulary); the chunked loss's case is tests/unit/test_lm_loss.py's."""
import pytest
import torch

from aqpipe.pipeline.engine import NO_TARGETS
from aqpipe.pipeline import EngineSettings, Grid, PipelineEngine, build_groups, owned_parameters, partition, tie_groups
from tests.helpers.processes import spawn
from tests.multiprocess.test_pipeline_hf import SAMPLES, SEQ, batches, gpt2


def sgd_engine(rank: int, world: int, fused: str | None, schedule: str = "1f1b") -> PipelineEngine:
    """This rank's stage of a fresh tied GPT2 (dropout off) with the loss `fused`, trained by SGD on `schedule`."""
    stages = partition(gpt2(dropout=0.0), world)
    ties = tie_groups(stages)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = stages[groups.stage]
    stage.use_fused_loss(fused)
    return PipelineEngine(stage, groups, torch.optim.SGD(owned_parameters(stage, ties), lr=0.5),
                          EngineSettings(num_samples=SAMPLES, seq_len=SEQ, schedule=schedule), ties=ties)


def weights(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.hf_state_dict().items()}


def train(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for schedule, fused in (("1f1b", "liger"), ("zb1", "liger"), ("zb1", None)):
        engine = sgd_engine(rank, world, fused, schedule)
        losses = [engine.train_batch(mbs).loss for mbs in list(batches(0, False))[:2]]
        out[(schedule, fused)] = (losses, weights(engine))
    return out


def test_zb1_trains_a_fused_last_stage_as_1f1b_does():
    runs = spawn(train, 2)
    losses = {case: run[case][0] for run in runs[-1:] for case in run}  # the job's, as every stage reports it
    weights = {case: {k: v for run in runs for k, v in run[case][1].items()} for case in runs[0]}
    assert losses[("zb1", "liger")] == losses[("1f1b", "liger")]  # the first step's; the second after a step
    assert losses[("zb1", None)] == pytest.approx(losses[("1f1b", "liger")], rel=1e-5)
    fused, split, chunked = weights[("1f1b", "liger")], weights[("zb1", "liger")], weights[("zb1", None)]
    assert "lm_head.weight" in split  # the tied head's weight, trained through the fused loss
    for key in split:
        torch.testing.assert_close(split[key], fused[key], rtol=1e-6, atol=1e-7, msg=key)
        torch.testing.assert_close(split[key], chunked[key], rtol=1e-4, atol=1e-6, msg=key)


def one_step(rank: int, world: int) -> dict:
    """Per loss path (chunked, fused): a step whose second micro-batch has no targets, and the first one's alone."""
    torch.set_num_threads(1)
    first = list(batches(0, False))[0]
    empty = dict(first[1], labels=torch.full_like(first[1]["labels"], -100))
    out = {}
    for fused in (None, "liger"):
        for micro_batches in ([first[0], empty], [first[0]], [empty, empty]):
            engine = sgd_engine(rank, world, fused)
            before = weights(engine)
            m = engine.train_batch(micro_batches)
            out.setdefault(fused, []).append((m.loss, m.skipped, weights(engine), before))
        out[(fused, "eval")] = engine.eval_batch([empty])
    return out


def test_a_micro_batch_with_no_targets_leaves_the_step_of_the_others():
    """... and a step with none at all is skipped, its weights untouched (Liger's backward multiplies by what the
    step scales its losses with: 0/0 there gave NaN gradients, and the step raised)."""
    for run in spawn(one_step, 2):
        for fused in (None, "liger"):
            evaluation = run.pop((fused, "eval"))  # no loss to report, and no weight in the evaluation's mean
            assert evaluation["target_tokens"] == 0 and evaluation["loss"] != evaluation["loss"]
        for fused, ((loss, skipped, weights, _), (alone, _, alone_weights, _), nothing) in run.items():
            assert skipped is None and loss == pytest.approx(alone, rel=1e-6), fused
            for key in weights:
                torch.testing.assert_close(weights[key], alone_weights[key], rtol=1e-6, atol=1e-7, msg=key)
            loss, skipped, after, before = nothing
            assert skipped == NO_TARGETS and loss != loss, fused
            assert all(torch.equal(after[k], before[k]) for k in before), fused
