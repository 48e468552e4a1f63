"""A micro-batch as a stage computes with it: its tensors on the stage's device, and what the host read of them.

The loader gives host tensors. What a step decides from a batch's values (AQ-SGD's sample ids, the rows a tied
embedding reads, whether a causal mask must hold padding or keep packed sequences apart) is read there, on the host,
where a read costs the GPU nothing; the tensors a stage computes with go to the GPU through pinned memory, the host
not waiting (`compression.buffers.to_device`). transformers' mask builders read the same facts off device tensors,
each read a host sync per micro-batch and stage: `heads.causal_mask` takes them from here instead. A batch given on
the device works as well; its facts are then read back from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aqpipe.compression.buffers import to_device

HOST_ONLY = ("sample_id",)  # read by the step on the host (AQ-SGD's rows), never by a stage's compute


@dataclass(frozen=True)
class MaskFacts:
    """What decides a causal mask's form, as transformers decides it (masking_utils): `padded`, an attention mask
    with a zero in it (the padding goes into the mask); `packed`, no attention mask and position ids that restart
    inside a row (each sequence attends to itself alone)."""

    padded: bool
    packed: bool


def mask_facts(batch: dict[str, Any]) -> MaskFacts:
    return step_facts([batch])[0]


def step_facts(micro_batches: list[dict[str, Any]]) -> list[MaskFacts]:
    """Every micro-batch's facts, read in one transfer (a step's host reads do not grow with its micro-batches)."""
    no = torch.tensor(False)
    flags = []
    for mb in micro_batches:
        mask, positions = mb.get("attention_mask"), mb.get("position_ids")
        padded = no if mask is None else ~mask.bool().all().cpu()
        packed = (positions.diff(dim=-1) != 1).any().cpu() if mask is None and positions is not None else no
        flags.append(torch.stack([padded, packed]))
    return [MaskFacts(padded=p, packed=k) for p, k in (torch.stack(flags).tolist() if flags else [])]


class StagedBatch(dict):
    """A micro-batch's fields on the stage's device (a dict, as a stage reads a batch), with `facts` read on the
    host before they left it."""

    facts: MaskFacts


def staged(micro_batches: list[dict[str, Any]], device: torch.device | str) -> list[StagedBatch]:
    """Each micro-batch for a stage computing on `device`: its tensors there (no host wait from a GPU), its facts
    read first."""
    out = []
    for batch, facts in zip(micro_batches, step_facts(micro_batches)):
        moved = StagedBatch({k: to_device(v, device) if isinstance(v, torch.Tensor) and k not in HOST_ONLY else v
                             for k, v in batch.items()})
        moved.facts = facts
        out.append(moved)
    return out


__all__ = ["HOST_ONLY", "MaskFacts", "StagedBatch", "mask_facts", "staged", "step_facts"]
