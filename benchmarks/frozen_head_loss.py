"""The chunked causal-LM loss of a frozen head (LoRA's), forward and backward: the gradient made in the forward (two
matmuls a chunk) against checkpointed chunks (three), on one micro-batch of a real vocabulary.

    python -m benchmarks.frozen_head_loss                                            # CPU: 2 x 512 tokens, width 512
    python -m benchmarks.frozen_head_loss --device cuda --rows 4 --positions 1024 --hidden 2048 --vocab 128256 --bf16
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from aqpipe.pipeline.stages.lm_loss import causal_lm_loss


def timed(device: str, rows: int, positions: int, hidden_size: int, vocab: int, bf16: bool, chunk_bytes: int,
          frozen: bool, repeats: int) -> list[float]:
    """Seconds of each of `repeats` forward-and-backward passes (after one untimed)."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(device, torch.bfloat16 if bf16 else torch.float32)
    head.requires_grad_(not frozen)  # trainable: autograd asked for the hidden states' gradient alone, as frozen
    hidden = torch.randn(rows, positions, hidden_size, generator=generator).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (rows, positions), generator=generator).to(device)
    times = []
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = causal_lm_loss(head, hidden, labels, vocab, chunk_bytes=chunk_bytes)[0]
        torch.autograd.grad(loss, [hidden])
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, the head's weight bf16")
    p.add_argument("--chunk_mib", type=int, default=64, help="the float32 logits a chunk may hold")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    shape = (args.device, args.rows, args.positions, args.hidden, args.vocab, args.bf16, args.chunk_mib * 2**20)
    runs = {"checkpointed chunks": [], "frozen head, gradient in the forward": []}
    for _ in range(2):  # interleaved: a noisy machine weighs on both alike
        for name in runs:
            runs[name] += timed(*shape, frozen=name.startswith("frozen"), repeats=args.repeats)
    print(f"{args.device}: {args.rows} x {args.positions} tokens, width {args.hidden}, vocabulary {args.vocab}, "
          f"bf16={args.bf16}, {args.chunk_mib} MiB chunks, {torch.get_num_threads()} threads")
    base = statistics.median(runs["checkpointed chunks"])
    print("| loss, forward and backward | ms (median) | min-max | checkpointed / it |\n|---|---|---|---|")
    for name, times in runs.items():
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} | "
              f"{base / statistics.median(times):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
