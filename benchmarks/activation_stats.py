"""What a boundary activation looks like to a quantizer: its tails, and each codec's error on it.

The cache-free `hadamard` codec rotates each row block before min-max quantization. That pays where
a few channels dwarf the rest (heavy tails: the rotation spreads them), and costs where values are
lighter-tailed than a Gaussian (the rotation makes them Gaussian, whose range is wider per unit of
norm). This script reads the hidden state at the 2-stage boundary of a GPT2 (as the recipe
partitions it) on real text and prints, per model: the excess kurtosis per token row, the largest
|value| over the row's standard deviation, and c_Q = ||x - Q(x)|| / ||x|| for DirectQ and Hadamard at
the trainer's default groups.

    python -m benchmarks.activation_stats runs/convergence/beyond/gpt2/fp32/model
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aqpipe.data import fetch_shakespeare
from aqpipe.compression import forward_codec
from aqpipe.pipeline.compression_config import CompressionConfig
from aqpipe.pipeline.partitioning import stage_block_counts

SETTINGS = ((2, 4), (3, 6), (4, 8))  # forward bits studied (the backward's are not rotated here)


def boundary_activation(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream after the first stage's blocks (the 2-stage split by parameters)."""
    first = stage_block_counts(model, 2)[0]
    with torch.no_grad():
        return model(input_ids=tokens, output_hidden_states=True).hidden_states[first]


def stats(x: torch.Tensor) -> dict[str, float]:
    rows = x.reshape(-1, x.shape[-1]).double()
    centred = rows - rows.mean(dim=1, keepdim=True)
    var = centred.square().mean(dim=1)
    kurtosis = (centred.pow(4).mean(dim=1) / var.square() - 3).median()
    peak = (centred.abs().amax(dim=1) / var.sqrt()).median()
    out = {"excess_kurtosis_median": round(float(kurtosis), 3), "max_over_std_median": round(float(peak), 2)}
    for bits, _ in SETTINGS:
        group = CompressionConfig(forward="direct", forward_bits=bits).group_size("forward", x.shape[-1])  # auto
        for mode in ("direct", "hadamard"):
            y = forward_codec(mode, bits, seed=1, group_size=group).encode(x).decoded
            out[f"c_q_{mode}_{bits}"] = round(float((y - x).norm() / x.norm()), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a trained model directory (the recipe's <output_dir>/model)")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq_len", type=int, default=128)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(fetch_shakespeare().read_text()[:400_000])["input_ids"]
    n = args.samples * args.seq_len
    tokens = torch.tensor(ids[len(ids) // 2:len(ids) // 2 + n]).view(args.samples, args.seq_len)
    trained = AutoModelForCausalLM.from_pretrained(args.model).eval()
    fresh = AutoModelForCausalLM.from_config(trained.config).eval()  # the same shape at initialisation
    results = {name: stats(boundary_activation(m, tokens)) for name, m in (("initialisation", fresh),
                                                                           ("trained", trained))}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
