"""A causal LM's loss per target token over the whole step (HF Trainer's `num_items_in_batch`): 2 stages x 2 replicas
with chat-like labels, whose micro-batches hold unequal target counts, against one process running the whole model
on the whole batch: the same loss, gradient norm and updated weights. LM blocks (equal counts) train bit for bit as
with the mean of micro-batch means. Replicas taking unequal shares of the step's micro-batches (4 and 2: a faster
replica taking more) train the same step, both per token and as the mean of micro-batch means."""
import pytest
import torch

from aqpipe import data_parallel
from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups, owned_parameters
from tests.helpers.processes import spawn
from tests.helpers.toy import toy_stages, toy_ties, toy_tokens

SEQ, MBS, SAMPLES, CLIP, LR = 8, 2, 12, 0.5, 0.5  # 6 micro-batches a step: 3 a replica (1/3 is inexact)


def step_batches(chat: bool) -> list[dict[str, torch.Tensor]]:
    """One step's micro-batches (both replicas'). Chat: sample i trains on its last 1 + 3 i mod 7 positions only (a
    prompt masked with -100), so the micro-batches hold 5, 10, 8, 6, 11 and 9 target tokens (the replicas 23 and
    26)."""
    ids = toy_tokens(SAMPLES, SEQ)
    labels = ids.clone()
    if chat:
        for i in range(SAMPLES):
            labels[i, : SEQ - 1 - (3 * i) % 7] = -100
    return [{"input_ids": ids[s:s + MBS], "labels": labels[s:s + MBS], "sample_id": torch.arange(s, s + MBS)}
            for s in range(0, SAMPLES, MBS)]


def pipeline_steps(rank, world):
    """One step of 2 stages x 2 replicas for each data (chat, LM blocks) and average (tokens, micro-batches)."""
    torch.set_num_threads(1)
    grid = Grid.for_world(world, 2)
    groups = build_groups(grid, rank)
    out = {}
    for chat, average, shares in [(c, a, (3, 3)) for c in (True, False) for a in ("tokens", "micro_batches")] + \
            [(True, "tokens", (4, 2)), (True, "micro_batches", (4, 2))]:
        stage = toy_stages(2)[groups.stage]
        owned = owned_parameters(stage, toy_ties(2))
        algo = data_parallel.create("allreduce", owned, data_parallel.Comm(
            groups.data_parallel, grid.data_parallel_ranks(groups.stage)))
        engine = PipelineEngine(stage, groups, torch.optim.SGD(owned, lr=LR),
                                EngineSettings(num_samples=SAMPLES, seq_len=SEQ, gradient_clipping=CLIP,
                                               loss_average=average),
                                compression=CompressionConfig(), ties=toy_ties(2), data_parallel=algo)
        batches = step_batches(chat)
        first = sum(shares[:groups.replica])
        metrics = engine.train_batch(batches[first:first + shares[groups.replica]])
        out[("chat" if chat else "lm", average) + (() if shares == (3, 3) else (shares,))] = {
            "loss": metrics.loss, "grad_norm": metrics.grad_norm, "tokens": metrics.target_tokens,
            "params": [p.detach().clone() for p in owned]}
    return out


def reference(chat: bool, per_token: bool = True) -> dict:
    """The whole model in one process over the whole batch: the sum of every target token's loss over their count
    (`per_token`), or the mean of the micro-batches' means."""
    model = toy_stages(1)[0]
    total, count = 0.0, 0
    for mb in step_batches(chat):
        out = model(None, mb)
        n = int((mb["labels"][:, 1:] != -100).sum()) if per_token else 1
        total, count = total + out.loss * n, count + n
    loss = total / count
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP))
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {"loss": float(loss.detach()), "grad_norm": norm, "tokens": count, "model": model}


@pytest.fixture(scope="module")
def runs():
    return spawn(pipeline_steps, 4)


def test_the_step_loss_is_per_target_token_across_micro_batches_and_replicas(runs):
    ref = reference(chat=True)
    model = ref["model"]
    stage0, stage1 = list(model.blocks[:2].parameters()), [model.embed, *model.blocks[2:].parameters()]
    for rank, out in enumerate(runs):
        run = out["chat", "tokens"]
        assert run["tokens"] == ref["tokens"] == 49
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5) and ref["grad_norm"] > CLIP  # clipped
        expected = stage0 if rank % 2 == 0 else stage1  # ranks 0, 2: stage 0 of replicas 0, 1
        assert len(run["params"]) == len(expected)
        for got, want in zip(run["params"], expected):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    # the mean of micro-batch means weighs a micro-batch of 5 targets as one of 10: another loss, another step
    means = runs[0]["chat", "micro_batches"]
    assert abs(means["loss"] - ref["loss"]) > 1e-3, (means["loss"], ref["loss"])  # against the 1e-6 kept above
    assert not torch.allclose(means["params"][0], runs[0]["chat", "tokens"]["params"][0], atol=1e-4)


def test_lm_blocks_train_bit_for_bit_as_with_the_mean_of_micro_batch_means(runs):
    for out in runs:
        a, b = out["lm", "tokens"], out["lm", "micro_batches"]
        assert a["tokens"] == b["tokens"] == SAMPLES * (SEQ - 1)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("average", ["tokens", "micro_batches"])
def test_replicas_taking_unequal_shares_of_micro_batches_train_the_whole_batch_step(runs, average):
    """Replica 0 takes 4 of the step's 6 micro-batches, replica 1 the other 2: its gradient is weighed by its share
    before the replicas' average, so the step is the whole batch's, as one process takes it."""
    ref = reference(chat=True, per_token=average == "tokens")
    model = ref["model"]
    stage0, stage1 = list(model.blocks[:2].parameters()), [model.embed, *model.blocks[2:].parameters()]
    for rank, out in enumerate(runs):
        run = out["chat", average, (4, 2)]
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        for got, want in zip(run["params"], stage0 if rank % 2 == 0 else stage1):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
