"""The chat cache never serves one setting's rendering to another: every setting that changes a row's tokens or
targets (the loss switches, the chat template, the tokenizer, packing, seq_len), flipped alone, changes the dataset,
and the dataset built over a cache the other setting warmed equals the one built over an empty cache."""
import inspect
import json

import pytest
import torch

from aqpipe import data
from aqpipe.data.chat import tokenize_instruction
from tests.helpers.chat import CHATML, CONVERSATION, LLAMA3, chat_tokenizer

BASE = {"template": CHATML, "eos": "</s>", "seq_len": 24, "packing": False, "assistant_only_loss": True,
        "completion_only_loss": True}
FLIPS = {"template": LLAMA3, "eos": "<|im_end|>", "seq_len": 12, "packing": True, "assistant_only_loss": False,
         "completion_only_loss": False}


def rows() -> list[dict]:
    """Conversations, conversational prompt/completion pairs and plain ones: each loss switch moves some targets."""
    out = []
    for i in range(12):
        out.append({"messages": CONVERSATION[: 3 + 2 * (i % 2)]})
        out.append({"prompt": CONVERSATION[1:2], "completion": CONVERSATION[2:3]})
        out.append({"prompt": "hi there", "completion": " see you later"})
    return out


def build(path, settings: dict) -> dict[str, torch.Tensor]:
    tok = chat_tokenizer(settings["template"])
    tok.eos_token = settings["eos"]
    ds = data.lm_dataset(str(path), tok, settings["seq_len"], split="train", eval_fraction=0.1,
                         packing=settings["packing"], assistant_only_loss=settings["assistant_only_loss"],
                         completion_only_loss=settings["completion_only_loss"])
    return ds.tensors


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flip", sorted(FLIPS))
def test_each_setting_that_feeds_the_rendering_changes_it_and_never_reads_anothers_entry(tmp_path, monkeypatch, flip):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    flipped = {**BASE, flip: FLIPS[flip]}
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "warm"))
    base = build(path, BASE)  # warms the cache with the base settings' rendering
    warm = build(path, flipped)
    monkeypatch.setenv("AQPIPE_CACHE", str(tmp_path / "cold"))
    cold = build(path, flipped)
    assert not same(cold, base), f"{flip}: flipping it changed no token or target; the test's data cannot tell"
    assert same(warm, cold), f"{flip}: the cache served another setting's rendering"


def test_the_renderer_reads_nothing_the_key_does_not_hold():
    """rendering_key digests the tokenizer, its template, every field of LossOn and the rows: a new argument of the
    renderer is a setting the key must take too (then this list changes with it)."""
    assert list(inspect.signature(tokenize_instruction).parameters) == ["row", "tokenizer", "where", "loss"]


def test_a_cache_digest_counts_where_its_parts_end_and_the_root_expands_home(tmp_path, monkeypatch):
    from aqpipe.data.cache import cache_root, sha256_hex

    assert sha256_hex(b"ab", b"c") != sha256_hex(b"a", b"bc")  # a key's parts cannot slide into each other
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AQPIPE_CACHE", "~/caches")
    assert cache_root() == tmp_path / "caches"


def test_a_conversation_of_exactly_seq_len_tokens_fits_and_a_longer_one_is_cut_or_refused(tmp_path):
    from aqpipe.data.chat import encode_rows, tokenize_instruction

    tok = chat_tokenizer(CHATML)
    row = {"messages": CONVERSATION[1:3]}
    length = len(tokenize_instruction(row, tok, "row")[0])
    fits = encode_rows([row], tok, length, "chat.jsonl", overflow="error")
    assert fits.cut == 0 and len(fits.samples[0][0]) == length
    assert encode_rows([row], tok, length - 1, "chat.jsonl").cut == 1
    with pytest.raises(ValueError, match=f"chat.jsonl row 0: {length} tokens, longer than seq_len={length - 1}"):
        encode_rows([row], tok, length - 1, "chat.jsonl", overflow="error")


def test_a_bad_csv_row_is_named_by_its_line_in_the_file(tmp_path):
    """Line 1 is the header: the table's third row is the file's line 4."""
    from aqpipe.data.chat import row_namer

    path = tmp_path / "chat.csv"
    path.write_text("prompt,completion\na,b\nc,d\n,\n")
    assert row_namer(str(path))(2) == f"{path} line 4"


def test_the_built_in_chatml_asks_for_the_answer_on_a_line_of_its_own():
    """ChatML's published form: the generation prompt is `<|im_start|>assistant` and a newline, so the answer's
    first token is a target, not the newline."""
    from aqpipe.data.chat_templates import BUILTIN

    tok = chat_tokenizer(BUILTIN["chatml"])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
