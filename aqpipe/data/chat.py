"""Instruction data in the layouts TRL and axolotl users bring: conversations (a `messages` column of role/content
turns, or ShareGPT's `conversations` of from/value), rendered with the tokenizer's own chat template (with a row's
`tools` where it has them), and prompt/completion pairs (two strings, or two lists of turns). The loss falls where
TRL's `assistant_only_loss` and `completion_only_loss` put it (`LossOn`): on the assistant's turns, on the
completion, or on every token.

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

import dataclasses
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
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool"}  # ShareGPT's `from` -> a chat template's role
FORMATS = ("messages (a list of {role, content} turns)", "conversations (ShareGPT: a list of {from, value} turns)",
           "prompt and completion (two strings, or two lists of {role, content} turns)")


@dataclass(frozen=True)
class LossOn:
    """Which of a row's tokens the loss falls on, as TRL's SFTConfig says it. `assistant_only`: a conversation's
    assistant turns alone (else every token); `completion_only`: a prompt/completion row's completion alone (else
    the prompt too). Both on a conversational prompt/completion: the completion's assistant turns."""

    assistant_only: bool = True
    completion_only: bool = True


def is_instruction_table(columns: list[str]) -> bool:
    """A table of conversations (`messages`, ShareGPT's `conversations`) or of prompt/completion pairs."""
    return "messages" in columns or "conversations" in columns or {"prompt", "completion"} <= set(columns)


def assistant_spans(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, where: str,
                    tools: list[Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    _check_messages(messages, where)
    messages = [{k: v for k, v in turn.items() if v is not None} for turn in messages]  # a table fills missing keys
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat_template; expected --chat_template (chatml, llama3 or a "
                         "Jinja file), a model whose tokenizer has one (its tokenizer_config.json or "
                         "chat_template.jinja), or prompt/completion columns")
    text = _render(tokenizer, messages, False, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True, tools) if i else ""
        end = _render(tokenizer, messages[:i + 1], False, tools)
        if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
            raise ValueError(f"{where}: the chat template renders turn {i} differently alone than within the "
                             "conversation, so its assistant tokens cannot be found; expected a template whose "
                             "renders of a conversation's first turns begin its render")
        spans.append((len(start), len(end)))
    return text, spans


def encode_instruction(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, seq_len: int, where: str,
                       loss: LossOn = LossOn()) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) of one row, cut to seq_len; None when no target token is left."""
    return _cut(tokenize_instruction(row, tokenizer, where, loss), seq_len)


def _cut(sample: tuple[list[int], list[int]], seq_len: int) -> tuple[list[int], list[int]] | None:
    ids, labels = sample[0][:seq_len], sample[1][:seq_len]
    return (ids, labels) if any(v != IGNORE for v in labels[1:]) else None  # position 0 is never predicted


def tokenize_instruction(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, where: str,
                         loss: LossOn = LossOn()) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one row, whole."""
    text, spans = _text_and_targets(row, tokenizer, where, loss)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    ids = encoded["input_ids"]
    labels = [token if any(lo <= start < hi for lo, hi in spans) else IGNORE
              for token, (start, _) in zip(ids, encoded["offset_mapping"])]
    return ids, labels


def _text_and_targets(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, where: str, loss: LossOn
                      ) -> tuple[str, list[tuple[int, int]]]:
    """A row rendered, and the character spans its loss falls on."""
    tools = _tools(row, where)
    if row.get("messages") is not None or row.get("conversations") is not None:
        messages = row["messages"] if row.get("messages") is not None else \
            sharegpt_messages(row["conversations"], where)
        text, assistant = assistant_spans(messages, tokenizer, where, tools)
        return text, assistant if loss.assistant_only else [(0, len(text))]
    prompt, completion = row.get("prompt"), row.get("completion")
    if prompt is None or completion is None:  # a table fills a missing key
        found = sorted(k for k, v in row.items() if v is not None)
        raise ValueError(f"{where}: fits no format (its keys: {', '.join(found) or 'none'}); expected one of "
                         f"{'; '.join(FORMATS)}")
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational: both lists of turns
        _check_messages(completion, where)
        text, assistant = assistant_spans([*prompt, *completion], tokenizer, where, tools)
        asked = _render(tokenizer, prompt, True, tools)
        if not text.startswith(asked):
            raise ValueError(f"{where}: the chat template renders the prompt with its generation prompt differently "
                             "than within the conversation, so the completion cannot be found; expected a template "
                             "whose render of the prompt begins the whole render")
        spans = [(len(asked), len(text))] if loss.completion_only else [(0, len(text))]
        return text, _overlap(spans, assistant) if loss.assistant_only else spans
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ValueError(f"{where}: prompt={prompt!r}, completion={completion!r}: expected two strings or two lists "
                         "of {role, content} turns")
    eos = tokenizer.eos_token or ""
    text = prompt + completion + eos
    return text, [(len(prompt) if loss.completion_only else 0, len(text))]


def sharegpt_messages(turns: Any, where: str) -> list[dict[str, Any]]:
    """ShareGPT's turns ({from, value}: human, gpt, system, tool) as a chat template's {role, content}; turns that
    already are {role, content} pass as they are (a `conversations` column in the messages layout)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: conversations={turns!r}: expected a list of {{from, value}} turns")
    if all(isinstance(t, dict) and t.get("from") is None and "role" in t for t in turns):
        return turns
    out = []
    for turn in turns:
        source = turn.get("from") if isinstance(turn, dict) else None
        if source not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise ValueError(f"{where}: turn {turn!r}: expected from one of {', '.join(SHAREGPT_ROLES)} and a string "
                             "value")
        out.append({"role": SHAREGPT_ROLES[source], "content": turn["value"]})
    return out


def _tools(row: dict[str, Any], where: str) -> list[Any] | None:
    """A row's `tools` (JSON schemas, as a list or its JSON text), for templates that render them; None without."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: tools is not JSON ({exc.msg}); expected a list of function schemas") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: tools={tools!r}: expected a list of function schemas")
    return tools or None


def _overlap(spans: list[tuple[int, int]], others: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The character ranges in both lists of spans."""
    return [(max(a, c), min(b, d)) for a, b in spans for c, d in others if max(a, c) < min(b, d)]


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
                overflow: str = "truncate", loss: LossOn = LossOn()) -> Instructions:
    """Every row tokenized, cut to seq_len (or refused naming the first that is longer, with overflow="error")."""
    if overflow not in OVERFLOWS:
        raise ValueError(f"packing_overflow={overflow!r}: expected one of {', '.join(OVERFLOWS)}")
    name, samples, cut = row_namer(where), [], 0
    for i, whole in enumerate(rendered_rows(rows, tokenizer, name, loss)):
        if len(whole[0]) > seq_len:
            if overflow == "error":
                raise ValueError(f"{name(i)}: {len(whole[0])} tokens, longer than seq_len={seq_len}; expected rows "
                                 "that fit (or --packing_overflow truncate to cut them)")
            cut += 1
        sample = _cut(whole, seq_len)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ValueError(f"{where}: none of its {len(rows)} rows has a target token within seq_len={seq_len}; "
                         "expected assistant turns (or completions) that fit")
    return Instructions(samples, cut)


def rendered_rows(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, name: Callable[[int], str],
                  loss: LossOn = LossOn()) -> Iterator[tuple[list[int], list[int]]]:
    """Each row's (input ids, labels), whole, from the cache where this data was rendered before with the same
    tokenizer and template: rendering every assistant turn's prefixes is the slow part of a chat set's start, and
    every rank of a machine would repeat it. Keyed by the rows, the tokenizer, the template and where the loss
    falls (whole rows: any
    seq_len reads the same entry); built once per machine (three files written whole, the offsets last),
    memory-mapped after; a tokenizer that cannot be fingerprinted is not cached."""
    key = rendering_key(rows, tokenizer, loss)
    if key is None:
        yield from (tokenize_instruction(row, tokenizer, name(i), loss) for i, row in enumerate(rows))
        return
    base = cache_root() / "chat" / key
    offsets_path = base.with_suffix(".offsets.npy")
    if not offsets_path.is_file():
        encoded = [tokenize_instruction(row, tokenizer, name(i), loss) for i, row in enumerate(rows)]
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


def rendering_key(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, loss: LossOn) -> str | None:
    """The cache key of `rows` rendered: a digest of everything `tokenize_instruction` reads besides a row's name,
    each whole (the tokenizer's definition and chat template, every field of `loss`, the rows), so that no setting
    feeding the rendering can be left out of it; None for a tokenizer that cannot be fingerprinted. seq_len and
    packing apply to the whole rows after: any of them reads the same entry."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return None
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True)
    parts = {"tokenizer": fingerprint, "chat_template": template, "loss": dataclasses.asdict(loss), "rows": rows}
    return sha256_hex(b"chat", json.dumps(parts, sort_keys=True, default=str).encode())[:32]


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


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], prompt: bool,
            tools: list[Any] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages={messages!r}: expected a list of {{role, content}} turns")
    for turn in messages:  # an assistant's tool call may come without content (TRL's tool-calling layout)
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not (
                isinstance(turn.get("content"), str) or (turn.get("content") is None and turn.get("tool_calls"))):
            raise ValueError(f"{where}: turn {turn!r}: expected role one of {', '.join(ROLES)} and string content "
                             "(or tool_calls)")
