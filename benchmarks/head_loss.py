"""The chunked causal-LM loss of a Linear head, forward and backward, on one micro-batch of a real vocabulary: its
gradients made in the forward (linear_cross_entropy.py) against checkpointed chunks (the path a head wrapped in more
than a Linear takes), for a frozen head (LoRA's: the hidden states' gradient alone; two matmuls a chunk against
three) and a trained one (a full fine-tune's: the weight's too; three against four). Item 2's candidates beside
them: the same path compiled (as `--compile` compiles the last stage whole) and, on a GPU, Liger Kernel's fused linear
cross-entropy (`--use_liger_kernel`). On a GPU each row gives the pass's peak memory above its inputs.

    python -m benchmarks.head_loss                                                   # CPU: 2 x 512 tokens, width 512
    python -m benchmarks.head_loss --device cuda --rows 4 --positions 1024 --hidden 2048 --vocab 128256 --bf16
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from aqpipe.pipeline.stages.lm_loss import causal_lm_loss

PATHS = {"checkpointed": "checkpointed chunks", "forward": "gradients in the forward",
         "compiled": "gradients in the forward, compiled", "liger": "Liger's fused linear cross-entropy"}


def timed(device: str, rows: int, positions: int, hidden_size: int, vocab: int, bf16: bool, chunk_bytes: int,
          trained: bool, path: str, repeats: int) -> tuple[list[float], float]:
    """(seconds of each of `repeats` forward-and-backward passes after one untimed, the peak MiB a pass allocated
    above its inputs: NaN on a CPU)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(hidden_size, vocab, bias=False).to(device)  # a full fine-tune: float32 masters
    if bf16 and not trained:  # LoRA's frozen base stays in its checkpoint's dtype
        linear.to(torch.bfloat16)
    linear.requires_grad_(trained)
    head = torch.nn.Sequential(linear) if path == "checkpointed" else linear  # not a Linear: checkpointed chunks
    hidden = torch.randn(rows, positions, hidden_size, generator=generator).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (rows, positions), generator=generator).to(device)
    wrt = [hidden, linear.weight] if trained else [hidden]
    loss_of = torch.compile(causal_lm_loss) if path == "compiled" else causal_lm_loss
    fused = "liger" if path == "liger" else None
    times, peak = [], float("nan")
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(head, hidden, labels, vocab, chunk_bytes=chunk_bytes, fused=fused)[0]
        grads = torch.autograd.grad(loss, wrt)
        if device == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - held) / 2**20
        times.append(time.perf_counter() - start)
        del loss, grads
    return times[1:], peak


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
    p.add_argument("--paths", default=None, help=f"comma-separated, of {', '.join(PATHS)} (default: the first "
                   "two on a CPU, all on a GPU; Liger's kernels need one)")
    args = p.parse_args(argv)
    paths = args.paths.split(",") if args.paths else list(PATHS) if args.device == "cuda" else list(PATHS)[:2]
    unknown = [path for path in paths if path not in PATHS]
    if unknown:
        p.error(f"--paths {','.join(unknown)}: expected some of {', '.join(PATHS)}")
    shape = (args.device, args.rows, args.positions, args.hidden, args.vocab, args.bf16, args.chunk_mib * 2**20)
    print(f"{args.device}: {args.rows} x {args.positions} tokens, width {args.hidden}, vocabulary {args.vocab}, "
          f"bf16={args.bf16}, {args.chunk_mib} MiB chunks, {torch.get_num_threads()} threads")
    print(f"| head | loss, forward and backward | ms (median) | min-max | {PATHS[paths[0]]} / it | peak MiB |\n"
          "|---|---|---|---|---|---|")
    for trained in (False, True):
        runs: dict[str, list[float]] = {path: [] for path in paths}
        peaks: dict[str, float] = {}
        for _ in range(2):  # interleaved: a noisy machine weighs on both alike
            for path in paths:
                times, peaks[path] = timed(*shape, trained=trained, path=path, repeats=args.repeats)
                runs[path] += times
        base = statistics.median(runs[paths[0]])
        for path, times in runs.items():
            print(f"| {'trained' if trained else 'frozen'} | {PATHS[path]} | {statistics.median(times) * 1e3:.1f} | "
                  f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} | {base / statistics.median(times):.2f}x | "
                  f"{'-' if math.isnan(peaks[path]) else f'{peaks[path]:.0f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
