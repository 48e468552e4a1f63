"""Instruction data: conversations (a `messages` column of role/content turns) rendered with the tokenizer's own
chat template, or `prompt`/`completion` pairs, with the loss on the assistant's (the completion's) tokens alone.

Real templates (Llama 3, Qwen) mark no generation spans, so the assistant's spans are found by rendering prefixes:
the conversation up to an assistant turn with the generation prompt ends where that turn's text starts, and the
conversation up to and including it ends where the turn ends (its end-of-turn token is a target, as a model must
learn to stop). Tokens are matched to those character spans through the tokenizer's offsets, so any template
whose renders of a conversation's prefixes are prefixes of its render works; one that is not gets one line.

One conversation per sample, padded to seq_len (labels -100 on padding, attention mask 0), or with `packing` many
per sample (packing.py: block-diagonal attention through position ids that restart with each conversation). A
conversation longer than seq_len is cut (counted: `Instructions.cut`), or refused with `overflow="error"`; one left
with no target is dropped.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from .cache import atomic_file, atomic_write, cache_root, sha256_hex
from .tokens import tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100  # the label of a token that is not a target (HF's loss ignores it)
ROLES = ("system", "user", "assistant", "tool")


def is_instruction_table(columns: list[str]) -> bool:
    """A table of conversations (`messages`) or of prompt/completion pairs."""
    return "messages" in columns or {"prompt", "completion"} <= set(columns)


def assistant_spans(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, where: str
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    _check_messages(messages, where)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat_template; expected --chat_template (chatml, llama3 or a "
                         "Jinja file), a model whose tokenizer has one (its tokenizer_config.json or "
                         "chat_template.jinja), or prompt/completion columns")
    text = _render(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True) if i else ""
        end = _render(tokenizer, messages[:i + 1], False)
        if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
            raise ValueError(f"{where}: the chat template renders turn {i} differently alone than within the "
                             "conversation, so its assistant tokens cannot be found; expected a template whose "
                             "renders of a conversation's first turns begin its render")
        spans.append((len(start), len(end)))
    return text, spans


def encode_instruction(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, seq_len: int, where: str
                       ) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) of one row, cut to seq_len; None when no target token is left."""
    return _cut(tokenize_instruction(row, tokenizer, where), seq_len)


def _cut(sample: tuple[list[int], list[int]], seq_len: int) -> tuple[list[int], list[int]] | None:
    ids, labels = sample[0][:seq_len], sample[1][:seq_len]
    return (ids, labels) if any(v != IGNORE for v in labels[1:]) else None  # position 0 is never predicted


def tokenize_instruction(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, where: str
                         ) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one row, whole."""
    if row.get("messages") is None and ("messages" in row or "prompt" not in row):  # a table fills a missing key
        found = sorted(k for k, v in row.items() if v is not None)
        raise ValueError(f"{where}: no 'messages' (its keys: {', '.join(found) or 'none'}); expected a list of "
                         "{role, content} turns, or prompt and completion")
    if "messages" in row:
        text, spans = assistant_spans(row["messages"], tokenizer, where)
    else:
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: prompt={prompt!r}, completion={completion!r}: expected two strings")
        eos = tokenizer.eos_token or ""
        text, spans = prompt + completion + eos, [(len(prompt), len(prompt) + len(completion) + len(eos))]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    ids = encoded["input_ids"]
    labels = [token if any(lo <= start < hi for lo, hi in spans) else IGNORE
              for token, (start, _) in zip(ids, encoded["offset_mapping"])]
    return ids, labels


def row_namer(where: str) -> Callable[[int], str]:
    """Row i of a table as its user finds it: its line in a JSONL file (blank lines, which the loader skips, counted)
    or a CSV file (after the header), else its index in the table."""
    path = Path(where)
    if path.suffix.lower() == ".jsonl" and path.is_file():
        with path.open(encoding="utf-8") as f:
            lines = [n for n, text in enumerate(f, start=1) if text.strip()]
        return lambda i: f"{where} line {lines[i]}" if i < len(lines) else f"{where} row {i}"
    if path.suffix.lower() == ".csv":
        return lambda i: f"{where} line {i + 2}"
    return lambda i: f"{where} row {i}"


OVERFLOWS = ("truncate", "error")  # what a conversation longer than seq_len gets


@dataclass
class Instructions:
    """A table's rows as (input ids, labels), each at most seq_len tokens (rows with no target left dropped), and
    how many were cut to fit."""

    samples: list[tuple[list[int], list[int]]]
    cut: int


def encode_rows(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, seq_len: int, where: str,
                overflow: str = "truncate") -> Instructions:
    """Every row tokenized, cut to seq_len (or refused naming the first that is longer, with overflow="error")."""
    if overflow not in OVERFLOWS:
        raise ValueError(f"packing_overflow={overflow!r}: expected one of {', '.join(OVERFLOWS)}")
    name, samples, cut = row_namer(where), [], 0
    for i, whole in enumerate(rendered_rows(rows, tokenizer, name)):
        if len(whole[0]) > seq_len:
            if overflow == "error":
                raise ValueError(f"{name(i)}: {len(whole[0])} tokens, longer than seq_len={seq_len}; expected rows "
                                 "that fit (or --packing_overflow truncate to cut them)")
            cut += 1
        sample = _cut(whole, seq_len)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ValueError(f"{where}: none of its {len(rows)} rows has an assistant token within seq_len={seq_len}; "
                         "expected assistant turns (or completions) that fit")
    return Instructions(samples, cut)


def rendered_rows(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, name: Callable[[int], str]
                  ) -> Iterator[tuple[list[int], list[int]]]:
    """Each row's (input ids, labels), whole, from the cache where this data was rendered before with the same
    tokenizer and template: rendering every assistant turn's prefixes is the slow part of a chat set's start, and
    every rank of a machine would repeat it. Keyed by the rows, the tokenizer and the template (whole rows: any
    seq_len reads the same entry); built once per machine (three files written whole, the offsets last),
    memory-mapped after; a tokenizer that cannot be fingerprinted is not cached."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        yield from (tokenize_instruction(row, tokenizer, name(i)) for i, row in enumerate(rows))
        return
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True)
    key = sha256_hex(b"chat", fingerprint.encode(), (template or "").encode(),
                     json.dumps(rows, sort_keys=True, default=str).encode())[:32]
    base = cache_root() / "chat" / key
    offsets_path = base.with_suffix(".offsets.npy")
    if not offsets_path.is_file():
        encoded = [tokenize_instruction(row, tokenizer, name(i)) for i, row in enumerate(rows)]
        lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
        for suffix, column in ((".ids.bin", 0), (".labels.bin", 1)):
            atomic_write(base.with_suffix(suffix), np.fromiter(
                itertools.chain.from_iterable(row[column] for row in encoded), dtype=np.int32,
                count=int(lengths.sum())).tobytes())
        with atomic_file(offsets_path) as f:
            np.save(f, np.concatenate([[0], np.cumsum(lengths)]))
        yield from encoded
        return
    offsets = np.load(offsets_path)
    if offsets[-1] == 0:  # no rows: nothing to map
        return
    ids, labels = (np.memmap(base.with_suffix(s), dtype=np.int32, mode="r") for s in (".ids.bin", ".labels.bin"))
    for a, b in zip(offsets[:-1], offsets[1:]):
        yield ids[a:b].tolist(), labels[a:b].tolist()


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0


def padded(samples: list[tuple[list[int], list[int]]], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """One sequence per sample, padded to seq_len: input_ids, attention_mask, labels."""
    ids = torch.full((len(samples), seq_len), pad, dtype=torch.int64)
    labels = torch.full((len(samples), seq_len), IGNORE, dtype=torch.int64)
    mask = torch.zeros((len(samples), seq_len), dtype=torch.int64)
    for n, (tokens, targets) in enumerate(samples):
        ids[n, :len(tokens)] = torch.tensor(tokens)
        labels[n, :len(targets)] = torch.tensor(targets)
        mask[n, :len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages={messages!r}: expected a list of {{role, content}} turns")
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: turn {turn!r}: expected role one of {', '.join(ROLES)} and string content")
