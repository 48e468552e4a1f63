"""Fixed-length samples with stable ids (`sample_id` = dataset index), and what every dataset of the trainer
shares: the splits, a prefix of a split. The datasets themselves: `lm` (causal LM text), `classification`."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from aqpipe.compression.fields import check_int


SPLITS = ("train", "eval")


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
    check_int("max_samples", max_samples, 1, what="None or an int >= 1")
    if max_samples >= len(dataset):
        return dataset
    if hasattr(dataset, "limited"):  # a dataset that cuts its samples as they are asked for
        return dataset.limited(max_samples)
    if not isinstance(dataset, TensorDictDataset):
        return torch.utils.data.Subset(dataset, range(max_samples))
    examples = dataset.examples[:max_samples] if dataset.examples is not None else None
    return TensorDictDataset({name: t[:max_samples] for name, t in dataset.tensors.items()}, seq_len=dataset.seq_len,
                             split=dataset.split, num_labels=dataset.num_labels, examples=examples,
                             label_names=dataset.label_names)


def check_seq_len(seq_len: int) -> None:
    check_int("seq_len", seq_len, 2, what="an int >= 2")


def check_split(split: str, eval_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    whole = split == "eval" and eval_fraction == 1.0  # a held-out set used whole
    if not (0.0 <= eval_fraction < 1.0 or whole):
        raise ValueError(f"eval_fraction={eval_fraction!r}: expected a fraction in [0, 1)")
    if split == "eval" and eval_fraction == 0:
        raise ValueError("split='eval' with eval_fraction=0: expected eval_fraction > 0 to have an eval split")


def split_slice(count: int, split: str, eval_fraction: float) -> slice:
    """The train part is the first rows, the eval part the last ceil(count * eval_fraction)."""
    n_eval = min(count, math.ceil(count * eval_fraction))
    return slice(0, count - n_eval) if split == "train" else slice(count - n_eval, count)


def describe(source: Any) -> str:
    return "'shakespeare' (built in)" if source in (None, "shakespeare") else repr(str(source))
