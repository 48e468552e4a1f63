"""A toy pipeline: a few tanh blocks over a tied embedding / head, split into stages, on learnable sequences."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from aqpipe.pipeline import Tie


VOCAB, HIDDEN = 40, 16


class Output(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class ToyStage(nn.Module):
    def __init__(self, index: int, num_stages: int, blocks: list[nn.Linear], embed: torch.Tensor) -> None:
        super().__init__()
        self.stage_index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.hidden_size = embed.shape[1]
        self.blocks = nn.ModuleList(blocks)
        self.block_indices: list[int] = []  # what a checkpoint records of a stage's blocks (a toy has no model)
        self.embed = nn.Parameter(embed.clone()) if (self.is_first or self.is_last) else None

    def hf_parameter_names(self) -> dict[str, str]:
        return {name: name for name, _ in self.named_parameters()}

    def forward(self, hidden, batch, seed=None):
        h = self.embed[batch["input_ids"]] if self.is_first else hidden
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        if not self.is_last:
            return h
        logits = h @ self.embed.t()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))
        return Output(loss, logits)

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        return {"embed": self.embed} if self.embed is not None else {}

    def tied_lookups(self) -> dict[str, tuple[str, ...]]:
        return {"embed": ("input_ids",)} if self.embed is not None and not self.is_last else {}


def toy_stages(num_stages: int, num_blocks: int = 4, seed: int = 0, hidden: int = HIDDEN) -> list[ToyStage]:
    """The same model (seeded) split into contiguous groups of blocks."""
    torch.manual_seed(seed)
    embed = torch.randn(VOCAB, hidden) * 0.5
    blocks = [nn.Linear(hidden, hidden) for _ in range(num_blocks)]
    bounds = [num_blocks * s // num_stages for s in range(num_stages + 1)]
    return [ToyStage(s, num_stages, blocks[bounds[s]:bounds[s + 1]], embed) for s in range(num_stages)]


def toy_ties(num_stages: int) -> dict[str, Tie]:
    """The embedding, looked up on stage 0 and used whole as the head on the last stage (its owner)."""
    return {"embed": Tie((0, num_stages - 1), {0: ("input_ids",)})} if num_stages > 1 else {}


def toy_tokens(num_samples: int, seq_len: int) -> torch.Tensor:
    """Deterministic token sequences with a learnable pattern."""
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (num_samples, 1), generator=g)
    return (starts + torch.arange(seq_len) * 3) % VOCAB


def toy_dataset(num_samples: int, seq_len: int):
    """The toy sequences as a dataset for the trainer's data layer (aqpipe.data.micro_batches and its shards)."""
    from aqpipe.data import TensorDictDataset

    data = toy_tokens(num_samples, seq_len)
    return TensorDictDataset({"input_ids": data, "labels": data, "sample_id": torch.arange(num_samples)},
                             seq_len=seq_len, split="train")


def toy_batches(num_samples: int, seq_len: int, micro_batch_size: int, num_micro_batches: int, epoch: int):
    """The toy sequences shuffled per epoch (one replica); sample_id = dataset index."""
    data = toy_tokens(num_samples, seq_len)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(epoch))
    per_step = micro_batch_size * num_micro_batches
    for step in range(num_samples // per_step):
        ids = order[step * per_step:(step + 1) * per_step]
        yield [{"input_ids": data[i], "labels": data[i], "sample_id": i}
               for i in ids.split(micro_batch_size)]
