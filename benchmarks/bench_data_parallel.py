"""Data-parallel algorithms side by side: bytes per step and loss after N steps, same model and data.

Each algorithm runs the GPT2 recipe as 2 stages x 2 replicas (4 processes, torchrun) with the same
seed, data and step count; the table reads their summary.json and metrics.jsonl.

    python -m benchmarks.bench_data_parallel [--steps 60] [--algorithms allreduce,qadam] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.recipe_runs import free_port  # noqa: E402
ALGORITHMS = ("allreduce", "decentralized", "low_precision_decentralized", "qadam", "qsparse_local_sgd")


def run_one(algorithm: str, steps: int, out: Path, extra: list[str]) -> dict:
    cmd = ["torchrun", "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(ROOT / "recipes" / "finetune_gpt2.py"), "--pipeline_stages", "2", "--replicas", "2",
           "--dp_algorithm", algorithm, "--max_steps", str(steps), "--output_dir", str(out), "--overwrite_output_dir",
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{algorithm} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "algorithm": algorithm, "steps": len(steps_rows),
        "dp_bytes_per_step": statistics.mean(r["dp_bytes"] for r in steps_rows),
        "dp_bytes_last_step": steps_rows[-1]["dp_bytes"],
        "loss_first_5": statistics.mean(r["loss"] for r in steps_rows[:5]),
        "loss_last_5": statistics.mean(r["loss"] for r in steps_rows[-5:]),
        "eval_loss": summary.get("eval_loss"), "seconds": summary["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--output_dir", default="runs/bench_data_parallel")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (for the test suite)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    extra = ["--dp_warmup_steps", str(max(1, args.steps // 4)), "--dp_local_steps", "4", "--dp_topk_ratio", "0.05"]
    if args.quick:
        args.steps = min(args.steps, 6)
        extra = ["--seq_len", "32", "--max_train_samples", "64", "--max_eval_samples", "8", "--micro_batch_size", "2",
                 "--num_micro_batches", "2", "--dp_warmup_steps", "2", "--dp_local_steps", "2",
                 "--dp_topk_ratio", "0.05"]
    rows = []
    print(f"{'algorithm':<28} {'steps':>5} {'dp MB/step':>10} {'last MB':>8} {'vs allreduce':>12} "
          f"{'loss first5':>11} {'loss last5':>10} {'eval':>7}")
    for algorithm in args.algorithms.split(","):
        r = run_one(algorithm, args.steps, Path(args.output_dir) / algorithm, extra)
        rows.append(r)
        base = rows[0]["dp_bytes_per_step"] if rows[0]["algorithm"] == "allreduce" else None
        ratio = f"{r['dp_bytes_per_step'] / base:.3f}" if base else "-"
        print(f"{r['algorithm']:<28} {r['steps']:>5} {r['dp_bytes_per_step'] / 1e6:>10.3f} "
              f"{r['dp_bytes_last_step'] / 1e6:>8.3f} {ratio:>12} {r['loss_first_5']:>11.3f} "
              f"{r['loss_last_5']:>10.3f} {r['eval_loss'] or float('nan'):>7.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
