"""Real HF models through the engine on gloo: 2 stages give the 1-process losses; AQ-SGD bytes and loss."""
import pytest
import torch
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification, GPT2Config, GPT2LMHeadModel

from tests.conftest import spawn
from pipeline import CompressionConfig, Grid, PipelineEngine, build_groups, partition, tie_groups
from pipeline.compression_config import AUTO_GROUP_SIZE

SEQ, MBS, MICRO, SAMPLES, VOCAB = 16, 2, 2, 16, 96


def gpt2(hidden: int = 64) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=hidden, n_layer=3, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def deberta() -> DebertaV2ForSequenceClassification:
    torch.manual_seed(0)
    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=SEQ, relative_attention=True,
                          position_buckets=8, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, type_vocab_size=0)
    return DebertaV2ForSequenceClassification(cfg)


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


def train(rank, world, family, compression, epochs, steps=None, hidden=64, zipf=False):
    model = gpt2(hidden) if family == "gpt2" else deberta()
    stages = partition(model, world)
    ties = tie_groups(stages)
    groups = build_groups(Grid.for_world(world, world), rank)
    stage = stages[groups.stage]
    engine = PipelineEngine(stage, groups, torch.optim.AdamW(stage.parameters(), lr=3e-3), compression=compression,
                            num_samples=SAMPLES, seq_len=SEQ, ties=ties, gradient_clipping=1.0)
    log = []
    for epoch in range(epochs):
        for mbs in batches(epoch, family == "deberta", zipf):
            if steps is not None and len(log) == steps:
                break
            log.append(engine.train_batch(mbs, epoch).record())
    evaluation = engine.eval_batch(next(batches(0, family == "deberta")))  # the follower reads current rows
    tied = {k: p.detach().clone() for k, p in stage.tied_parameters().items()}
    return {"log": log, "tied": tied, "eval": evaluation}


@pytest.mark.parametrize("family", ["gpt2", "deberta"])
def test_two_stages_match_one_process_for_three_steps(family):
    single = spawn(train, 1, family, CompressionConfig(), 1, 3)[0]
    one = single["log"]
    two = spawn(train, 2, family, CompressionConfig(), 1, 3)
    assert [s["loss"] for s in two[1]["log"]] == pytest.approx([s["loss"] for s in one], rel=1e-5)
    assert [s["grad_norm"] for s in two[0]["log"]] == pytest.approx([s["grad_norm"] for s in one], rel=1e-4)
    assert two[1]["eval"]["loss"] == pytest.approx(single["eval"]["loss"], rel=1e-5)
    # the owner (stage 1) steps each tied weight; stage 0 read exactly its rows in the eval step: GPT2's
    # embedding the eval batch's tokens only (its other rows are stale), DeBERTa's relative embeddings all
    tokens = torch.unique(torch.cat([mb["input_ids"].reshape(-1) for mb in next(batches(0, False))]))
    for key in two[0]["tied"]:
        rows = tokens if family == "gpt2" else torch.arange(two[0]["tied"][key].shape[0])
        assert torch.equal(two[0]["tied"][key][rows], two[1]["tied"][key][rows]), key
    assert two[0]["tied"], "the partition must tie something across the two stages"


def test_gpt2_aqsgd_2_4_sends_a_tenth_after_the_first_epoch_and_learns():
    cfg = CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4)  # tie: aqsgd, 8 bits
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
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 * 0.9, losses
