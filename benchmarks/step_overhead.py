"""What the engine costs at one stage: a step of `aqpipe causal-lm` against a plain HF training loop.

The same model (a tied Llama with GPT-2's vocabulary, saved as bf16 safetensors shards as checkpoints ship), the same
micro-batch, micro-batch count and sequence length, the same optimizer (AdamW, fused on a GPU, as the trainer builds
it), the same clipping (norm 1.0) and, with --bf16, the same autocast over float32 weights. Each runs in a fresh
process: the plain loop in this module's own (`--plain`), the engine as users launch it (`python -m aqpipe causal-lm
...`), its seconds a step read from its metrics. Printed: seconds a step (median after the first steps), tokens a
second, the ratios plain / engine (1.0x: no overhead) and compiled plain / engine (the same loop with
`torch.compile(model)`: the model, its head and its loss compiled whole), and the plain loops' peak GPU memory. The
ratios are the figure: every run in one call, on one machine, one after the other.

    python -m benchmarks.step_overhead                              # CPU: a small shape, ~3 min on 2 cores
    python -m benchmarks.step_overhead --device cuda --shape 1b --bf16 --variants ,--compile,--param_dtype=bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

SHAPES = {  # tied Llamas with GPT-2's vocabulary: the head and its logits as large as a user's
    "small": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8},  # Llama-3.2-1B's shape
}


def write_model(path: Path, shape: str) -> int:
    """The shape's checkpoint (bf16 safetensors shards and GPT-2's tokenizer), random weights; its parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpt2_bpe import gpt2_bpe_tokenizer

    tokenizer = gpt2_bpe_tokenizer()
    config = LlamaConfig(**SHAPES[shape], vocab_size=50257, tie_word_embeddings=True, max_position_embeddings=4096,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="500MB")
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def plain_loop(path: Path, device: str, bf16: bool, mb: int, micro: int, seq: int, steps: int,
               compiled: bool = False, on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """A plain HF loop: float32 weights, the loss / micro backwarded per micro-batch, clipping, AdamW; `compiled`:
    the model under torch.compile, its head and loss inside the compiled graph; `on_step` after each step (a
    profiler's clock, step_profile.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    model.train()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=device == "cuda")
    g = torch.Generator(device=device).manual_seed(0)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        for _ in range(micro):
            ids = torch.randint(0, model.config.vocab_size, (mb, seq), device=device, generator=g)
            with autocast:
                loss = forward(input_ids=ids, labels=ids).loss
            (loss / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    del model, forward, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": times, "peak_gib": peak}


def engine(path: Path, work: Path, device: str, bf16: bool, mb: int, micro: int, seq: int, steps: int,
           extra: list[str]) -> dict[str, Any]:
    """`python -m aqpipe causal-lm` at one stage, as a user runs it; its seconds a step from its metrics."""
    out = work / ("engine" + "".join(f.strip("-").replace("=", "_") for f in extra))
    cmd = [sys.executable, "-m", "aqpipe", "causal-lm", "--model", str(path), "--seq_len", str(seq),
           "--micro_batch_size", str(mb), "--num_micro_batches", str(micro), "--max_steps", str(steps),
           "--max_train_samples", str(mb * micro * steps), "--max_eval_samples", str(mb), "--lr", "1e-4",
           "--gradient_clipping", "1.0", "--output_dir", str(out), *(["--bf16"] if bf16 else []),
           *(a for f in extra for a in f.split("=", 1))]
    failed = _run(cmd, device)
    if failed:
        return {"seconds": [], "peak_gib": None, "failed": failed}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    return {"seconds": [r["seconds"] for r in rows], "peak_gib": None}


def plain_process(path: Path, work: Path, device: str, bf16: bool, mb: int, micro: int, seq: int, steps: int,
                  compiled: bool = False) -> dict[str, Any]:
    """plain_loop in a fresh process, as the engine runs: neither inherits this one's allocations."""
    out = work / f"plain{'_compiled' if compiled else ''}.json"
    failed = _run([sys.executable, "-m", "benchmarks.step_overhead", "--plain", str(path), "--json", str(out),
                   "--device", device, *(["--bf16"] if bf16 else []), "--micro_batch_size", str(mb),
                   "--num_micro_batches", str(micro), "--seq_len", str(seq), "--steps", str(steps),
                   *(["--compiled_plain"] if compiled else [])], device)
    if failed:
        if compiled:  # a compiler missing, say: reported as the engine's variants are
            return {"seconds": [], "peak_gib": None, "failed": failed}
        raise SystemExit(f"step_overhead: the plain loop, the baseline, {failed}")
    return json.loads(out.read_text())


def _run(cmd: list[str], device: str) -> str | None:
    """Runs `cmd`; None, or the end of its error output where it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}" if proc.returncode else None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_after(times: list[float], skip: int) -> float:
    return statistics.median(times[skip:] if len(times) > skip else times)


def workload_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say the workload (device, shape, precision, micro-batches), shared with step_profile.py."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over float32 weights, in both")
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--num_micro_batches", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_flags(p)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the median (warm-up, compilation)")
    p.add_argument("--variants", default="", help="the engine's extra flags per run, comma-separated ('' = none)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--no_compiled_plain", dest="compiled_plain", action="store_false",
                   help="leave out the compiled plain loop's row (its compilation takes a minute or two)")
    p.add_argument("--compiled_plain", action="store_true", help=argparse.SUPPRESS)  # internal, with --plain
    p.add_argument("--plain", help=argparse.SUPPRESS)  # internal: run the plain loop on this checkpoint alone
    args = p.parse_args(argv)
    torch.manual_seed(0)
    job = (args.device, args.bf16, args.micro_batch_size, args.num_micro_batches, args.seq_len, args.steps)
    if args.plain:
        Path(args.json).write_text(json.dumps(plain_loop(Path(args.plain), *job, compiled=args.compiled_plain)))
        return 0
    tokens = args.micro_batch_size * args.num_micro_batches * args.seq_len
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                              "shape": args.shape, "bf16": args.bf16, "tokens_per_step": tokens,
                              "threads": torch.get_num_threads(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result["parameters"] = write_model(work / "model", args.shape)
        runs = {"plain HF loop": lambda: plain_process(work / "model", work, *job)}
        if args.compiled_plain:
            runs["plain HF loop, torch.compile(model)"] = lambda: plain_process(work / "model", work, *job,
                                                                                compiled=True)
        for variant in args.variants.split(","):
            extra = variant.split() if variant else []
            runs["aqpipe, 1 stage" + (f" {variant}" if variant else "")] = \
                lambda extra=extra: engine(work / "model", work, *job, extra)
        print(f"{result['device']}, {result['parameters'] / 1e6:.0f}M parameters, {tokens} tokens a step, "
              f"bf16={args.bf16}, {result['threads']} threads")
        print("| run | s/step | tokens/s | plain / run | compiled plain / run | peak GiB |\n|---|---|---|---|---|---|")
        base = compiled = None
        for name, fn in runs.items():
            figures = fn()
            if figures.get("failed"):  # a variant that fails (a compiler missing, say) is reported, not fatal
                result["runs"][name] = figures
                print(f"| {name} | failed | - | - | - | - |\n{figures['failed']}", flush=True)
                continue
            s = median_after(figures["seconds"], args.skip)
            base = base or s
            if "torch.compile" in name:
                compiled = s
            result["runs"][name] = {**figures, "median": s}
            peak = "-" if figures["peak_gib"] is None else f"{figures['peak_gib']:.1f}"
            versus = "-" if compiled is None else f"{compiled / s:.2f}x"
            print(f"| {name} | {s:.3f} | {tokens / s:.0f} | {base / s:.2f}x | {versus} | {peak} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
