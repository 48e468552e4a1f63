"""The bytes-loss frontier of a one-epoch fine-tune: every wire's bytes a step against the eval loss, in the
trainer and of the export scored by plain transformers.

The WAN workload of benchmarks/wan.py (its pretrained tied Llama, its held-out corpus, 2 stages, 32 steps), on
loopback: the curves do not depend on the link (wan.py times them on one). Rows: the bf16 wire, today's lean row
before the subspace codec, and the subspace codec at several ranks and bits (forward and backward in one basis, the
tied embedding's gradients in one of their own). Each row's export (`<run>/model`) is scored with
benchmarks/export_score.py against the bf16 row's.

    python -m benchmarks.wan_frontier --output_dir runs/wan          # ~25 min on 2 cores (pretraining: wan.py's)
    python -m benchmarks.wan_frontier --rows bf16,subspace_wan --lora_rank 16 --lr 1e-3   # LoRA
    python -m benchmarks.wan_frontier --width 1024 --output_dir runs/wan1024 --timeout 5400   # a wider model
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.export_score import score
from benchmarks.recipe_runs import free_port
from benchmarks.slow_link import LLAMA_SCRIPT, Shape
from benchmarks.wan import ROWS, WIRES, curve, job_flags, prepare, run

SUBSPACE = ["--forward_compress", "subspace", "--backward_compress", "subspace", "--scale_dtype", "bfloat16"]


def subspace(rank: int, bits: int, tie_bits: int, tie_rank: int) -> list[str]:
    return [*SUBSPACE, "--subspace_rank", str(rank), "--forward_bits", str(bits), "--backward_bits", str(bits),
            "--tie_bits", str(tie_bits), "--tie_rank", str(tie_rank)]


FRONTIER: dict[str, list[str]] = {
    "bf16": ROWS["bf16"],
    "aqsgd_lean2_bf16s": ROWS["aqsgd_lean2_bf16s"],  # the leanest row before the subspace codec
    "r32_b3_tie2": [*subspace(32, 3, 2, 32)[:-2], "--tie_rank", "0"],  # the tie's gradients dense
    "r32_b3_tie2_g32": subspace(32, 3, 2, 32),
    "r32_b4_tie3_g32": subspace(32, 4, 3, 32),
    "r64_b3_tie2_g32": subspace(64, 3, 2, 32),
    "r16_b4_tie3_g16": subspace(16, 4, 3, 16),
    "r16_b5_tie2_g16": subspace(16, 5, 2, 16),
    "r8_b5_tie2_g16": subspace(8, 5, 2, 16),
    "subspace_wan": ROWS["subspace_wan"],  # the preset: rank 16, 4 bits, the tie at 2 bits and rank 16
}


def _rel(value: float, reference: float) -> str:
    return f"{100 * (value / reference - 1):+.2f}%"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def table(rows: dict[str, dict[str, Any]]) -> str:
    bf16 = rows.get("bf16")
    out = ["| row | fwd MB/step | bwd | tie | all | vs bf16: fwd | bwd | tie | all | eval loss | vs bf16 | export "
           "loss | vs bf16's export |", "|" + "---|" * 13]
    for name, row in rows.items():
        b, total = row["bytes"], sum(row["bytes"].values())
        ratio = {w: (bf16["bytes"][w] / b[w] if bf16 and b[w] else None) for w in WIRES}
        loss, export = row["evals"][-1][1], row["export_loss"]
        out.append(f"| {name} | {b['fwd_bytes'] / 1e6:.4f} | {b['bwd_bytes'] / 1e6:.4f} | {b['tie_bytes'] / 1e6:.4f} | "
                   f"{total / 1e6:.4f} | {_times(ratio['fwd_bytes'])} | {_times(ratio['bwd_bytes'])} | "
                   f"{_times(ratio['tie_bytes'])} | {_times(sum(bf16['bytes'].values()) / total if bf16 else None)} | "
                   f"{loss:.4f} | {_rel(loss, bf16['evals'][-1][1]) if bf16 else '-'} | {export:.4f} | "
                   f"{_rel(export, bf16['export_loss']) if bf16 else '-'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(FRONTIER), help=f"of {', '.join(FRONTIER)}")
    p.add_argument("--output_dir", default="runs/wan", help="wan.py's: its pretrained start and corpus are reused")
    p.add_argument("--tag", default="frontier", help="the runs go under <output_dir>/<tag>")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters instead of every weight (0: full)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--width", type=int, default=256, help="a wider model pretrains its own start in --output_dir")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in FRONTIER:
            p.error(f"row {r!r}: expected one of {', '.join(FRONTIER)}")
    shape = Shape(width=args.width, layers=args.layers, family="llama", vocab="gpt2", seq_len=128, micro_batch_size=4,
                  num_micro_batches=4)
    out = Path(args.output_dir)
    model, corpus = prepare(shape, out, args.pretrain_steps, args.timeout)
    extra = ["--lr", str(args.lr), "--seed", str(args.seed)]
    extra += ["--lora_rank", str(args.lora_rank)] if args.lora_rank else []
    results: dict[str, dict[str, Any]] = {}
    for name in rows:
        run_dir = out / args.tag / name
        flags = [*job_flags(shape, model, corpus, args.samples, 1, 64, 4), *FRONTIER[name], *extra,
                 "--output_dir", str(run_dir)]
        run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), *LLAMA_SCRIPT, *flags],
            run_dir.with_suffix(".log"), args.timeout)
        ran = curve(run_dir)  # one epoch: its steps' mean bytes are the first epoch's
        results[name] = {"bytes": ran["bytes_first_epoch"], "evals": ran["evals"], "flags": FRONTIER[name] + extra,
                         "export_loss": score(str(run_dir / "model"), str(corpus), shape.seq_len, 64)}
        print(f"{name}: eval {results[name]['evals'][-1][1]:.4f}, export {results[name]['export_loss']:.4f}",
              flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
