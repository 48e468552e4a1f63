"""Real HF models through the engine on gloo: with dropout on, what a plain unpartitioned loop computes; AQ-SGD."""
import statistics

import pytest
import torch
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification, GPT2Config, GPT2LMHeadModel

from aqpipe.pipeline import (
    CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups, owned_parameters, partition, tie_groups,
)
from tests.helpers.processes import spawn
from tests.helpers.reference import train_reference
from aqpipe.pipeline.compression_config import AUTO_GROUP_SIZE

SEQ, MBS, MICRO, SAMPLES, VOCAB = 16, 2, 2, 16, 96


def gpt2(hidden: int = 64, dropout: float = 0.1) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=hidden, n_layer=3, n_head=2, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def deberta() -> DebertaV2ForSequenceClassification:
    """Dropout on (0.1, HF's default): hidden, attention, pooler."""
    torch.manual_seed(0)
    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=SEQ, relative_attention=True,
                          position_buckets=8, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                          num_labels=3, type_vocab_size=0)
    return DebertaV2ForSequenceClassification(cfg)


MODELS = {"gpt2": gpt2, "deberta": deberta}


def batches(epoch: int, classify: bool, zipf: bool = False):
    """Random tokens, uniform or Zipf-distributed: then a step reads about a third of its tokens distinct, as
    2048 tokens of Shakespeare in GPT-2's BPE do (740 on average, at most 807)."""
    g = torch.Generator().manual_seed(7)
    if zipf:
        tokens = torch.multinomial(1.0 / torch.arange(1, VOCAB + 1) ** 1.4, SAMPLES * SEQ, replacement=True,
                                   generator=g).view(SAMPLES, SEQ)
    else:
        tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    mask = torch.ones(SAMPLES, SEQ, dtype=torch.long)
    mask[::3, -4:] = 0  # some padding
    labels = torch.randint(0, 3, (SAMPLES,), generator=g) if classify else tokens.masked_fill(mask == 0, -100)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
    per_step = MBS * MICRO
    for s in range(SAMPLES // per_step):
        ids = order[s * per_step:(s + 1) * per_step]
        yield [{"input_ids": tokens[i], "attention_mask": mask[i], "labels": labels[i], "sample_id": i}
               for i in ids.split(MBS)]


def optimizer_and_schedule(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with decay, a 2-step warm-up: the same for a stage and for the reference."""
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))


def train(rank, world, family, compression, epochs, steps=None, hidden=64, zipf=False, schedule="1f1b", dropout=0.0):
    model = gpt2(hidden, dropout) if family == "gpt2" else MODELS[family]()
    stages = partition(model, world)
    ties = tie_groups(stages)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = stages[groups.stage]
    optimizer, scheduler = optimizer_and_schedule(owned_parameters(stage, ties))
    engine = PipelineEngine(stage, groups, optimizer,
                            EngineSettings(num_samples=SAMPLES, seq_len=SEQ, gradient_clipping=1.0, schedule=schedule),
                            compression=compression, ties=ties, lr_scheduler=scheduler)
    log = []
    for epoch in range(epochs):
        for mbs in batches(epoch, family == "deberta", zipf):
            if steps is not None and len(log) == steps:
                break
            m = engine.train_batch(mbs, epoch)
            log.append({**m.record(), "input_tokens": m.input_tokens})  # the trainer's num_tokens adds these up
    weights = {k: v.detach().clone() for k, v in engine.hf_state_dict().items()}  # before eval moves tied rows
    evaluation = engine.eval_batch(next(batches(0, family == "deberta")))  # the follower reads current rows
    tied = {k: p.detach().clone() for k, p in stage.tied_parameters().items()}
    return {"log": log, "tied": tied, "eval": evaluation, "weights": weights}


# every family against the reference on each schedule, on 2 and 3 stages; one launch per stage count runs them all
CASES = {2: [("gpt2", "1f1b"), ("deberta", "gpipe"), ("deberta", "zb1")],
         3: [("gpt2", "gpipe"), ("gpt2", "zb1"), ("deberta", "1f1b")]}
STEPS = SAMPLES // (MBS * MICRO)  # one epoch


def train_cases(rank, world):
    return {case: train(rank, world, case[0], CompressionConfig(), 1, STEPS, schedule=case[1], dropout=0.1)
            for case in CASES[world]}


@pytest.fixture(scope="module")
def pipelines():
    return {world: spawn(train_cases, world) for world in CASES}


@pytest.fixture(scope="module")
def references():
    out = {}
    for family in MODELS:
        model = MODELS[family]()
        optimizer, scheduler = optimizer_and_schedule(model.parameters())
        out[family] = train_reference(model, list(batches(0, family == "deberta"))[:STEPS], family=family,
                                      num_blocks=3, optimizer=optimizer, clip=1.0, scheduler=scheduler)
    return out


@pytest.mark.parametrize("world,family,schedule", [(w, f, s) for w, cases in CASES.items() for f, s in cases])
def test_uncompressed_pipeline_with_dropout_equals_the_plain_unpartitioned_loop(pipelines, references, world,
                                                                                  family, schedule):
    """Losses, gradient norms and final weights of the reference loop (tests/helpers/reference.py), within float
    reordering (the tied weight's gradient is summed across stages in another order): weights agree to 1e-7 but
    for the attention's key bias, whose true gradient is zero, so that Adam scales its rounding noise up to ~3e-6.
    A real error moves weights by the learning rate's order (3e-3 a step)."""
    ref, runs = references[family], [r[(family, schedule)] for r in pipelines[world]]
    for run in runs:  # every stage reports the job's loss and norm
        assert [s["loss"] for s in run["log"]] == pytest.approx(ref["loss"], rel=1e-5)
        assert [s["grad_norm"] for s in run["log"]] == pytest.approx(ref["grad_norm"], rel=1e-4)
    weights = {k: v for run in runs for k, v in run["weights"].items()}
    assert set(weights) <= set(ref["weights"]) and len(weights) >= len(ref["weights"]) - 1  # a tied twin once
    for key, value in weights.items():
        torch.testing.assert_close(value, ref["weights"][key], rtol=1e-4, atol=1e-5, msg=key)
    # the owner (last stage) steps each tied weight; stage 0 read exactly its rows in the eval step: GPT2's
    # embedding the eval batch's tokens only (its other rows are stale), DeBERTa's relative embeddings all
    first, last = runs[0], runs[-1]
    tokens = torch.unique(torch.cat([mb["input_ids"].reshape(-1) for mb in next(batches(0, False))]))
    for key in first["tied"]:
        rows = tokens if family == "gpt2" else torch.arange(first["tied"][key].shape[0])
        assert torch.equal(first["tied"][key][rows], last["tied"][key][rows]), key
    assert first["tied"], "the partition must tie something across the stages"


def test_gpt2_aqsgd_2_4_sends_a_tenth_after_the_first_epoch_and_learns():
    cfg = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4,  # tie: aqsgd, 8 bits
                            entropy_coding=False)  # packed sizes, counted below
    log = spawn(train, 2, "gpt2", cfg, 4, None, 128, True)[0]["log"]
    # every wire, exactly, once each sample and token has been seen (epochs 1-3): B x T rows of 128 per step
    rows, width = MICRO * MBS * SEQ, 128
    fp32_fwd, fp32_bwd = rows * width * 4 + 8 * MICRO * MBS, rows * width * 4
    steps = [s for s in log if s["epoch"] >= 1]
    for s, mbs in zip(steps, [mbs for epoch in (1, 2, 3) for mbs in batches(epoch, False, True)]):
        tokens = torch.unique(torch.cat([mb["input_ids"].reshape(-1) for mb in mbs])).numel()
        # 2-bit changes, a min and a step per group of 64 ("auto": rows of 128 are wider), ids
        assert s["fwd_bytes"] == rows * width * 2 // 8 + 8 * rows * width // AUTO_GROUP_SIZE + 8 * MICRO * MBS
        assert s["bwd_bytes"] == rows * (width * 4 // 8 + 8)  # 4-bit gradients
        assert s["tie_bytes"] == 16 + 2 * tokens * (width + 8)  # the step's rows at 8 bits, there and back
        # the targets: all wires at most 1/4 of FP32's activations, the tie at most FP32's forward
        assert s["fwd_bytes"] + s["bwd_bytes"] + s["tie_bytes"] <= (fp32_fwd + fp32_bwd) / 4, s
        assert s["tie_bytes"] <= fp32_fwd
    assert len(steps) == 3 * SAMPLES // (MICRO * MBS)
    per_epoch = {}
    for s in log:
        per_epoch[s["epoch"]] = per_epoch.get(s["epoch"], 0) + s["fwd_bytes"]
    assert all(per_epoch[e] <= per_epoch[0] / 10 for e in (1, 2, 3)), per_epoch
    losses = [s["loss"] for s in log]
    # medians: the last step's batch spikes the gradient norm 10-30x, and its loss with the dither's draws
    assert statistics.median(losses[-4:]) < statistics.median(losses[:4]) * 0.9, losses


def token_metrics_by_hand(weights: dict[str, torch.Tensor], micro_batches: list[dict]) -> dict[str, float]:
    """TRL's evaluation metrics of the unpartitioned model, written out: over every target token (label other than
    -100 after the first position) of every micro-batch, the share its argmax predicts and the mean entropy of the
    predicted distribution; padding (attention mask 0, label -100) is no target."""
    model = gpt2(dropout=0.0)
    model.load_state_dict(weights, strict=False)  # the tied head is the embedding
    model.eval()
    correct = total = 0
    entropy = 0.0
    with torch.no_grad():
        for mb in micro_batches:
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].double()
            labels = mb["labels"][:, 1:]
            for b in range(labels.shape[0]):
                for t in range(labels.shape[1]):
                    if labels[b, t] == -100:
                        continue
                    p = torch.softmax(logits[b, t], -1)
                    entropy -= float((p * torch.log(p)).sum())
                    correct += int(logits[b, t].argmax() == labels[b, t])
                    total += 1
    return {"entropy": entropy / total, "mean_token_accuracy": correct / total, "target_tokens": total}


def test_trls_token_metrics_count_the_attention_masks_tokens_and_the_targets_alone(pipelines, references):
    """num_tokens adds up the attention mask's tokens (padded rows: 12 of 16 in every third sample), not the padded
    width; eval_entropy and eval_mean_token_accuracy are means over the loss's target tokens, pinned against the
    reference model's own logits (its weights agree with the pipeline's to 1e-5)."""
    runs = [r[("gpt2", "1f1b")] for r in pipelines[2]]
    evaluated = next(batches(0, False))
    for run in runs:
        steps = [mbs for mbs in batches(0, False)][:STEPS]
        assert [s["input_tokens"] for s in run["log"]] == [sum(int(mb["attention_mask"].sum()) for mb in mbs)
                                                           for mbs in steps]
        assert sum(s["input_tokens"] for s in run["log"]) == SAMPLES * SEQ - 4 * len(range(0, SAMPLES, 3))
    want = token_metrics_by_hand(references["gpt2"]["weights"], evaluated)
    got = runs[-1]["eval"]
    assert got["target_tokens"] == want["target_tokens"] == sum(int((mb["labels"][:, 1:] != -100).sum())
                                                                for mb in evaluated)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-4)
    assert got["mean_token_accuracy"] == pytest.approx(want["mean_token_accuracy"], abs=1e-9)
