"""Where a step's time goes: one stage of aqpipe against the plain loop, op by op, under torch.profiler (GPU issue,
item 1: "find where the 15% goes").

The model, micro-batches and optimizer are step_overhead's (a tied Llama with GPT-2's vocabulary as bf16
safetensors shards, AdamW fused on a GPU, clipping at 1.0). aqpipe runs as a script calls it (`aqpipe.finetune`, one
process); the plain loop is step_overhead's. Each is profiled over the steps after `--skip` warm-up steps. Printed: each
run's time a step by op (self time on the device, on a CPU the host's), the ops where aqpipe spends more or less than
the plain loop, and each run's host time a step, since a GPU step that waits on its host shows there.

    python -m benchmarks.step_profile                                          # CPU, small shape, ~40 s
    python -m benchmarks.step_profile --device cuda --shape 1b --bf16 --micro_batch_size 4 --seq_len 1024
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks.step_overhead import plain_loop, workload_flags, write_model


def _profiler(device: str, skip: int, active: int) -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    return profile(activities=activities, schedule=schedule(wait=skip, warmup=1, active=active))


def by_op(prof: profile, device: str, active: int) -> tuple[Counter, float, float]:
    """Milliseconds a step by op name, the device's total and the host's. An op's time is its self time on the
    device (the kernels it launched itself; a kernel launched from no op, as a compiled graph's may be, is in the
    total alone) where there is one, else on the host. The device's total sums the kernels and copies themselves,
    each once; the host's sums every op's self CPU time (what the Python and the dispatcher spent)."""
    times: Counter = Counter()
    total = host = 0.0
    for event in prof.key_averages():
        on_device = event.device_type != DeviceType.CPU
        own = (event.self_device_time_total if device == "cuda" else event.self_cpu_time_total) / 1e3 / active
        if on_device:
            total += own
            continue
        if own:
            times[event.key] += own
        host += event.self_cpu_time_total / 1e3 / active
    return times, (total if device == "cuda" else host), host


def engine_run(path: Path, work: Path, args: argparse.Namespace, on_step: Callable[[], None]) -> None:
    """aqpipe at one stage, as a script runs it; `on_step` after each training step (the profiler's clock)."""
    import aqpipe
    from aqpipe.pipeline import PipelineEngine

    train_batch = PipelineEngine.train_batch

    def stepped(self: Any, *a: Any, **k: Any) -> Any:
        out = train_batch(self, *a, **k)
        on_step()
        return out

    PipelineEngine.train_batch = stepped  # this process's engine only: the benchmark's clock, nothing else changes
    try:
        steps = args.skip + 1 + args.steps
        aqpipe.finetune("causal-lm", model=str(path), seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                        num_micro_batches=args.num_micro_batches, max_steps=steps,
                        max_train_samples=args.micro_batch_size * args.num_micro_batches * steps,
                        max_eval_samples=args.micro_batch_size, lr=1e-4, gradient_clipping=1.0, bf16=args.bf16,
                        output_dir=str(work / "engine"))
    finally:
        PipelineEngine.train_batch = train_batch


def table(rows: list[tuple[str, float, float]], heads: tuple[str, str, str]) -> str:
    lines = [f"| op | {heads[1]} | {heads[2]} |", "|---|---|---|"]
    lines += [f"| {name[:70]} | {a:.2f} | {b:.2f} |" for name, a, b in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_flags(p)
    p.add_argument("--skip", type=int, default=2, help="steps before the profiled ones (one more warms it up)")
    p.add_argument("--steps", type=int, default=3, help="steps profiled")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_model(work / "model", args.shape)
        runs = {}
        with _profiler(args.device, args.skip, args.steps) as prof:
            plain_loop(work / "model", args.device, args.bf16, args.micro_batch_size, args.num_micro_batches,
                       args.seq_len, args.skip + 1 + args.steps, on_step=prof.step)
        runs["plain"] = by_op(prof, args.device, args.steps)
        with _profiler(args.device, args.skip, args.steps) as prof:
            engine_run(work / "model", work, args, prof.step)
        runs["aqpipe"] = by_op(prof, args.device, args.steps)
    (plain, plain_total, plain_host), (ours, our_total, our_host) = runs["plain"], runs["aqpipe"]
    where = "device" if args.device == "cuda" else "host"
    print(f"{args.device}, {args.shape} shape, {args.micro_batch_size} x {args.num_micro_batches} x {args.seq_len} "
          f"tokens a step, bf16={args.bf16}; ms a step ({where} self time), {args.steps} steps profiled")
    print(f"{where} total: plain {plain_total:.1f}, aqpipe {our_total:.1f} (by op: {sum(plain.values()):.1f}, "
          f"{sum(ours.values()):.1f}); host: plain {plain_host:.1f}, aqpipe {our_host:.1f}\n")
    top = sorted(ours, key=ours.get, reverse=True)[:args.top]
    print(table([(k, ours[k], plain.get(k, 0.0)) for k in top], ("op", "aqpipe", "plain")) + "\n")
    gaps = sorted(set(ours) | set(plain), key=lambda k: -abs(ours.get(k, 0.0) - plain.get(k, 0.0)))[:args.top]
    print(table([(k, ours.get(k, 0.0) - plain.get(k, 0.0), plain.get(k, 0.0)) for k in gaps],
                ("op", "aqpipe - plain", "plain")))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "plain": plain, "aqpipe": ours,
                                               "total": {"plain": plain_total, "aqpipe": our_total},
                                               "host": {"plain": plain_host, "aqpipe": our_host}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
