"""Packing: whole sequences (conversations, prompt/completion pairs) placed into samples of seq_len tokens by
best-fit decreasing, as TRL's `packing=True` does, instead of one sequence per sample padded to seq_len (a
conversation of 80 tokens in a 1024-token sample sends 92% padding down every boundary).

A packed sample carries `position_ids` that restart at 0 with each sequence and no `attention_mask`: transformers'
mask builders read sequence starts from the position ids and attend within each sequence only (block-diagonal
causal attention), and rotary or learned positions see each sequence from 0, as alone. The first token of each
sequence is never a target (nothing before it in its sequence predicts it). The tail of a sample is padding with
positions of its own (a sequence of its own, no targets). The composition depends on the lengths alone: the same
data packs the same way on every rank, in every run and after a resume, and AQ-SGD's buffers key on it.
"""
from __future__ import annotations

import bisect

import torch

from .chat import IGNORE


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths` (each <= capacity): longest first, each into the fullest bin it still fits,
    a new bin where none has room. Ties go to the lower index and the earlier bin, so the packing is deterministic."""
    if any(n > capacity or n < 1 for n in lengths):
        raise ValueError(f"lengths {min(lengths)}..{max(lengths)}: expected each in 1..{capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted: the fullest bin that fits is the first >= n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= n
        if room:
            bisect.insort(free, (room, b))
    return bins


def pack(samples: list[tuple[list[int], list[int]]], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """(input ids, labels) sequences of at most seq_len tokens as packed samples: input_ids, labels, position_ids."""
    bins = best_fit_decreasing([len(ids) for ids, _ in samples], seq_len)
    ids = torch.full((len(bins), seq_len), pad, dtype=torch.int64)
    labels = torch.full((len(bins), seq_len), IGNORE, dtype=torch.int64)
    positions = torch.zeros((len(bins), seq_len), dtype=torch.int64)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            tokens, targets = samples[i]
            n = len(tokens)
            ids[row, at:at + n] = torch.tensor(tokens)
            labels[row, at + 1:at + n] = torch.tensor(targets[1:], dtype=torch.int64)
            positions[row, at:at + n] = torch.arange(n)
            at += n
        positions[row, at:] = torch.arange(seq_len - at)  # the padding: a sequence of its own, with no targets
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
