"""Sequence-classification samples: the built-in tasks made from the plays (acceptability, next_line), GLUE from the
hub, or a local table in GLUE's column layouts, tokenized to fixed length, each with a stable `sample_id`."""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from .corpus import fetch_shakespeare, verse_runs
from .datasets import TensorDictDataset, check_seq_len, check_split, split_slice
from .sources import TABLE_FORMATS, hub_split, load_hub, load_table, local_file
from .tokens import cached
from aqpipe.compression.fields import check_int


BUILTIN_TASKS = ("acceptability", "next_line")


# GLUE task -> (text column, pair column or None, number of labels, evaluation split)
GLUE_TASKS: dict[str, tuple[str, str | None, int, str]] = {
    "cola": ("sentence", None, 2, "validation"),
    "sst2": ("sentence", None, 2, "validation"),
    "mrpc": ("sentence1", "sentence2", 2, "validation"),
    "qqp": ("question1", "question2", 2, "validation"),
    "mnli": ("premise", "hypothesis", 3, "validation_matched"),
    "qnli": ("question", "sentence", 2, "validation"),
    "rte": ("sentence1", "sentence2", 2, "validation"),
    "wnli": ("sentence1", "sentence2", 2, "validation"),
}


# the columns of a local table's text, tried in this order (pairs before singles): GLUE's own layouts
TEXT_LAYOUTS: tuple[tuple[str, str | None], ...] = (
    ("sentence1", "sentence2"),  # MRPC, RTE, WNLI
    ("question", "sentence"),  # QNLI
    ("question1", "question2"),  # QQP
    ("premise", "hypothesis"),  # MNLI
    ("text", "text_pair"),
    ("sentence", None),  # CoLA, SST-2
    ("text", None),
)


LABEL_COLUMNS = ("label", "labels")  # the first one present


COLUMN_FLAGS = "--text_column, --text_pair_column, --label_column"


# the built-in tasks' label names, by label id
BUILTIN_LABEL_NAMES = {"acceptability": ["unacceptable", "acceptable"], "next_line": ["not_next", "next"]}


Example = tuple[str, str | None, int]


Labeled = tuple[list[Example], int, list[str] | None]  # examples, number of labels, label names by id


def classification_dataset(task: Any, tokenizer: PreTrainedTokenizerBase, seq_len: int, split: str = "train",
                           *, seed: int = 0, eval_fraction: float = 0.05, max_samples: int | None = None,
                           text_path: str | Path | None = None, text_column: str | None = None,
                           text_pair_column: str | None = None, label_column: str | None = None) -> TensorDictDataset:
    """Sequence-classification samples padded (or truncated) to exactly `seq_len` tokens.

    `task`: "acceptability" (CoLA-like: a line of verse, label 1, or the same line's words
    shuffled, label 0) or "next_line" (QNLI-like pairs: label 1 if B follows A in the play, 0 if B
    is another line), both built from the Shakespeare corpus (or `text_path`), balanced and
    deterministic given `seed`; "glue/<name>" (cola, qnli, ... from the hub); or a local
    .csv/.json/.jsonl/.parquet file. A file's columns are found by GLUE's layouts (`TEXT_LAYOUTS`:
    sentence1+sentence2, question+sentence, ..., sentence, text) and its labels in 'label' (else
    'labels'); `text_column`, `text_pair_column` and `label_column` name others. Labels are
    integers 0..K-1 or strings (numbered in sorted order). `max_samples` caps the split.
    Items: input_ids, attention_mask, labels, sample_id, and token_type_ids where the tokenizer
    makes them. `num_labels`, `examples` and `label_names` are attributes of the result.
    """
    check_seq_len(seq_len)
    check_split(split, eval_fraction)
    if max_samples is not None:
        check_int("max_samples", max_samples, 2, what="None or an int >= 2")
    examples, num_labels, names = _classification_examples(task, split, seed, eval_fraction, max_samples, text_path,
                                                           text_column, text_pair_column, label_column)
    if not examples:
        raise ValueError(f"task {task!r} has no samples in the {split!r} split: expected a larger source "
                         "or a different eval_fraction")
    tensors = _encode_examples(examples, tokenizer, seq_len)
    return TensorDictDataset(tensors, seq_len=seq_len, split=split, num_labels=num_labels, examples=examples,
                             label_names=names)


def _classification_examples(task: Any, split: str, seed: int, eval_fraction: float, max_samples: int | None,
                             text_path: str | Path | None, text_column: str | None, text_pair_column: str | None,
                             label_column: str | None) -> Labeled:
    if not isinstance(task, str):  # a datasets.Dataset, or a DatasetDict with its own splits, from a user's script
        table, presplit = (task, False) if hasattr(task, "column_names") else hub_split(task, split, "the dataset")
        examples, num_labels, names = _table_examples(table, "the dataset given", text_column, text_pair_column,
                                                      label_column)
        if not presplit:
            order = np.random.default_rng([seed, 1]).permutation(len(examples))
            examples = [examples[i] for i in order[split_slice(len(order), split, eval_fraction)]]
        return (examples[:max_samples] if max_samples else examples), num_labels, names
    if task in BUILTIN_TASKS:
        corpus = Path(text_path).expanduser() if text_path is not None else fetch_shakespeare()
        if not corpus.is_file():
            raise FileNotFoundError(f"text_path={str(corpus)!r}: no such file (expected a plain-text corpus)")
        runs = _corpus_runs(str(corpus.resolve()), corpus.stat().st_mtime_ns, corpus.stat().st_size)
        rng = random.Random(f"{task}:{split}:{seed}")  # str seeds hash with SHA-512: same in every process
        build = _acceptability if task == "acceptability" else _next_line
        examples = build(runs[split_slice(len(runs), split, eval_fraction)], runs, rng, max_samples)
        return examples, 2, BUILTIN_LABEL_NAMES[task]
    if task.startswith("glue/"):
        examples, num_labels, names = _glue_examples(task, split)
    elif Path(task).suffix.lower() in TABLE_FORMATS or local_file(task) is not None:
        path = local_file(task)
        if path.suffix.lower() not in TABLE_FORMATS:
            raise ValueError(f"task file {task!r}: expected a .csv, .json, .jsonl or .parquet file")
        examples, num_labels, names = _table_examples(load_table(path), str(path), text_column, text_pair_column,
                                                      label_column)
        order = np.random.default_rng([seed, 1]).permutation(len(examples))  # files are often sorted by label
        examples = [examples[i] for i in order[split_slice(len(order), split, eval_fraction)]]
    else:
        raise ValueError(f"unknown classification task {task!r}: expected one of {BUILTIN_TASKS}, "
                         f"'glue/<name>' with name in {sorted(GLUE_TASKS)}, or a local .csv/.json/.jsonl/.parquet file")
    return (examples[:max_samples] if max_samples else examples), num_labels, names


@functools.lru_cache(maxsize=4)
def _corpus_runs(path: str, mtime_ns: int, size: int) -> list[list[str]]:
    """verse_runs of a corpus file, parsed once per process (train and eval both need them)."""
    return verse_runs(Path(path).read_text(encoding="utf-8"))


def _acceptability(runs: list[list[str]], all_runs: list[list[str]], rng: random.Random,
                   max_samples: int | None) -> list[Example]:
    """Half real lines (1), half other real lines with their words reordered (0); each line used once."""
    real = {line for run in all_runs for line in run}
    lines = list(dict.fromkeys(line for run in runs for line in run if len(set(line.split())) > 1))
    rng.shuffle(lines)
    half = len(lines) // 2
    positives = [(line, None, 1) for line in lines[:half]]
    negatives = [(text, None, 0) for text in (_shuffled(line, rng, real) for line in lines[half:]) if text]
    return _balanced(positives, negatives, rng, max_samples)


def _balanced(positives: list[Example], negatives: list[Example], rng: random.Random,
              max_samples: int | None) -> list[Example]:
    """As many of each label (at most max_samples in all), shuffled together."""
    count = min(len(positives), len(negatives), (max_samples or len(positives) + len(negatives)) // 2)
    examples = positives[:count] + negatives[:count]
    rng.shuffle(examples)
    return examples


def _shuffled(line: str, rng: random.Random, real: set[str], tries: int = 10) -> str | None:
    """`line` with its words in another order that is not itself a real line; None if none found."""
    words = line.split()
    for _ in range(tries):
        order = words[:]
        rng.shuffle(order)
        if order == words:  # rotating by one changes any sequence whose words are not all equal
            order = words[1:] + words[:1]
        candidate = " ".join(order)
        if candidate not in real:
            return candidate
    return None


def _next_line(runs: list[list[str]], all_runs: list[list[str]], rng: random.Random,
               max_samples: int | None) -> list[Example]:
    """Half (A, the line after A) labelled 1, half (A, a random line that never follows A) labelled 0."""
    followers: dict[str, set[str]] = {}
    for run in all_runs:
        for a, b in zip(run, run[1:]):
            followers.setdefault(a, set()).add(b)
    pairs = [(a, b) for run in runs for a, b in zip(run, run[1:])]
    pool = [line for run in runs for line in run]
    rng.shuffle(pairs)
    half = len(pairs) // 2
    positives = [(a, b, 1) for a, b in pairs[:half]]
    negatives = [(a, b, 0) for a, b in ((a, _other_line(a, pool, followers[a], rng)) for a, _ in pairs[half:]) if b]
    return _balanced(positives, negatives, rng, max_samples)


def _other_line(line: str, pool: list[str], followers: set[str], rng: random.Random, tries: int = 20) -> str | None:
    """A random line of `pool` that is neither `line` nor any line that follows it; None if none found."""
    for _ in range(tries):
        other = rng.choice(pool)
        if other != line and other not in followers:
            return other
    return None


def _glue_examples(task: str, split: str) -> Labeled:
    name = task.split("/", 1)[1]
    if name not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}: expected 'glue/<name>' with name in {sorted(GLUE_TASKS)}")
    first, second, num_labels, eval_split = GLUE_TASKS[name]
    splits = load_hub("glue", name)
    table = splits["train" if split == "train" else eval_split]
    examples, _, names = _table_examples(table, task, first, second, "label")
    return examples, num_labels, names


def table_columns(columns: Sequence[str], source: str, text_column: str | None = None,
                  text_pair_column: str | None = None, label_column: str | None = None) -> tuple[str, str | None, str]:
    """(text, pair or None, label) columns of a table: those named, the others found by `TEXT_LAYOUTS` (the
    first layout whose columns are all present; a named pair replaces the layout's) and `LABEL_COLUMNS`."""
    present = set(columns)
    text, pair, label = text_column, text_pair_column, label_column
    if text is None:
        layout = next(((a, b) for a, b in TEXT_LAYOUTS if a in present and (b is None or b in present)), None)
        if layout is not None:
            text, pair = layout[0], pair if pair is not None else layout[1]
    if label is None:
        label = next((c for c in LABEL_COLUMNS if c in present), None)
    missing = [f"{what} column {name!r}" if name is not None else f"{what} column"
               for what, name in (("text", text), ("pair", pair), ("label", label))
               if (name is not None and name not in present) or (name is None and what != "pair")]
    if missing:
        layouts = ", ".join("+".join(c for c in layout if c) for layout in TEXT_LAYOUTS)
        raise ValueError(f"{source}: no {' and no '.join(missing)} (columns found: {list(columns)}); tried the "
                         f"layouts {layouts} with labels in {' or '.join(LABEL_COLUMNS)}; name other columns with "
                         f"{COLUMN_FLAGS}")
    if len({text, pair, label} - {None}) < (3 if pair is not None else 2):
        raise ValueError(f"{source}: text {text!r}, pair {pair!r} and label {label!r} name the same column twice; "
                         f"expected different columns ({COLUMN_FLAGS})")
    return text, pair, label


def _table_examples(table: Any, source: str, text_column: str | None, text_pair_column: str | None,
                    label_column: str | None) -> Labeled:
    """(text, pair or None, label id) rows of a table, the number of labels and their names (None: bare
    integers without a ClassLabel feature)."""
    text, pair, label = table_columns(table.column_names, source, text_column, text_pair_column, label_column)
    feature = getattr(table, "features", {}).get(label)
    labels, num_labels, names = _label_ids(list(table[label]), source, getattr(feature, "names", None))
    pairs = table[pair] if pair else [None] * len(labels)
    rows = zip(table[text], pairs, labels)
    return [(str(a), None if b is None else str(b), y) for a, b, y in rows], num_labels, names


def _label_ids(values: list[Any], source: str,
               names: list[str] | None = None) -> tuple[list[int], int, list[str] | None]:
    """Integer labels as they are (0..K-1; named by a ClassLabel's `names` where given); string labels
    numbered in sorted order and named by themselves."""
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        if values and min(values) < 0:
            raise ValueError(f"{source}: label {min(values)} is negative: expected labels 0..K-1 "
                             "(a test split without labels cannot be trained on)")
        count = max(values) + 1 if values else 0
        if names and len(names) >= count:
            return [int(v) for v in values], len(names), list(names)
        return [int(v) for v in values], count, None
    if all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
        return [index[v] for v in values], len(names), names
    raise ValueError(f"{source}: labels of types {sorted({type(v).__name__ for v in values})}: "
                     "expected all integers or all strings")


def _encode_examples(examples: list[Example], tokenizer: PreTrainedTokenizerBase,
                     seq_len: int) -> dict[str, torch.Tensor]:
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token: expected one to pad samples to seq_len "
                         "(load_tokenizer sets it; else set tokenizer.pad_token)")
    paired = any(b is not None for _, b, _ in examples)
    needed = tokenizer.num_special_tokens_to_add(pair=paired) + (2 if paired else 1)
    if seq_len < needed:
        raise ValueError(f"seq_len={seq_len}: expected at least {needed} to hold the special tokens "
                         "and some text")
    parts = [b"classification", str(seq_len).encode(), json.dumps(examples).encode("utf-8")]
    return cached(tokenizer, parts, lambda: _tokenize_examples(examples, tokenizer, seq_len, paired))


def _tokenize_examples(examples: list[Example], tokenizer: PreTrainedTokenizerBase, seq_len: int,
                       paired: bool) -> dict[str, torch.Tensor]:
    firsts = [a for a, _, _ in examples]
    seconds = [b or "" for _, b, _ in examples] if paired else None
    enc = tokenizer(firsts, seconds, truncation=True, max_length=seq_len, padding="max_length")
    # lists -> numpy -> torch: return_tensors="pt" takes twice as long on a large split
    tensors = {name: torch.from_numpy(np.asarray(enc[name], dtype=np.int64))
               for name in ("input_ids", "attention_mask", "token_type_ids") if name in enc}
    tensors["labels"] = torch.tensor([y for _, _, y in examples], dtype=torch.int64)
    tensors["sample_id"] = torch.arange(len(examples), dtype=torch.int64)
    return tensors
