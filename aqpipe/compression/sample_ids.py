"""A micro-batch's dataset indices, checked once: what AQ-SGD's buffers key their rows by."""
from __future__ import annotations

from typing import Any

import torch


def as_sample_ids(sample_ids: Any, num_samples: int, batch: int | None = None) -> torch.Tensor:
    """Validate dataset indices for one micro-batch; returns them as a CPU int64 vector (at once for ids already
    checked as `SampleIds` for buffers of this size)."""
    if isinstance(sample_ids, SampleIds):
        if sample_ids.num_samples != num_samples:  # checked for buffers of another size: check anew
            return as_sample_ids(sample_ids.tensor, num_samples, batch)
        if batch is not None and sample_ids.numel() != batch:
            raise ValueError(f"{sample_ids.numel()} sample_ids for a micro-batch of {batch} samples: expected one per "
                             "sample")
        return sample_ids.tensor
    if sample_ids is None:
        raise ValueError("sample_ids is None: AQ-SGD buffers need each sample's dataset index")
    ids = torch.as_tensor(sample_ids)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"sample_ids.dtype={ids.dtype}: expected integer dataset indices")
    if ids.dim() != 1:
        raise ValueError(f"sample_ids has shape {tuple(ids.shape)}: expected a 1-D vector of dataset indices")
    ids = ids.to(device="cpu", dtype=torch.int64)
    if batch is not None and ids.numel() != batch:
        raise ValueError(f"{ids.numel()} sample_ids for a micro-batch of {batch} samples: expected one per sample")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_samples:
            bad = lo if lo < 0 else hi
            raise ValueError(f"sample id {bad} is out of range: expected 0 <= id < num_samples={num_samples}")
        if torch.unique(ids).numel() != ids.numel():
            shown = ids[:8].tolist()
            raise ValueError(f"sample_ids {shown}{' ...' if ids.numel() > 8 else ''} repeat an index: each sample may "
                             "appear once per micro-batch")
    return ids


class SampleIds:
    """One micro-batch's dataset indices, checked once for buffers of `num_samples` rows (a CPU int64 vector, in
    range, no repeats): a pipeline stage hands the same ids to several codec and buffer calls, none checks again."""

    __slots__ = ("tensor", "num_samples")

    def __init__(self, sample_ids: Any, num_samples: int) -> None:
        self.tensor = as_sample_ids(sample_ids, num_samples)
        self.num_samples = num_samples

    def numel(self) -> int:
        return self.tensor.numel()
