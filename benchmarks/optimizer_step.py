"""The optimizer's step alone, over step_overhead's model: bf16 weights' AdamW (`--param_dtype bfloat16`) eager and
compiled (`--compile`), against torch's AdamW over float32 weights (the default run's: fused on a GPU, for-each on a
CPU).

Eager, the bf16 update is about fifteen passes over each parameter (the casts, the moments, the rounding's bits);
compiled, one kernel reads the weight, its gradient, both moments and the bits, and writes the three back. Printed:
milliseconds a step (median of the timed steps, after two that compile), and each against torch's AdamW.

    python -m benchmarks.optimizer_step                                   # CPU, small shape
    python -m benchmarks.optimizer_step --device cuda --shape 1b          # a GPU: 1.08B parameters
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from aqpipe.optim import LowPrecisionAdamW
from benchmarks.step_overhead import SHAPES, sync


def parameter_shapes(shape: str) -> list[torch.Size]:
    """The trainable tensors' shapes of step_overhead's tied Llama (the tied head counted once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], vocab_size=50257, tie_word_embeddings=True)
    with torch.device("meta"):
        return [p.shape for p in LlamaForCausalLM(config).parameters()]


def timed(step: Callable[[], None], device: str, steps: int) -> float:
    """Median seconds of `steps` steps after two untimed ones (a compiled update compiles in them)."""
    times = []
    for _ in range(steps + 2):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def run(kind: str, shapes: list[torch.Size], device: str, steps: int) -> float:
    dtype = torch.float32 if kind == "torch AdamW" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(device, dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(device, dtype) * 1e-3
    if kind == "torch AdamW":
        optimizer = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device == "cuda" else {}))
    else:
        optimizer = LowPrecisionAdamW(params, lr=1e-4, compile_backend="inductor" if "compiled" in kind else None)
    seconds = timed(optimizer.step, device, steps)
    del optimizer, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    shapes = parameter_shapes(args.shape)
    count = sum(s.numel() for s in shapes)
    kinds = ["torch AdamW", "bf16 AdamW, eager", "bf16 AdamW, compiled"]
    seconds = {kind: run(kind, shapes, args.device, args.steps) for kind in kinds}
    print(f"{args.device}, {args.shape} shape: {len(shapes)} tensors, {count / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads; median of {args.steps} steps\n")
    print("| optimizer | ms/step | torch AdamW / it |\n|---|---|---|")
    for kind in kinds:
        print(f"| {kind} | {seconds[kind] * 1e3:.1f} | {seconds['torch AdamW'] / seconds[kind]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "parameters": count, "seconds": seconds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
