"""Packing (aqpipe/data/packing.py): best-fit decreasing, and a packed sample through the pipeline's own stages giving
each conversation exactly what it gets alone: its logits, its loss and its gradients, with no attention across."""
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from aqpipe import data
from aqpipe.data.chat import IGNORE, encode_instruction
from aqpipe.data.packing import best_fit_decreasing, pack
from aqpipe.pipeline import partition
from tests.helpers.chat import chat_tokenizer

VOCAB, SEQ = 64, 24


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_best_fit_decreasing_fills_the_fullest_bin_that_fits():
    # 7 -> a (room 3); 5 -> b (room 5); 4 -> b (room 1); the first 1 -> b, the fullest that fits (first fit: a)
    assert best_fit_decreasing([5, 7, 1, 4, 1], 10) == [[1, 4], [0, 3, 2]]
    assert best_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]  # a new bin where none has room
    lengths = [int(v) for v in torch.randint(1, 40, (300,), generator=torch.Generator().manual_seed(0))]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))  # each sequence once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= 1.1 * sum(lengths) / 64 + 1  # within 10% of the bound no packing can beat, here
    assert best_fit_decreasing(lengths, 64) == bins  # the same data packs the same way
    with pytest.raises(ValueError, match=r"expected each in 1\.\.64"):
        best_fit_decreasing([3, 65], 64)


def conversations() -> list[tuple[list[int], list[int]]]:
    """Three sequences of 7, 5 and 9 tokens, each with a prompt the loss skips."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n, prompt in ((7, 3), (5, 0), (9, 4)):  # the second: a completion with no prompt, its first token a label
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def test_a_packed_sample_restarts_positions_and_keeps_targets_inside_each_sequence():
    packed = pack(conversations(), SEQ, pad=0)
    assert packed["input_ids"].shape == (1, SEQ)
    pos, labels = packed["position_ids"][0].tolist(), packed["labels"][0].tolist()
    # longest first: 9, 7, 5 tokens, then 3 of padding as a sequence of its own
    assert pos == list(range(9)) + list(range(7)) + list(range(5)) + list(range(3))
    convs = conversations()
    assert packed["input_ids"][0, :21].tolist() == convs[2][0] + convs[0][0] + convs[1][0]
    assert labels[:21] == [IGNORE] + convs[2][1][1:] + [IGNORE] + convs[0][1][1:] + [IGNORE] + convs[1][1][1:]
    assert labels[21:] == [IGNORE] * 3 and "attention_mask" not in packed


def gpt2(attn: str):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


def llama(attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    config._attn_implementation = attn
    return LlamaForCausalLM(config)


def run(stages, batch):
    hidden = None
    for stage in stages:
        hidden = stage(hidden, batch)
    return hidden


@pytest.mark.parametrize("make,attn", [(gpt2, "eager"), (gpt2, "sdpa"), (llama, "sdpa"), (llama, "eager")])
def test_each_packed_conversation_gets_its_own_logits_loss_and_gradients(make, attn):
    stages = partition(make(attn), 2)
    params = [p for s in stages for p in s.parameters()]
    convs = conversations()
    packed = pack(convs, SEQ, pad=0)
    out = run(stages, packed)
    count = int((packed["labels"][:, 1:] != IGNORE).sum())
    (out.loss * count).backward()  # the packed sample's summed loss
    packed_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    starts = {2: 0, 0: 9, 1: 16}  # where each conversation sits in the packed sample (longest first)
    total = 0.0
    for k, (ids, labels) in enumerate(convs):
        alone = run(stages, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
        at = starts[k]
        torch.testing.assert_close(out.logits[0, at:at + len(ids)], alone.logits[0], rtol=1e-5, atol=1e-5)
        n = sum(v != IGNORE for v in labels[1:])
        (alone.loss * n).backward()
        total += float(alone.loss.detach()) * n
    assert float(out.loss.detach()) * count == pytest.approx(total, rel=1e-5)
    for p, packed_grad in zip(params, packed_grads):
        torch.testing.assert_close(packed_grad, p.grad, rtol=1e-4, atol=1e-6)


def test_a_chat_file_trains_packed_with_a_builtin_template_and_counts_what_it_cut(tmp_path):
    tok = chat_tokenizer(None)  # a base model's: no template of its own
    data.apply_chat_template_setting(tok, "chatml")
    assert tok.chat_template == data.BUILTIN_CHAT_TEMPLATES["chatml"]
    short = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    long = short + [{"role": "user", "content": "bye " * 40}, {"role": "assistant", "content": "see you later"}]
    rows = [{"messages": long}] * 2 + [{"messages": short}] * 30
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    padded = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1)
    packed = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1, packing=True)
    assert (len(padded), padded.cut, packed.cut) == (28, 2, 2)  # the two long rows cut to 48 tokens
    short_len = len(encode_instruction(rows[2], tok, 48, "t")[0])
    assert len(packed) == 2 + -(-26 // (48 // short_len))  # the long rows fill theirs, 5 short ones fill each other
    assert "position_ids" in packed.tensors and "attention_mask" not in packed.tensors
    targets = {name: int((d.tensors["labels"][:, 1:] != IGNORE).sum()) for name, d in (("padded", padded),
                                                                                       ("packed", packed))}
    assert targets["padded"] == targets["packed"]  # the same tokens trained on: none lost to packing
    with pytest.raises(ValueError, match=r"chat\.jsonl line 1: \d+ tokens, longer than seq_len=48"):
        data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1, packing=True, packing_overflow="error")
    with pytest.raises(ValueError, match="--chat_template nope.jinja: no such file; expected a Jinja template file or "
                                         "one of chatml, llama3"):
        data.apply_chat_template_setting(tok, "nope.jinja")
