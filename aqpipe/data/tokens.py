"""Text to token ids: documents tokenized in line-aligned chunks, in parallel, and cached on disk by the text's and
the tokenizer's digests, so processes that start together build the cache once."""
from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch

if TYPE_CHECKING:  # transformers takes seconds to import: only where used
    from transformers import PreTrainedTokenizerBase

from .cache import atomic_write, cache_root, sha256_hex


_CHUNK_CHARS = 2000  # plain text is tokenized in line-aligned chunks, in parallel


_BATCH_TEXTS = 1024  # chunks (or table rows) per tokenizer call


def token_stream(documents: str | list[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """The token ids of a text, or of table rows each followed by eos, in one vector; cached on disk."""
    rows = not isinstance(documents, str)
    parts = [b"rows" if rows else b"text", *(d.encode("utf-8") for d in (documents if rows else [documents]))]
    build = lambda: {"ids": torch.from_numpy(_tokenize_documents(documents, tokenizer))}  # noqa: E731
    return cached(tokenizer, parts, build)["ids"].to(torch.int64).numpy()


def cached(tokenizer: PreTrainedTokenizerBase, parts: list[bytes],
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
