"""Data-parallel algorithms side by side: bytes per step, loss and seconds per step, same model and data.

Each algorithm runs the GPT2 recipe (AQ-SGD 2/4 on the pipeline boundary, as the recipe defaults) as
2 stages x R replicas with the same seed, data and step count; the table reads their summary.json and
metrics.jsonl. On loopback every process is a torchrun worker on this machine; with --rate (root)
every process gets its own network namespace whose uplink is shaped to the rate
(benchmarks/netns.py), so the pipeline boundary, the tied weight's rows and the data-parallel link
all cross a slow link, as on R x 2 machines.

    python -m benchmarks.bench_data_parallel [--steps 40] [--replicas 2,4] [--algorithms allreduce,qadam]
    sudo python -m benchmarks.bench_data_parallel --rate 100mbit --replicas 2,4
    python -m benchmarks.bench_data_parallel --quick      # tiny shapes, few steps (the test suite)
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

from benchmarks.netns import Network, can_build  # noqa: E402
from benchmarks.recipe_runs import free_port  # noqa: E402
from benchmarks.slow_link import launch  # noqa: E402

ALGORITHMS = ("allreduce", "decentralized", "low_precision_decentralized", "qadam", "qsparse_local_sgd",
              "cocktail_sgd")
STAGES = 2
SCRIPT = str(ROOT / "recipes" / "finetune_gpt2.py")


def options_for(algorithm: str, steps: int, quick: bool) -> list[str]:
    """Each algorithm's settings: QAdam warms up for a quarter of the run; Qsparse syncs every 4 steps with its
    top 5%; CocktailSGD at its defaults (10% random, 1% sent, 8 bits)."""
    if algorithm == "qadam":
        return ["--dp_warmup_steps", str(2 if quick else max(1, steps // 4))]
    if algorithm == "qsparse_local_sgd":
        return ["--dp_local_steps", str(2 if quick else 4), "--dp_topk_ratio", "0.05"]
    return []


def run_one(algorithm: str, replicas: int, steps: int, out: Path, extra: list[str], net: Network | None) -> dict:
    args = ["--pipeline_stages", str(STAGES), "--replicas", str(replicas), "--dp_algorithm", algorithm,
            "--max_steps", str(steps), "--output_dir", str(out), "--overwrite_output_dir", *extra]
    if net is None:
        cmd = ["torchrun", "--nproc_per_node", str(STAGES * replicas), "--master_port", str(free_port()), SCRIPT, *args]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{algorithm} x{replicas} failed:\n{proc.stderr[-3000:]}")
    else:  # one process per namespace: every link shaped
        launch([SCRIPT], args, STAGES * replicas, net, out.parent / f"{out.name}.log", timeout=3600)
    return figures(out, algorithm, replicas)


def figures(out: Path, algorithm: str, replicas: int) -> dict:
    """One row of the table from a run's metrics.jsonl and summary.json; seconds per step (median and mean) over the
    steps after the first epoch (AQ-SGD sends each sample whole on its first visit)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    cfg = summary["config"]
    per_replica_step = cfg["micro_batch_size"] * cfg["num_micro_batches"]
    per_epoch = max(1, summary["train_samples"] // replicas // per_replica_step)  # AQ-SGD's whole first visits
    later = [r for r in steps_rows if r["step"] > per_epoch] or steps_rows[1:] or steps_rows
    return {
        "algorithm": algorithm, "replicas": replicas, "steps": len(steps_rows),
        "dp_bytes_per_step": statistics.mean(r["dp_bytes"] for r in steps_rows),
        "dp_bytes_last_step": steps_rows[-1]["dp_bytes"],
        "wire_bytes_last_step": {k: steps_rows[-1].get(k, 0) for k in ("fwd_bytes", "bwd_bytes", "tie_bytes",
                                                                        "dp_bytes")},
        "loss_first_5": statistics.mean(r["loss"] for r in steps_rows[:5]),
        "loss_last_5": statistics.mean(r["loss"] for r in steps_rows[-5:]),
        "eval_loss": summary.get("eval_loss"), "seconds": summary["seconds"],
        "seconds_per_step": statistics.median(r["seconds"] for r in later),
        # the mean counts the sync steps of an algorithm that syncs every few steps (Qsparse), which the median skips
        "seconds_per_step_mean": statistics.mean(r["seconds"] for r in later),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--replicas", default="2", help="comma-separated replica counts (2 stages each)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--rate", help="shape every process's link to this rate (e.g. 100mbit; needs root)")
    p.add_argument("--output_dir", default="runs/bench_data_parallel")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (for the test suite)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    extra = []
    if args.quick:
        args.steps = min(args.steps, 6)
        extra = ["--seq_len", "32", "--max_train_samples", "64", "--max_eval_samples", "8", "--micro_batch_size", "2",
                 "--num_micro_batches", "2"]
    counts = [int(r) for r in args.replicas.split(",")]
    rows = []
    print(f"{'R':>2} {'algorithm':<28} {'steps':>5} {'dp MB/step':>10} {'last MB':>8} {'vs allreduce':>12} "
          f"{'loss first5':>11} {'loss last5':>10} {'eval':>7} {'s/step':>7}")
    net = None
    if args.rate:
        why = can_build()
        if why:
            raise SystemExit(f"--rate {args.rate}: {why}")
        net = Network(STAGES * max(counts)).up()
    try:
        for replicas in counts:
            if net is not None:
                net.shape(args.rate)
            base = None
            for algorithm in args.algorithms.split(","):
                out = Path(args.output_dir) / f"r{replicas}" / algorithm
                r = run_one(algorithm, replicas, args.steps, out,
                            extra + options_for(algorithm, args.steps, args.quick), net)
                r["rate"] = args.rate or "loopback"
                rows.append(r)
                base = r["dp_bytes_per_step"] if algorithm == "allreduce" else base
                ratio = f"{r['dp_bytes_per_step'] / base:.4f}" if base else "-"
                print(f"{replicas:>2} {r['algorithm']:<28} {r['steps']:>5} {r['dp_bytes_per_step'] / 1e6:>10.3f} "
                      f"{r['dp_bytes_last_step'] / 1e6:>8.3f} {ratio:>12} {r['loss_first_5']:>11.3f} "
                      f"{r['loss_last_5']:>10.3f} {r['eval_loss'] or float('nan'):>7.3f} "
                      f"{r['seconds_per_step']:>7.3f}", flush=True)
    finally:
        if net is not None:
            net.down()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
