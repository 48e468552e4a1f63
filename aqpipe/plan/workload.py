"""What a run asks of the machines, as numbers a placement is priced by: each block's compute, the stages' extra
work (the embeddings, the head and its loss), every message a boundary carries, the tied weights' rows, the replicas'
sync, and a stage's memory. Derived from the run's settings and its model's shapes (built on the meta device, no
weights read), the same on every rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aqpipe.compression import QuantizedTensor
from aqpipe.data_parallel import REGISTRY
from aqpipe.pipeline.loading import meta_model
from aqpipe.pipeline.partitioning import model_family, numel
from aqpipe.pipeline.stages.base import present

# what a data-parallel algorithm sends a step, per trained parameter and replica, and the collective it runs
# (pipeline.emulated_link.KINDS): (bytes a parameter, kind); bits and ratios from the section (data_parallel/config.py)
DP_TRAFFIC = {
    "allreduce": lambda dp: (4.0, "ring"),
    "qadam": lambda dp: (dp.bits / 8, "alltoall"),  # the quantized reduce-scatter and allgather (Comm.quantized_mean)
    "cocktail_sgd": lambda dp: (dp.random_ratio * dp.topk_ratio * (dp.bits / 8 + 4), "alltoall"),
    "qsparse_local_sgd": lambda dp: (dp.topk_ratio * (dp.bits / 8 + 4) / dp.local_steps, "gather"),
    "decentralized": lambda dp: (4.0 / dp.interval, "peers"),
    "low_precision_decentralized": lambda dp: (dp.bits / 8, "peers"),
}


@dataclass(frozen=True)
class Workload:
    """One step of the run, in the units a placement is priced in."""

    blocks: int
    block_flops: float  # one block's forward and backward of one micro-batch
    first_extra: float  # stage 0's work besides its blocks, in blocks (the embeddings)
    last_extra: float  # the last stage's, in blocks (the final norm, the head and its loss)
    micro_batches: int
    schedule: str
    forward_bytes: float  # one micro-batch's message across a boundary, forward (activations, sample ids)
    backward_bytes: float  # and backward (their gradient)
    tie_bytes: float  # a step's tied-weight traffic between stage 0 and the last stage of a replica, both ways
    block_trained: int  # trained parameters in a block (the replicas' sync carries them)
    first_trained: int  # and besides the blocks, on stage 0 and the last stage
    last_trained: int
    dp_bytes_per_parameter: float  # what the replicas' algorithm sends a step per trained parameter (dp_kind)
    dp_kind: str  # "ring" or "peers"
    block_memory: float  # a block's weights, gradients and optimizer state on its stage, bytes
    activation_memory: float  # one micro-batch's activations a block keeps for its backward, bytes
    first_memory: float  # stage 0's and the last stage's besides their blocks
    last_memory: float
    table_bytes: int = 1024  # at most, a message of the step's job-wide rounds (step_table.py: a row, 232 B)
    shares: tuple[int, ...] | None = None  # each replica's micro-batches a step, as the settings fix them (None: the
    # plan's choice where `weighs`, else micro_batches each)
    weighs: bool = False  # the replicas' algorithm averages gradients, so replicas may take unequal shares

    def fixed_shares(self, replicas: int) -> tuple[int, ...] | None:
        """The shares every placement is priced with; None where the plan chooses them for each."""
        if self.shares is not None:
            return self.shares
        return None if self.weighs and replicas > 1 else (self.micro_batches,) * replicas

    def stage_extra(self, stage: int, stages: int) -> float:
        return (self.first_extra if stage == 0 else 0.0) + (self.last_extra if stage == stages - 1 else 0.0)

    def stage_trained(self, stage: int, stages: int, blocks: int) -> int:
        return blocks * self.block_trained + (self.first_trained if stage == 0 else 0) + \
            (self.last_trained if stage == stages - 1 else 0)


def boundary_bytes(compression: Any, direction: str, rows: int, seq: int, width: int, wire: torch.dtype,
                   first_share: float) -> float:
    """One micro-batch's message across a boundary in `direction` (the codecs' packed sizes, before entropy
    coding): AQ-SGD's changes for revisits and its first visits' codec for the `first_share` of visits that are
    first ones; the subspace's coefficients; dense codecs' codes or the activation as it is."""
    mode, bits = getattr(compression, direction), getattr(compression, f"{direction}_bits")
    bits = bits if isinstance(bits, int) else compression.auto_bits_max
    ids = 8 * rows if direction == "forward" else 0
    plain = rows * seq * width * wire.itemsize

    def coded(b: int | None, group_width: int = width) -> float:
        if b is None:
            return plain
        return QuantizedTensor.wire_nbytes((rows, seq, group_width), b, compression.group_size(direction, group_width,
                                                                                               b), compression.scales())

    if mode == "none":
        return plain + ids
    if mode == "subspace":
        rank, _ = compression.subspace()  # auto rank: its bound, the most it sends
        return coded(bits, rank) + ids
    if mode == "aqsgd" and direction == "forward":
        whole = compression.first_visit == "none" or (compression.first_visit == "auto" and first_share < 1)
        first = plain if whole else coded(compression.first_visit_bits or bits)  # auto: kept rows' go whole
        return first_share * first + (1 - first_share) * coded(bits) + ids
    return coded(bits) + ids


def build(cfg: Any, model_class: type, config: Any, first_share: float) -> Workload:
    """The run's workload from its settings and its model's config (`first_share`: of the forward messages, the
    share that carry first visits: 1 / epochs for AQ-SGD's buffers)."""
    model = meta_model(model_class, config)
    family = model_family(model)
    blocks = list(model.get_submodule(family.blocks))
    block_params = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    first = numel(*(present(model, p) for p in family.first))
    last = numel(*(present(model, p) for p in family.last))
    # a weight the last stage holds too (a tied head) is stepped, and synced across replicas, there alone (ties.py)
    held_last = {id(p) for m in family.last if (part := present(model, m)) is not None for p in part.parameters()}
    first_own = sum(p.numel() for m in family.first if (part := present(model, m)) is not None
                    for p in part.parameters() if id(p) not in held_last)
    width = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd"))
    rows, seq, m = cfg.micro_batch_size, cfg.data.seq_len, cfg.num_micro_batches
    tokens = rows * seq
    lora = cfg.lora.enabled
    passes = 2.0 if lora else 3.0  # forward, and backward's input gradient (and its weights', where they train)
    block_flops = passes * (2 * block_params * tokens + 4 * tokens * seq * width)  # matmuls and attention scores
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    head_flops = passes * 2 * vocab * width * tokens if cfg.task == "causal_lm" else 0.0
    wire = torch.bfloat16 if cfg.bf16 else torch.float32
    c = cfg.compression
    trained_block = _adapter_parameters(cfg, config, width) if lora else block_params
    ties_train = not lora and cfg.task == "causal_lm" and bool(getattr(config, "tie_word_embeddings", False))
    tie_rows = min(vocab, tokens * m)
    tie_bits = c.tie_bits if c.tie not in ("none",) else 32
    tie_bytes = 2 * tie_rows * (width * tie_bits / 8 + 8) if ties_train else 0.0
    dp_bytes, dp_kind = DP_TRAFFIC[cfg.data_parallel.algorithm](cfg.data_parallel)
    shares = cfg.data_parallel.shares
    fixed = tuple(shares) if isinstance(shares, list) else None if shares == "auto" else \
        (m,) * max(1, cfg.replicas if isinstance(cfg.replicas, int) else 1)
    state_bytes = 16 if not lora else 0  # float32 weight's gradient and Adam's moments (weights counted apart)
    weight_bytes = 4 if not lora else 2
    return Workload(
        blocks=len(blocks), block_flops=block_flops, first_extra=0.0,
        last_extra=head_flops / block_flops if block_flops else 0.0, micro_batches=m,
        schedule=cfg.distributed.schedule,
        forward_bytes=boundary_bytes(c, "forward", rows, seq, width, wire, first_share if c.forward == "aqsgd" else 1),
        backward_bytes=boundary_bytes(c, "backward", rows, seq, width, wire, 1.0),
        tie_bytes=tie_bytes, block_trained=trained_block, first_trained=0 if lora else first_own,
        last_trained=0 if lora else last, dp_bytes_per_parameter=dp_bytes, dp_kind=dp_kind,
        block_memory=block_params * weight_bytes + trained_block * state_bytes,
        activation_memory=16.0 * tokens * width * wire.itemsize,
        first_memory=first * (weight_bytes + (0 if lora else state_bytes)),
        last_memory=last * (weight_bytes + (0 if lora else state_bytes)) + 2 * vocab * tokens * 4,
        shares=fixed, weighs=REGISTRY[cfg.data_parallel.algorithm].WEIGHTS)


def _adapter_parameters(cfg: Any, config: Any, width: int) -> int:
    """A block's LoRA parameters, roughly: rank x (in + out) for each adapted matrix (PEFT's default targets: the
    query and value projections)."""
    targets = cfg.lora.target_modules or ["q", "v"]
    return cfg.lora.rank * 2 * width * max(2, len(targets))
