"""Instruction data (aqpipe/data/chat.py): the loss falls on the assistant's tokens alone, under real templates
that mark no generation spans."""
import json

import pytest
import torch

from aqpipe import data
from aqpipe.data.chat import IGNORE, encode_instruction
from tests.helpers.chat import CHATML, CONVERSATION, LLAMA3, chat_tokenizer

END_OF_TURN = {LLAMA3: "<|eot_id|>", CHATML: "<|im_end|>"}


def targets(tok, ids, labels):
    assert [i for i, v in zip(ids, labels) if v != IGNORE] == [v for v in labels if v != IGNORE]  # labels = ids there
    return [tok.convert_ids_to_tokens(v) for v in labels if v != IGNORE]


@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_a_two_turn_conversation_trains_on_the_assistant_tokens_alone(template):
    tok = chat_tokenizer(template)
    ids, labels = encode_instruction({"messages": CONVERSATION}, tok, 64, "t")
    eot = END_OF_TURN[template]
    assert targets(tok, ids, labels) == ["hello", eot, "see", "you", "later", eot]
    tokens = tok.convert_ids_to_tokens(ids)
    first = tokens.index("hello")  # the exact positions: the header before it and the user turn after it are not
    assert [i for i, v in enumerate(labels) if v != IGNORE][:2] == [first, first + 1]
    assert tokens[first - 1] in ("<|end_header_id|>", "assistant") and labels[first - 1] == IGNORE


def test_a_cut_conversation_keeps_its_first_targets_and_one_without_any_is_dropped():
    tok = chat_tokenizer(LLAMA3)
    full, _ = encode_instruction({"messages": CONVERSATION}, tok, 64, "t")
    first = tok.convert_ids_to_tokens(full).index("hello")
    ids, labels = encode_instruction({"messages": CONVERSATION}, tok, first + 2, "t")
    assert len(ids) == first + 2 and targets(tok, ids, labels) == ["hello", "<|eot_id|>"]
    assert encode_instruction({"messages": CONVERSATION}, tok, first, "t") is None


def test_prompt_and_completion_train_on_the_completion_and_its_end():
    tok = chat_tokenizer()
    ids, labels = encode_instruction({"prompt": "hi there ", "completion": "hello how can i help"}, tok, 32, "t")
    assert targets(tok, ids, labels) == ["hello", "how", "can", "i", "help", "</s>"]


def test_no_chat_template_or_a_malformed_turn_is_one_line():
    with pytest.raises(ValueError, match=r"the tokenizer has no chat_template; expected --chat_template \(chatml, "
                                         r"llama3 or a Jinja file\), a model whose tokenizer"):
        encode_instruction({"messages": CONVERSATION}, chat_tokenizer(None), 64, "chat.jsonl row 0")
    with pytest.raises(ValueError, match=r"turn \{'role': 'robot'.*expected role one of system, user"):
        encode_instruction({"messages": [{"role": "robot", "content": "hi"}]}, chat_tokenizer(LLAMA3), 64, "t")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    """Qwen3-style templates drop an earlier turn's reasoning: prefixes are then not prefixes, and a guess would
    train on the wrong tokens."""
    rewrites = CHATML.replace("{{ m['content'] }}", "{{ m['content'] if loop.last else 'hi' }}")
    with pytest.raises(ValueError, match="renders turn 2 differently alone than within the conversation"):
        encode_instruction({"messages": CONVERSATION}, chat_tokenizer(rewrites), 64, "t")


def test_a_chat_table_becomes_padded_samples_with_masks(tmp_path):
    tok = chat_tokenizer(CHATML)
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}] * 10
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1)
    evaluation = data.lm_dataset(str(path), tok, 48, split="eval", eval_fraction=0.1)
    assert (len(train), len(evaluation)) == (18, 2)
    mask, labels, ids = train.tensors["attention_mask"], train.tensors["labels"], train.tensors["input_ids"]
    lengths = mask.sum(1)
    assert lengths.tolist() == [len(encode_instruction(r, tok, 48, "t")[0]) for r in rows[:18]]
    assert (ids[mask == 0] == tok.pad_token_id).all() and (labels[mask == 0] == IGNORE).all()
    assert torch.equal(train.tensors["sample_id"], torch.arange(18))


def test_a_bad_row_is_named_by_its_file_line_and_a_missing_key_by_the_keys_found(tmp_path):
    tok = chat_tokenizer(CHATML)
    rows = [{"messages": CONVERSATION[1:3]}] * 56 + [{"messages": [{"role": "robot", "content": "hi"}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # a blank first line: the loader skips it
    with pytest.raises(ValueError, match=r"chat\.jsonl line 58: turn \{'role': 'robot'"):  # the 57th row, line 58
        data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.05)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:5] + [{"conversation": [], "id": 7}]))
    with pytest.raises(ValueError, match=r"chat\.jsonl line 6: fits no format \(its keys: conversation, id\); "
                                         r"expected one of messages \(.*conversations \(ShareGPT.*prompt and "
                                         "completion"):
        data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.05)


def test_a_held_out_chat_file_is_evaluated_whole(tmp_path):
    """--eval_dataset: the eval file's every conversation, and the training file's every one (no 5% held back)."""
    tok = chat_tokenizer(CHATML)
    train, held = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(40)))
    held.write_text("".join(json.dumps({"messages": CONVERSATION[1:3]}) + "\n" for _ in range(7)))
    assert len(data.lm_dataset(str(held), tok, 48, split="eval", eval_fraction=1.0)) == 7
    assert len(data.lm_dataset(str(train), tok, 48, split="train", eval_fraction=0.0)) == 40
    with pytest.raises(ValueError, match=r"eval_fraction=1.0: expected a fraction in \[0, 1\)"):
        data.lm_dataset(str(train), tok, 48, split="train", eval_fraction=1.0)


def test_chat_rows_are_rendered_once_per_machine_and_again_for_another_template(tmp_path, monkeypatch):
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cache"))
    tok = chat_tokenizer(CHATML)
    renders = []
    render = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **kw: renders.append(1) or render(*a, **kw)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATION[:i]}) + "\n" for i in (3, 5) * 6))
    first = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1)
    rendered = len(renders)
    assert rendered > 0
    again = data.lm_dataset(str(path), tok, 32, split="train", eval_fraction=0.1, packing=True)  # any seq_len
    assert len(renders) == rendered  # read back, memory-mapped: not rendered again
    fresh = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1)
    assert all(torch.equal(first.tensors[k], fresh.tensors[k]) for k in first.tensors)
    assert int((again.tensors["labels"] != IGNORE).sum()) == int((first.tensors["labels"][:, 1:] != IGNORE).sum())
    tok.chat_template = LLAMA3  # another template: other tokens, rendered anew
    other = data.lm_dataset(str(path), tok, 48, split="train", eval_fraction=0.1)
    assert len(renders) > rendered and not torch.equal(other.tensors["input_ids"], first.tensors["input_ids"])
