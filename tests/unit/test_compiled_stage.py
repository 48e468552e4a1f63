"""--compile: a stage's training forward is one graph, its embeddings, blocks, head and loss included, as a compiled
plain loop compiles its model. Before, each part's dropout seed was hashed inside the forward; that broke the graph
inside the loop over the blocks, which sends the whole forward back to eager, so most of a "compiled" stage ran
uncompiled. Compiled here through AOTAutograd with its graphs run as torch ops (no compiler needed): one frame a
stage, the eager stage's loss and gradients where nothing is random, dropout drawn from the micro-batch's seed and
the stage, checkpointed blocks recomputed with their masks, and a copy that is its own stage. (DeBERTa's head took
its labelled rows by `nonzero`, as HF's does, a size read from the data: its graph broke there; it takes their mean
by a mask now.)"""
from copy import deepcopy

import pytest
import torch
from peft import LoraConfig
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import (BertConfig, BertForSequenceClassification, DebertaV2Config,
                          DebertaV2ForSequenceClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

from aqpipe.pipeline.loading import build_stage
from aqpipe.pipeline.lora import add_lora
from aqpipe.pipeline.micro_batch import staged
from aqpipe.pipeline.stages import lm_loss

SIZE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "vocab_size": 1000}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
MODELS = {  # name: (class, config without dropout, config with it)
    "llama-tied": (LlamaForCausalLM, LlamaConfig(**SIZE, num_key_value_heads=2, tie_word_embeddings=True),
                   LlamaConfig(**SIZE, num_key_value_heads=2, tie_word_embeddings=True, attention_dropout=0.1)),
    "gpt2": (GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=1000, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0),
             GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=1000)),
    "bert": (BertForSequenceClassification, BertConfig(**SIZE, **NO_DROPOUT), BertConfig(**SIZE)),
    "deberta": (DebertaV2ForSequenceClassification, DebertaV2Config(**SIZE, **NO_DROPOUT), DebertaV2Config(**SIZE)),
}


def _batch(name: str, packed: bool = False) -> dict:
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids}
    if name in ("bert", "deberta"):
        batch |= {"attention_mask": torch.ones_like(ids).index_fill_(1, torch.arange(28, 32), 0),
                  "labels": torch.tensor([0, 1])}
    else:
        batch["labels"] = ids.clone()
    if packed:  # two sequences a row
        batch["position_ids"] = torch.cat([torch.arange(20), torch.arange(12)]).repeat(2, 1)
    return staged([batch], "cpu")[0]


def _stages(name: str, dropout: bool, lora: bool = False, checkpointing: bool = False) -> list:
    cls, plain, noisy = MODELS[name]
    stages = [build_stage(cls, noisy if dropout else plain, i, 2, seed=4, activation_checkpointing=checkpointing)[0]
              for i in range(2)]
    for stage in stages:
        if lora:
            add_lora(stage, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 0, torch.float32)
        stage.train()
    return stages


def _step(stages: list, batch: dict, seed: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The two stages' forward and backward, the boundary between them cut as a pipeline cuts it."""
    sent = stages[0](None, batch, seed=seed)
    boundary = sent.detach().requires_grad_()
    loss = stages[1](boundary, batch, seed=seed).loss
    loss.backward()
    sent.backward(boundary.grad)
    grads = [p.grad.clone() for stage in stages for p in stage.parameters() if p.grad is not None]
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _compiled(stages: list) -> list[CompileCounterWithBackend]:
    """Each stage compiled through AOTAutograd (its forward and backward graphs partitioned as the compiler's are),
    the graphs run as torch ops: the frames dynamo captured counted."""
    torch._dynamo.reset()
    counters = [CompileCounterWithBackend("aot_eager") for _ in stages]
    for stage, counter in zip(stages, counters):
        stage.compile(backend=counter)
    return counters


# (model, packed rows, LoRA adapters): a tied Llama with the chunked loss (a frozen head's, then a trained one's,
# gradients made in the forward), classifiers (GPT2: with dropout, below)
CASES = {"llama-tied-packed-lora": ("llama-tied", True, True), "llama-tied-packed-full": ("llama-tied", True, False),
         "bert": ("bert", False, False), "deberta": ("deberta", False, False)}


@pytest.mark.parametrize("case", CASES)
def test_a_compiled_stage_is_one_graph_with_the_eager_stages_loss_and_gradients(case, monkeypatch):
    name, packed, lora = CASES[case]
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 20_000)  # the chunked loss, as a large vocabulary takes it
    batch = _batch(name, packed)
    stages = _stages(name, dropout=False, lora=lora)
    want_loss, want_grads = _step(stages, batch, seed=7)
    counters = _compiled(stages)
    loss, grads = _step(stages, batch, seed=7)
    assert [c.frame_count for c in counters] == [1, 1], [c.frame_count for c in counters]  # one graph a stage
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()


def test_a_compiled_stages_dropout_is_drawn_from_its_seed_and_stage_and_redrawn_where_checkpointed():
    batch = _batch("gpt2")
    stages = _stages("gpt2", dropout=True)
    counters = _compiled(stages)
    first, again, other = (_step(stages, batch, seed) for seed in (7, 7, 8))
    assert [c.frame_count for c in counters] == [1, 1]
    assert torch.equal(first[0], again[0])  # a resumed run draws what the uninterrupted one drew
    assert not torch.equal(first[0], other[0])  # and the masks are drawn: another micro-batch's seed, another loss
    started = []  # the generator state each stage's graph starts from, for one micro-batch
    for stage, hidden in zip(stages, (None, torch.zeros(2, 32, 64))):
        stage(hidden, batch, seed=7)
        started.append(torch.initial_seed())
    assert started[0] != started[1]  # the stages' masks are not each other's
    # --activation_checkpointing: the recomputed blocks redraw the forward's masks, so the step is the same
    checkpointed = _stages("gpt2", dropout=True, checkpointing=True)
    _compiled(checkpointed)
    loss, grads = _step(checkpointed, batch, seed=7)
    torch.testing.assert_close(loss, first[0], rtol=1e-6, atol=0)
    for got, want in zip(grads, first[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    eager = _stages("gpt2", dropout=True)  # the same weights, not compiled
    for stage in stages + eager:
        stage.eval()
    with torch.no_grad():  # evaluation: no dropout, no seed, the eager stage's outputs
        compiled, plain = (s[1](s[0](None, batch), batch).loss for s in (stages, eager))
    torch.testing.assert_close(compiled, plain, rtol=1e-6, atol=0)
    torch._dynamo.reset()


def test_a_copy_of_a_compiled_stage_runs_its_own_weights():
    stage = _stages("gpt2", dropout=False)[0].eval()
    stage.compile(backend="eager")
    copy = deepcopy(stage)
    batch = _batch("gpt2")
    with torch.no_grad():
        for p in copy.parameters():
            p.mul_(0.5)
        assert not torch.allclose(copy(None, batch), stage(None, batch))
    torch._dynamo.reset()
