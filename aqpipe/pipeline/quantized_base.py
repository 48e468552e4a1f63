"""QLoRA's frozen base: a stage's block linears held in 4 bits, each quantized as its tensor is read.

bitsandbytes' `Linear4bit` (NF4 or FP4 blocks of 64, optionally double-quantized statistics), which PEFT's LoRA
wraps natively and which runs on CPUs (torch ops) and NVIDIA GPUs (its CUDA kernels) alike. Each linear of the
stage's blocks is swapped for one on the meta device before the stage is made real (`swap_in`), so its bf16 weight
never exists whole in the stage: `quantize_into` takes the one tensor read from the shards and keeps only its 4-bit
form. What quantized fine-tuning keeps in full precision stays so: embeddings, a (tied) head, norms and a
classification head are not `nn.Linear`s of a block. `plain_state_dict` gives the weights back dequantized (an
export, a merge); a checkpoint holds none of them (the base is re-read on resume).

    four = FourBit("nf4", nested=True, compute_dtype=torch.bfloat16)
    swapped = swap_in(stage, keep=lambda name: name in vocabulary or family.in_head(name), four=four)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

QUANT_TYPES = ("nf4", "fp4")


@dataclass(frozen=True)
class FourBit:
    """How the frozen base is held: bitsandbytes' quant type, double quantization, the dtype it computes in."""

    quant_type: str = "nf4"
    nested: bool = False
    compute_dtype: torch.dtype = torch.bfloat16


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("--load_in_4bit needs bitsandbytes: pip install 'aqpipe[qlora]'") from None
    return bnb


def is_four_bit(module: nn.Module) -> bool:
    """Whether `module` is a 4-bit linear. Only a run that imported bitsandbytes (`swap_in`) can hold one, so the
    others never import it: that costs every process 1.7 s (it loads torch's compiler) and prints a line."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def swap_in(stage: nn.Module, origin: dict[str, str], keep: Callable[[str], bool], four: FourBit) -> list[str]:
    """Replace each `nn.Linear` of `stage` (still on the meta device) whose weight's HF name (`origin`: local ->
    HF name) `keep` does not keep in full precision by a 4-bit one on the meta device; their local paths."""
    bnb = _bnb()
    swapped = []
    for path, module in list(stage.named_modules()):
        if type(module) is not nn.Linear or keep(origin.get(f"{path}.weight", f"{path}.weight")):
            continue
        four_bit = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                     compute_dtype=four.compute_dtype, compress_statistics=four.nested,
                                     quant_type=four.quant_type, device="meta")
        # bitsandbytes 0.50 repacks a weight in place for its CPU inference kernel the first time it runs in eval
        # mode on an AVX512-BF16 CPU, and never back: the training after an evaluation then gets no gradient
        # through any 4-bit layer (the adapters stop learning at the first eval). The packing is for inference.
        four_bit.support_avx512bf16_for_cpu = False
        if module.bias is not None:
            four_bit.bias = module.bias
        parent, _, leaf = path.rpartition(".")
        setattr(stage.get_submodule(parent) if parent else stage, leaf, four_bit)
        swapped.append(path)
    return swapped


CHUNK = 1 << 20  # elements quantized at once: bitsandbytes' temporaries are about 5x a tensor's bf16 bytes


def quantize(value: torch.Tensor, quant_type: str, nested: bool) -> tuple[torch.Tensor, object]:
    """bitsandbytes' `quantize_4bit` of `value`, a chunk of `CHUNK` elements at a time: its blocks of 64 are
    independent, so the packed values and the scales are the whole tensor's (tested), and the transient memory is
    the chunk's, not the tensor's (a 2048 x 8192 weight: +171 MB at once, +0 chunked). Double quantization quantizes
    the scales of the whole tensor as bitsandbytes does (their mean taken off, blocks of 256)."""
    F = _bnb().functional
    flat = value.reshape(-1)
    parts = [F.quantize_4bit(chunk, quant_type=quant_type, compress_statistics=False)
             for chunk in flat.split(CHUNK - CHUNK % 64)]
    packed = torch.cat([packed for packed, _ in parts])
    absmax, first = torch.cat([state.absmax for _, state in parts]), parts[0][1]
    common = {"shape": value.shape, "dtype": value.dtype, "blocksize": first.blocksize, "code": first.code,
              "quant_type": quant_type}
    if not nested:
        return packed, F.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    scales, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
    return packed, F.QuantState(absmax=scales, offset=offset, state2=state2, **common)


def quantize_into(module: nn.Module, value: torch.Tensor, device: torch.device | str) -> None:
    """`value` (one weight as stored) quantized into the 4-bit `module` on `device`; the full tensor is dropped."""
    bnb = _bnb()
    if tuple(value.shape) != (module.out_features, module.in_features):
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)}; the model expects "
                         f"{(module.out_features, module.in_features)}")
    old = module.weight
    packed, state = quantize(value.detach().to("cpu", module.compute_dtype or torch.float32), old.quant_type,
                             old.compress_statistics)
    weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                               compress_statistics=old.compress_statistics, quant_type=old.quant_type,
                               module=module, bnb_quantized=True)
    module.weight = weight.to(device)
    module.weight._is_hf_initialized = True


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each 4-bit weight dequantized (in its compute dtype) and its quantization
    statistics left out: the tensors an HF checkpoint holds."""
    state = dict(model.state_dict())
    for path, module in model.named_modules():
        if is_four_bit(module):
            key = f"{path}.weight" if path else "weight"
            for extra in [k for k in state if k.startswith(key + ".")]:
                del state[extra]
            w = module.weight
            state[key] = _bnb().functional.dequantize_4bit(w.data, w.quant_state).to(module.compute_dtype)
    return state
