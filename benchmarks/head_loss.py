"""The chunked causal-LM loss of a Linear head, forward and backward, on one micro-batch of a real vocabulary: its
gradients made in the forward (linear_cross_entropy.py) against checkpointed chunks (the path a head wrapped in more
than a Linear takes), for a frozen head (LoRA's: the hidden states' gradient alone; two matmuls a chunk against
three) and a trained one (a full fine-tune's: the weight's too; three against four).

    python -m benchmarks.head_loss                                                   # CPU: 2 x 512 tokens, width 512
    python -m benchmarks.head_loss --device cuda --rows 4 --positions 1024 --hidden 2048 --vocab 128256 --bf16
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from aqpipe.pipeline.stages.lm_loss import causal_lm_loss

PATHS = ("checkpointed chunks", "gradients in the forward")


def timed(device: str, rows: int, positions: int, hidden_size: int, vocab: int, bf16: bool, chunk_bytes: int,
          trained: bool, path: str, repeats: int) -> list[float]:
    """Seconds of each of `repeats` forward-and-backward passes (after one untimed)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(hidden_size, vocab, bias=False).to(device)  # a full fine-tune: float32 masters
    if bf16 and not trained:  # LoRA's frozen base stays in its checkpoint's dtype
        linear.to(torch.bfloat16)
    linear.requires_grad_(trained)
    head = linear if path == PATHS[1] else torch.nn.Sequential(linear)  # more than a Linear: checkpointed chunks
    hidden = torch.randn(rows, positions, hidden_size, generator=generator).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (rows, positions), generator=generator).to(device)
    wrt = [hidden, linear.weight] if trained else [hidden]
    times = []
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = causal_lm_loss(head, hidden, labels, vocab, chunk_bytes=chunk_bytes)[0]
        torch.autograd.grad(loss, wrt)
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
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast; a frozen head's weight bf16 (LoRA's base), a trained one's float32")
    p.add_argument("--chunk_mib", type=int, default=64, help="the float32 logits a chunk may hold")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    shape = (args.device, args.rows, args.positions, args.hidden, args.vocab, args.bf16, args.chunk_mib * 2**20)
    print(f"{args.device}: {args.rows} x {args.positions} tokens, width {args.hidden}, vocabulary {args.vocab}, "
          f"bf16={args.bf16}, {args.chunk_mib} MiB chunks, {torch.get_num_threads()} threads")
    print("| head | loss, forward and backward | ms (median) | min-max | checkpointed / it |\n|---|---|---|---|---|")
    for trained in (False, True):
        runs: dict[str, list[float]] = {path: [] for path in PATHS}
        for _ in range(2):  # interleaved: a noisy machine weighs on both alike
            for path in PATHS:
                runs[path] += timed(*shape, trained=trained, path=path, repeats=args.repeats)
        base = statistics.median(runs[PATHS[0]])
        for path, times in runs.items():
            print(f"| {'trained' if trained else 'frozen'} | {path} | {statistics.median(times) * 1e3:.1f} | "
                  f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} | {base / statistics.median(times):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
