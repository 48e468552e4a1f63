"""Text to token ids: documents tokenized in line-aligned chunks, in parallel, and cached on disk by the text's and
the tokenizer's digests, so processes that start together build the cache once: a corpus's ids as a memory-mapped
token file (`token_file`), a classification set's tensors as a torch file (`cached`)."""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import torch

if TYPE_CHECKING:  # transformers takes seconds to import: only where used
    from transformers import PreTrainedTokenizerBase

from .cache import atomic_file, atomic_write, cache_root, sha256_hex


_CHUNK_CHARS = 2000  # plain text is tokenized in line-aligned chunks, in parallel


_BATCH_TEXTS = 1024  # chunks (or table rows) per tokenizer call
_READ_BYTES = 1 << 24  # a text file is hashed 16 MiB at a time


def token_file(source: Path | Iterable[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """The token ids of a text file (tokenized in line-aligned chunks) or of table rows (each followed by eos; any
    iterable that can be iterated again, such as sources.ColumnTexts, which streams a table's column), as
    one read-only vector memory-mapped from a file in the cache: uint16 when the vocabulary fits, else uint32
    (nanoGPT's train.bin). Built once per machine, streaming: memory stays near one batch of text whatever the
    corpus's size; every process of the machine maps the same pages."""
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:  # a tokenizer that cannot be fingerprinted is not cached
        return np.concatenate([*_token_pieces(source, tokenizer), np.zeros(0, np.int64)]).astype(dtype)
    key = sha256_hex(fingerprint.encode(), *_source_parts(source))[:32]
    path = cache_root() / "tokens" / f"{key}.{np.dtype(dtype).name}.bin"
    if not path.is_file():
        with atomic_file(path) as f:
            for ids in _token_pieces(source, tokenizer):
                ids.astype(dtype).tofile(f)
    if path.stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _source_parts(source: Path | Iterable[str]) -> Iterator[bytes]:
    """What the cache key covers: a file's bytes (read in pieces) or the rows' text."""
    if isinstance(source, Path):
        yield b"text"
        digest = hashlib.sha256()
        with open(source, "rb") as f:
            while piece := f.read(_READ_BYTES):
                digest.update(piece)
        yield digest.digest()
    else:
        yield b"rows"
        yield from (row.encode("utf-8") for row in source)


def _token_pieces(source: Path | Iterable[str], tokenizer: PreTrainedTokenizerBase,
                  batch_texts: int = _BATCH_TEXTS) -> Iterator[np.ndarray]:
    """The ids of `batch_texts` chunks (or rows, each followed by eos where the tokenizer has one) at a time: a
    tokenizer's output for a whole 121 MB corpus at once peaked at 6.2 GB. A bar shows progress when it takes more
    than a few seconds."""
    from tqdm import tqdm

    rows = not isinstance(source, Path)
    eos = [tokenizer.eos_token_id] if rows and tokenizer.eos_token_id is not None else []
    total = sum(len(d) for d in source) if rows else source.stat().st_size
    with contextlib.ExitStack() as stack:
        texts = iter(source) if rows else _line_chunks(stack.enter_context(open(source, encoding="utf-8")))
        bar = stack.enter_context(tqdm(total=total, desc="tokenizing", unit="B" if not rows else "char",
                                       unit_scale=True, delay=3, leave=False))
        while batch := list(itertools.islice(texts, batch_texts)):
            ids = _encode(tokenizer, batch)
            yield np.fromiter(itertools.chain.from_iterable(i + eos for i in ids), dtype=np.int64)
            bar.update(sum(len(t.encode("utf-8")) if not rows else len(t) for t in batch))


def cached(tokenizer: PreTrainedTokenizerBase, parts: list[bytes],
            build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Tensors that tokenizing produced before for the same inputs and tokenizer, else `build()`,
    saved under `cache_root() / "tokens"`. Tokenizing a corpus takes seconds on 2 cores and every
    rank does it at start. Tokenizers without a `backend_tokenizer` are not cached."""
    fingerprint = tokenizer_fingerprint(tokenizer)
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


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str | None:
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


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"] if texts else []


def _line_chunks(lines: Iterable[str], size: int = _CHUNK_CHARS) -> Iterator[str]:
    """The text of `lines` (a file, read a line at a time) in pieces of at least `size` characters that end at line
    ends (byte-level BPE never merges across a newline followed by a letter, so this hardly changes the tokens)."""
    piece: list[str] = []
    length = 0
    for line in lines:
        piece.append(line)
        length += len(line)
        if length >= size:
            yield "".join(piece)
            piece, length = [], 0
    if piece:
        yield "".join(piece)
