"""Causal-LM samples: a corpus (a local text file or table, a hub dataset, or the built-in plays) tokenized and cut
into fixed-length blocks, each with a stable `sample_id`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from .chat import LossOn, encode_rows, is_instruction_table, pad_id, padded
from .packing import pack
from .corpus import fetch_shakespeare
from .datasets import TensorDictDataset, check_seq_len, check_split, describe, split_slice
from .sources import (HUB_DEFAULT_CONFIGS, TABLE_FORMATS, TEXT_SUFFIXES, column_texts, hub_split, load_hub, load_table,
                      local_file)
from .tokens import token_file


def lm_dataset(text_path_or_name: Any, tokenizer: PreTrainedTokenizerBase, seq_len: int,
               split: str = "train", eval_fraction: float = 0.05, *, text_column: str | None = None,
               dataset_config: str | None = None, packing: bool = False, packing_overflow: str = "truncate",
               assistant_only_loss: bool = True, completion_only_loss: bool = True) -> Dataset:
    """Causal-LM samples: the text tokenized and cut into blocks of exactly `seq_len` tokens.

    Sources: None or "shakespeare" (built in), a local .txt, .json/.jsonl, .csv or .parquet file
    (text from `text_column`; None: 'text', else the table's one string column; each row is a
    document, followed by the eos token), or a hub dataset
    name with `dataset_config` (wikitext defaults to wikitext-2-raw-v1). The last `eval_fraction`
    of the blocks form the "eval" split (a hub dataset's own validation split where it has one).
    Items: input_ids, attention_mask (ones), labels (= input_ids; the model shifts), sample_id, cut from the
    memory-mapped token file as they are asked for (`TokenBlocks`).

    A table of conversations (`messages`, ShareGPT's `conversations`) or prompt/completion pairs gives instruction
    samples instead: one per row, padded, labels -100 but where the loss falls (chat.py: TRL's
    `assistant_only_loss`, `completion_only_loss`); with `packing`, many whole rows a sample
    (packing.py: position_ids that restart with each row, no attention_mask). A row longer than seq_len is cut (the
    dataset's `cut` counts them) or, with packing_overflow "error", refused.
    """
    check_seq_len(seq_len)
    check_split(split, eval_fraction)
    text, table, presplit, where = _lm_source(text_path_or_name, split, dataset_config)
    if table is not None and is_instruction_table(table.column_names):
        rows = encode_rows(table.to_list(), tokenizer, seq_len, where, packing_overflow,
                           LossOn(assistant_only_loss, completion_only_loss))
        samples = rows.samples if presplit else rows.samples[split_slice(len(rows.samples), split, eval_fraction)]
        if not samples:
            raise ValueError(f"{where}: no sample left for the {split!r} split; expected more rows")
        tensors = (pack if packing else padded)(samples, seq_len, pad_id(tokenizer))
        tensors["sample_id"] = torch.arange(len(tensors["input_ids"]), dtype=torch.int64)
        dataset = TensorDictDataset(tensors, seq_len=seq_len, split=split)
        dataset.cut = rows.cut  # rows of the whole table cut to seq_len (said once, in the run's data line)
        return dataset
    if packing:
        raise ValueError(f"packing with {where}: expected a table of conversations (messages, conversations) or "
                         "prompt/completion pairs; LM text is already cut into full blocks with no padding to pack "
                         "away")
    ids = token_file(text if table is None else column_texts(table, text_column, where), tokenizer)
    count = len(ids) // seq_len
    part = range(count)[split_slice(count, split, eval_fraction)] if not presplit else range(count)
    if len(part) == 0:
        raise ValueError(f"text {describe(text_path_or_name)} has {len(ids)} tokens: {count} blocks of "
                         f"seq_len={seq_len}, none left for the {split!r} split; expected a longer text "
                         "or a smaller seq_len")
    return TokenBlocks(ids, seq_len, part.start, len(part), split)


class TokenBlocks(Dataset):
    """Causal-LM samples cut from a token file as they are asked for: sample i is tokens [(first + i) T,
    (first + i + 1) T) of `tokens` (memory-mapped, uint16 or uint32), its attention mask ones and its labels its
    ids. Nothing is stored per sample, so a rank's memory does not grow with the corpus. `sample_id` = i."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int, split: str) -> None:
        self.tokens, self.seq_len, self.first, self.count, self.split = tokens, seq_len, first, count, split

    def __len__(self) -> int:
        return self.count

    def batch(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """The samples at `indices`, stacked (int64 ids, as the model takes them)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.count):
            raise IndexError(f"sample indices {idx.min()}..{idx.max()}: expected 0..{self.count - 1}")
        rows = (self.first + idx)[:, None] * self.seq_len + np.arange(self.seq_len)
        ids = torch.from_numpy(self.tokens[rows].astype(np.int64))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                "sample_id": torch.from_numpy(idx)}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[0] for name, t in self.batch([index]).items()}

    def limited(self, count: int) -> "TokenBlocks":
        """The first `count` samples (ids unchanged)."""
        return TokenBlocks(self.tokens, self.seq_len, self.first, min(count, self.count), self.split)


def _lm_source(source: Any, split: str, dataset_config: str | None) -> tuple[Path | None, Any, bool, str]:
    """(a text file, None) or (None, a table), whether it already is the requested split (a hub dataset's own split),
    and how to name it in a message. `source` may be a `datasets.Dataset` or `DatasetDict` a user's script built."""
    if hasattr(source, "column_names") and hasattr(source, "to_list"):  # a datasets.Dataset
        return None, source, False, "the dataset given"
    if hasattr(source, "keys") and not isinstance(source, (str, Path)):  # a DatasetDict: its own splits
        table, presplit = hub_split(source, split, "the dataset given")
        return None, table, presplit, "the dataset given"
    if source is None or str(source) == "shakespeare":
        return fetch_shakespeare(), None, False, "shakespeare"
    path = local_file(source)
    if path is not None:
        suffix = path.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            return path, None, False, str(path)
        if suffix in TABLE_FORMATS:
            return None, load_table(path), False, str(path)
        raise ValueError(f"{str(path)!r}: unsupported file type {suffix!r}; expected one of "
                         f"{sorted(TEXT_SUFFIXES | set(TABLE_FORMATS))}")
    name = str(source)
    config = dataset_config or HUB_DEFAULT_CONFIGS.get(name)
    table, presplit = hub_split(load_hub(name, config), split, name)
    return None, table, presplit, f"{name} ({config})"
