"""Causal-LM samples: a corpus (a local text file or table, a hub dataset, or the built-in plays) tokenized and cut
into fixed-length blocks, each with a stable `sample_id`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from .corpus import fetch_shakespeare
from .datasets import TensorDictDataset, check_seq_len, check_split, describe, split_slice
from .sources import (HUB_DEFAULT_CONFIGS, TABLE_FORMATS, TEXT_SUFFIXES, column_texts, hub_split, load_hub, load_table,
                      local_file)
from .tokens import token_stream


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
    check_seq_len(seq_len)
    check_split(split, eval_fraction)
    documents, presplit = _lm_documents(text_path_or_name, split, text_column, dataset_config)
    ids = token_stream(documents, tokenizer)
    count = len(ids) // seq_len
    blocks = torch.from_numpy(ids[: count * seq_len]).view(count, seq_len)
    if not presplit:
        blocks = blocks[split_slice(count, split, eval_fraction)]
    if len(blocks) == 0:
        raise ValueError(f"text {describe(text_path_or_name)} has {len(ids)} tokens: {count} blocks of "
                         f"seq_len={seq_len}, none left for the {split!r} split; expected a longer text "
                         "or a smaller seq_len")
    tensors = {"input_ids": blocks, "attention_mask": torch.ones_like(blocks), "labels": blocks.clone(),
               "sample_id": torch.arange(len(blocks), dtype=torch.int64)}
    return TensorDictDataset(tensors, seq_len=seq_len, split=split)


def _lm_documents(source: str | Path | None, split: str, text_column: str | None,
                  dataset_config: str | None) -> tuple[str | list[str], bool]:
    """The source's text (one string) or rows (a list), and whether they already are the requested
    split (a hub dataset's own split)."""
    if source is None or str(source) == "shakespeare":
        return fetch_shakespeare().read_text(encoding="utf-8"), False
    path = local_file(source)
    if path is not None:
        suffix = path.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            return path.read_text(encoding="utf-8"), False
        if suffix in TABLE_FORMATS:
            return column_texts(load_table(path), text_column, str(path)), False
        raise ValueError(f"{str(path)!r}: unsupported file type {suffix!r}; expected one of "
                         f"{sorted(TEXT_SUFFIXES | set(TABLE_FORMATS))}")
    name = str(source)
    config = dataset_config or HUB_DEFAULT_CONFIGS.get(name)
    splits = load_hub(name, config)
    table, presplit = hub_split(splits, split, name)
    return column_texts(table, text_column, f"{name} ({config})"), presplit
