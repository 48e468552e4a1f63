"""Fixed-length samples with stable ids (`sample_id` = dataset index): causal-LM text from a local file, the
hub or the corpus, and sequence classification from the built-in tasks, GLUE or a local table."""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import random
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:  # transformers and datasets take seconds to import: only where used
    from transformers import PreTrainedTokenizerBase

from .cache import atomic_write, cache_root, sha256_hex
from .corpus import fetch_shakespeare, verse_runs


SPLITS = ("train", "eval")
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
_TABLE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_TEXT_SUFFIXES = frozenset({".txt", ".text"})
_HUB_DEFAULT_CONFIGS = {"wikitext": "wikitext-2-raw-v1"}
_CHUNK_CHARS = 2000  # plain text is tokenized in line-aligned chunks, in parallel
_BATCH_TEXTS = 1024  # chunks (or table rows) per tokenizer call


class TensorDictDataset(Dataset):
    """Samples as rows of equally long tensors; `batch()` gathers many rows with one index per field.

    `seq_len`, `split`, and for classification `num_labels`, `examples` (the texts and labels
    before tokenization, in sample_id order) and `label_names` (the name of each label id, where the
    data has names: string labels, a ClassLabel feature, the built-in tasks; None for bare integers)
    describe what it holds.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], *, seq_len: int, split: str,
                 num_labels: int | None = None, examples: list[tuple[str, str | None, int]] | None = None,
                 label_names: list[str] | None = None):
        lengths = {name: len(t) for name, t in tensors.items()}
        if "sample_id" not in tensors:
            raise ValueError(f"fields {sorted(tensors)}: expected a 'sample_id' field")
        if len(set(lengths.values())) != 1:
            raise ValueError(f"fields of different lengths {lengths}: expected one row per sample in each")
        self.tensors, self.seq_len, self.split = tensors, seq_len, split
        self.num_labels, self.examples, self.label_names = num_labels, examples, label_names

    def __len__(self) -> int:
        return len(self.tensors["sample_id"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}

    def batch(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """The samples at `indices`, stacked: each field gets a leading batch dimension."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.int64)
        return {name: t.index_select(0, idx) for name, t in self.tensors.items()}


def limit(dataset: Dataset, max_samples: int | None) -> Dataset:
    """The first `max_samples` samples (all for None): sample ids 0..n-1 stay those of the full split,
    so a shorter run sees a prefix of the same data."""
    if max_samples is None:
        return dataset
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
        raise ValueError(f"max_samples={max_samples!r}: expected None or an int >= 1")
    if max_samples >= len(dataset):
        return dataset
    if not isinstance(dataset, TensorDictDataset):
        return torch.utils.data.Subset(dataset, range(max_samples))
    examples = dataset.examples[:max_samples] if dataset.examples is not None else None
    return TensorDictDataset({name: t[:max_samples] for name, t in dataset.tensors.items()}, seq_len=dataset.seq_len,
                             split=dataset.split, num_labels=dataset.num_labels, examples=examples,
                             label_names=dataset.label_names)


def lm_dataset(text_path_or_name: str | Path | None, tokenizer: PreTrainedTokenizerBase, seq_len: int,
               split: str = "train", eval_fraction: float = 0.05, *, text_column: str | None = None,
               dataset_config: str | None = None) -> TensorDictDataset:
    """Causal-LM samples: the text tokenized and cut into blocks of exactly `seq_len` tokens.

    Sources: None or "shakespeare" (built in), a local .txt, .json/.jsonl, .csv or .parquet file
    (text from `text_column`; None: 'text', else the table's one string column; each row is a
    document, followed by the eos token), or a hub dataset
    name with `dataset_config` (wikitext defaults to wikitext-2-raw-v1). The last `eval_fraction`
    of the blocks form the "eval" split (a hub dataset's own validation split where it has one).
    Items: input_ids, attention_mask (ones), labels (= input_ids; the model shifts), sample_id.
    """
    _check_seq_len(seq_len)
    _check_split(split, eval_fraction)
    documents, presplit = _lm_documents(text_path_or_name, split, text_column, dataset_config)
    ids = _token_stream(documents, tokenizer)
    count = len(ids) // seq_len
    blocks = torch.from_numpy(ids[: count * seq_len]).view(count, seq_len)
    if not presplit:
        blocks = blocks[_split_slice(count, split, eval_fraction)]
    if len(blocks) == 0:
        raise ValueError(f"text {_describe(text_path_or_name)} has {len(ids)} tokens: {count} blocks of "
                         f"seq_len={seq_len}, none left for the {split!r} split; expected a longer text "
                         "or a smaller seq_len")
    tensors = {"input_ids": blocks, "attention_mask": torch.ones_like(blocks), "labels": blocks.clone(),
               "sample_id": torch.arange(len(blocks), dtype=torch.int64)}
    return TensorDictDataset(tensors, seq_len=seq_len, split=split)


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an int >= 2")


def _check_split(split: str, eval_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r}: expected a fraction in [0, 1)")
    if split == "eval" and eval_fraction == 0:
        raise ValueError("split='eval' with eval_fraction=0: expected eval_fraction > 0 to have an eval split")


def _split_slice(count: int, split: str, eval_fraction: float) -> slice:
    """The train part is the first rows, the eval part the last ceil(count * eval_fraction)."""
    n_eval = min(count, math.ceil(count * eval_fraction))
    return slice(0, count - n_eval) if split == "train" else slice(count - n_eval, count)


def _describe(source: Any) -> str:
    return "'shakespeare' (built in)" if source in (None, "shakespeare") else repr(str(source))


def _local_file(source: str | Path) -> Path | None:
    """The local file `source` names; None for a hub name. A missing path is an error."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ValueError(f"{str(source)!r} is a directory: expected a file (.txt, .json, .jsonl, .csv, .parquet)")
    text = str(source)
    if isinstance(source, Path) or text.startswith(("/", "./", "../", "~")) or \
            path.suffix.lower() in _TEXT_SUFFIXES | set(_TABLE_FORMATS):
        raise FileNotFoundError(f"{text!r}: no such file (expected a local .txt, .json, .jsonl, .csv "
                                "or .parquet file, or a hub dataset name)")
    return None


def _lm_documents(source: str | Path | None, split: str, text_column: str | None,
                  dataset_config: str | None) -> tuple[str | list[str], bool]:
    """The source's text (one string) or rows (a list), and whether they already are the requested
    split (a hub dataset's own split)."""
    if source is None or str(source) == "shakespeare":
        return fetch_shakespeare().read_text(encoding="utf-8"), False
    path = _local_file(source)
    if path is not None:
        suffix = path.suffix.lower()
        if suffix in _TEXT_SUFFIXES:
            return path.read_text(encoding="utf-8"), False
        if suffix in _TABLE_FORMATS:
            return _text_column(_load_table(path), text_column, str(path)), False
        raise ValueError(f"{str(path)!r}: unsupported file type {suffix!r}; expected one of "
                         f"{sorted(_TEXT_SUFFIXES | set(_TABLE_FORMATS))}")
    name = str(source)
    config = dataset_config or _HUB_DEFAULT_CONFIGS.get(name)
    splits = _load_hub(name, config)
    table, presplit = _hub_split(splits, split, name)
    return _text_column(table, text_column, f"{name} ({config})"), presplit


def _load_table(path: Path) -> Any:
    """A local json/csv/parquet file as a `datasets.Dataset`."""
    from datasets import load_dataset

    return load_dataset(_TABLE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")


def _load_hub(name: str, config: str | None) -> Any:
    """All splits of a hub dataset, or a clear error naming what was asked for."""
    from datasets import load_dataset

    try:
        return load_dataset(name, config)
    except Exception as err:  # offline, unknown name, bad config: all end here, with the cause chained
        raise ValueError(f"could not load dataset {name!r} (config {config!r}) from the HuggingFace hub: "
                         f"{type(err).__name__}: {err}. Expected 'shakespeare', a local .txt, .json, .jsonl, "
                         ".csv or .parquet file, or a reachable hub dataset") from err


def _hub_split(splits: Any, split: str, name: str) -> tuple[Any, bool]:
    """Our split from a hub DatasetDict: its train / validation (or test) where present."""
    if split == "train" or set(splits) == {"train"}:
        if "train" not in splits:
            raise ValueError(f"dataset {name!r} has splits {sorted(splits)}: expected a 'train' split")
        return splits["train"], split == "train" and set(splits) != {"train"}
    for candidate in ("validation", "test"):
        if candidate in splits:
            return splits[candidate], True
    raise ValueError(f"dataset {name!r} has splits {sorted(splits)}: expected 'validation' or 'test' for eval")


def _text_column(table: Any, column: str | None, source: str) -> list[str]:
    """The non-empty texts of `column`; None: 'text', else the table's one string column."""
    columns = table.column_names
    if column is None:
        strings = [name for name in columns if _is_string_column(table, name)]
        column = "text" if "text" in columns else strings[0] if len(strings) == 1 else None
        if column is None:
            raise ValueError(f"{source}: no column 'text' and {len(strings)} string columns {strings} "
                             f"(columns found: {columns}); expected a 'text' column or exactly one string "
                             "column, or name it with --text_column")
    if column not in columns:
        raise ValueError(f"{source}: no column {column!r} (columns found: {columns}); name the text column "
                         "with --text_column")
    return [text for text in table[column] if isinstance(text, str) and text.strip()]


def _is_string_column(table: Any, name: str) -> bool:
    """Whether a table's column holds text: its feature is a string Value (or, untyped, its values are str)."""
    feature = getattr(table, "features", {}).get(name)
    dtype = getattr(feature, "dtype", None)
    if isinstance(dtype, str) and not hasattr(feature, "names"):
        return dtype in ("string", "large_string")
    values = [v for v in table[:100][name] if v is not None]
    return bool(values) and all(isinstance(v, str) for v in values)


def _token_stream(documents: str | list[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """The token ids of a text, or of table rows each followed by eos, in one vector; cached on disk."""
    rows = not isinstance(documents, str)
    parts = [b"rows" if rows else b"text", *(d.encode("utf-8") for d in (documents if rows else [documents]))]
    build = lambda: {"ids": torch.from_numpy(_tokenize_documents(documents, tokenizer))}  # noqa: E731
    return _cached(tokenizer, parts, build)["ids"].to(torch.int64).numpy()


def _cached(tokenizer: PreTrainedTokenizerBase, parts: list[bytes],
            build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Tensors that tokenizing produced before for the same inputs and tokenizer, else `build()`,
    saved under `cache_root() / "tokens"`. Tokenizing a corpus takes seconds on 2 cores and every
    rank does it at start. Tokenizers without a `backend_tokenizer` are not cached."""
    fingerprint = _tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return build()
    path = cache_root() / "tokens" / f"{sha256_hex(fingerprint.encode(), *parts)[:32]}.pt"
    if path.is_file():
        with contextlib.suppress(Exception):  # unreadable (another version's format): rebuild
            return {name: t.to(torch.int64) for name, t in torch.load(path, weights_only=True).items()}
    tensors = build()
    with tempfile.TemporaryFile() as buffer:
        torch.save({name: _narrow(t) for name, t in tensors.items()}, buffer)
        buffer.seek(0)
        atomic_write(path, buffer.read())
    return tensors


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """The smallest of uint8 / int32 / int64 that holds `t` exactly: caches of masks and ids shrink 8x / 2x."""
    if t.numel() == 0:
        return t
    low, high = int(t.min()), int(t.max())
    if 0 <= low and high < 2**8:
        return t.to(torch.uint8)
    return t.to(torch.int32) if -2**31 <= low and high < 2**31 else t


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A digest of a fast tokenizer's definition and the settings that change its output; None
    for tokenizers without a `backend_tokenizer`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    definition = json.loads(backend.to_str())
    for state in ("truncation", "padding"):  # set by the last call with truncation/padding: not identity
        definition.pop(state, None)
    settings = (tokenizer.eos_token_id, tokenizer.pad_token_id, list(tokenizer.model_input_names),
                tokenizer.padding_side, tokenizer.truncation_side)
    return sha256_hex(json.dumps(definition, sort_keys=True).encode("utf-8"), repr(settings).encode())


def _tokenize_documents(documents: str | list[str], tokenizer: PreTrainedTokenizerBase,
                        batch_texts: int = _BATCH_TEXTS) -> np.ndarray:
    """One long text in line-aligned chunks, or table rows each followed by eos (where the tokenizer has one),
    `batch_texts` at a time: a tokenizer's output for a whole 121 MB corpus at once peaked at 6.2 GB; in batches
    memory stays near the text's own size. A bar shows progress when it takes more than a few seconds."""
    from tqdm import tqdm

    rows = not isinstance(documents, str)
    eos = [tokenizer.eos_token_id] if rows and tokenizer.eos_token_id is not None else []
    texts = iter(documents) if rows else _line_chunks(documents)
    total = sum(len(d) for d in documents) if rows else len(documents)
    pieces = []
    with tqdm(total=total, desc="tokenizing", unit="char", unit_scale=True, delay=3, leave=False) as bar:
        while batch := list(itertools.islice(texts, batch_texts)):
            ids = _encode(tokenizer, batch)
            pieces.append(np.fromiter(itertools.chain.from_iterable(i + eos for i in ids), dtype=np.int32))
            bar.update(sum(len(t) for t in batch))
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"] if texts else []


def _line_chunks(text: str, size: int = _CHUNK_CHARS) -> Iterator[str]:
    """`text` in pieces of at least `size` characters that end at line ends (byte-level BPE never merges
    across a newline followed by a letter, so this hardly changes the tokens), one at a time."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size - 1)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


Example = tuple[str, str | None, int]
Labeled = tuple[list[Example], int, list[str] | None]  # examples, number of labels, label names by id


def classification_dataset(task: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, split: str = "train",
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
    _check_seq_len(seq_len)
    _check_split(split, eval_fraction)
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 2):
        raise ValueError(f"max_samples={max_samples!r}: expected None or an int >= 2")
    examples, num_labels, names = _classification_examples(task, split, seed, eval_fraction, max_samples, text_path,
                                                           text_column, text_pair_column, label_column)
    if not examples:
        raise ValueError(f"task {task!r} has no samples in the {split!r} split: expected a larger source "
                         "or a different eval_fraction")
    tensors = _encode_examples(examples, tokenizer, seq_len)
    return TensorDictDataset(tensors, seq_len=seq_len, split=split, num_labels=num_labels, examples=examples,
                             label_names=names)


def _classification_examples(task: str, split: str, seed: int, eval_fraction: float, max_samples: int | None,
                             text_path: str | Path | None, text_column: str | None, text_pair_column: str | None,
                             label_column: str | None) -> Labeled:
    if task in BUILTIN_TASKS:
        corpus = Path(text_path).expanduser() if text_path is not None else fetch_shakespeare()
        if not corpus.is_file():
            raise FileNotFoundError(f"text_path={str(corpus)!r}: no such file (expected a plain-text corpus)")
        runs = _corpus_runs(str(corpus.resolve()), corpus.stat().st_mtime_ns, corpus.stat().st_size)
        rng = random.Random(f"{task}:{split}:{seed}")  # str seeds hash with SHA-512: same in every process
        build = _acceptability if task == "acceptability" else _next_line
        examples = build(runs[_split_slice(len(runs), split, eval_fraction)], runs, rng, max_samples)
        return examples, 2, BUILTIN_LABEL_NAMES[task]
    if task.startswith("glue/"):
        examples, num_labels, names = _glue_examples(task, split)
    elif Path(task).suffix.lower() in _TABLE_FORMATS or _local_file(task) is not None:
        path = _local_file(task)
        if path.suffix.lower() not in _TABLE_FORMATS:
            raise ValueError(f"task file {task!r}: expected a .csv, .json, .jsonl or .parquet file")
        examples, num_labels, names = _table_examples(_load_table(path), str(path), text_column, text_pair_column,
                                                      label_column)
        order = np.random.default_rng([seed, 1]).permutation(len(examples))  # files are often sorted by label
        examples = [examples[i] for i in order[_split_slice(len(order), split, eval_fraction)]]
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
    splits = _load_hub("glue", name)
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
    return _cached(tokenizer, parts, lambda: _tokenize_examples(examples, tokenizer, seq_len, paired))


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


