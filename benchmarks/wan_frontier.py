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
    python -m benchmarks.wan_frontier --width 2048 --output_dir runs/wan2048 --seeds 7,8 --jobs 4 \
        --rows bf16,subspace_wan,wan_own,wan_own_ef   # on a GPU: two seeds, four runs at once
    ... --time_mbit 100,0.25       # then each row's step on emulated links, and its time to the 1% target

The gradient's basis (`wan_own*` rows): the preset's backward in a basis of the gradients' own, with error feedback
(`_ef`) or without (the activations' basis with feedback, measured once, is refused since: RESULTS.md). The tie's
rows (`wan_tierows*`): their changes as 16 coefficients a row in a basis of their own, then the bytes that saves
spent on the tie's bits (`_t3`), the boundary's rank (`_r32`) or its bits (`_b5`). `*_auto`: the boundary's rank
chosen at each refresh, the fewest directions that keep 99% of the energy sent (at most 64).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.export_score import score
from benchmarks.recipe_runs import free_port
from benchmarks.slow_link import LLAMA_SCRIPT, Shape
from benchmarks.wan import ROWS, SLACK, WIRES, curve, job_flags, prepare, records, run

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
    "wan_own": [*ROWS["subspace_wan"], "--backward_basis", "own"],  # the gradients in a basis of their own
    "wan_own_ef": [*ROWS["subspace_wan"], "--backward_basis", "own", "--backward_feedback"],  # and error feedback
    "wan_own_r32": [*ROWS["subspace_wan"], "--backward_basis", "own", "--subspace_rank", "32"],
    "wan_tierows": [*ROWS["subspace_wan"], "--tie_rows_rank", "16"],  # the tie's rows' changes in a basis too
    "wan_tierows_t3": [*ROWS["subspace_wan"], "--tie_rows_rank", "16", "--tie_bits", "3"],
    "wan_tierows_r32": [*ROWS["subspace_wan"], "--tie_rows_rank", "16", "--subspace_rank", "32"],
    "wan_tierows_b5": [*ROWS["subspace_wan"], "--tie_rows_rank", "16", "--forward_bits", "5", "--backward_bits", "5"],
    "wan_auto": [*ROWS["subspace_wan"], "--subspace_rank", "auto"],  # the rank that keeps 99% of the energy, <= 64
    "wan_tierows_auto": [*ROWS["subspace_wan"], "--tie_rows_rank", "16", "--subspace_rank", "auto"],
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


def two_stages(flags: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """The fine-tune on 2 stages under torchrun, on a port of its own (runs may go at once)."""
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         *LLAMA_SCRIPT, *flags], log, timeout, env)


SCORING = threading.Lock()  # transformers' loading is not thread-safe (its empty-weights context is process-wide)


def one_row(name: str, seed: int, args: argparse.Namespace, shape: Shape, model: Path, corpus: Path,
            out: Path) -> dict[str, Any]:
    """One row's fine-tune (seed `seed`) and its export's score."""
    extra = ["--lr", str(args.lr), "--seed", str(seed)]
    extra += ["--lora_rank", str(args.lora_rank)] if args.lora_rank else []
    run_dir = out / (args.tag if len(args.seed_list) == 1 else f"{args.tag}_seed{seed}") / name
    flags = [*job_flags(shape, model, corpus, args.samples, 1, 64, 4), *FRONTIER[name], *extra,
             "--output_dir", str(run_dir)]
    two_stages(flags, run_dir.with_suffix(".log"), args.timeout)
    ran = curve(run_dir)  # one epoch: its steps' mean bytes are the first epoch's
    with SCORING:
        export_loss = score(str(run_dir / "model"), str(corpus), shape.seq_len, 64)
    row = {"bytes": ran["bytes_first_epoch"], "evals": ran["evals"], "flags": FRONTIER[name] + extra,
           "export_loss": export_loss}
    print(f"seed {seed} {name}: eval {row['evals'][-1][1]:.4f}, export {row['export_loss']:.4f}", flush=True)
    return row


def timed(name: str, seed: int, mbit: float, args: argparse.Namespace, shape: Shape, model: Path, corpus: Path,
          out: Path) -> float | None:
    """Median seconds of a step of row `name` on a link the transport emulates (`mbit`, and --latency_ms a message),
    --timing_steps steps, the first left out; None where its bytes alone would take more than --timing_budget."""
    curve_run = args.results.get(seed, {}).get(name)
    if curve_run and sum(curve_run["bytes"].values()) * 8 / (mbit * 1e6) * args.timing_steps > args.timing_budget:
        return None
    run_dir = out / f"timing_seed{seed}_{mbit:g}mbit" / name
    flags = [*job_flags(shape, model, corpus, args.samples, 1, 64, args.timing_steps + 1), *FRONTIER[name],
             "--lr", str(args.lr), "--seed", str(seed), "--max_steps", str(args.timing_steps),
             "--output_dir", str(run_dir)]
    env = {**os.environ, "AQPIPE_LINK_MBIT": f"{mbit:g}", "AQPIPE_LINK_LATENCY_MS": f"{args.latency_ms:g}"}
    two_stages(flags, run_dir.with_suffix(".log"), args.timeout, env)
    steps = [r["seconds"] for r in records(run_dir) if "loss" in r][1:]
    return statistics.median(steps) if steps else None


def to_target(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's steps to within SLACK of its seed's bf16 row's final eval loss, and the time to it at each timed
    rate (those steps at the row's step time there)."""
    target = rows["bf16"]["evals"][-1][1] * (1 + SLACK) if "bf16" in rows else None
    for row in rows.values():
        steps = next((step for step, loss in row["evals"] if target is not None and loss <= target), None)
        row["steps_to_target"] = steps
        row["time_to_target"] = {rate: (steps * s if steps is not None and s is not None else None)
                                 for rate, s in row.get("step_s", {}).items()}


def time_table(rows: dict[str, dict[str, Any]], rates: list[float]) -> str:
    head = "| row | steps to 1% above bf16's final eval | " + " | ".join(
        f"s/step at {r:g} Mbit/s | time to it" for r in rates) + " |"
    out = [head, "|" + "---|" * (2 + 2 * len(rates))]
    for name, row in rows.items():
        cells = []
        for rate in rates:
            s, t = row.get("step_s", {}).get(str(rate)), row.get("time_to_target", {}).get(str(rate))
            cells += ["-" if s is None else f"{s:.3f}", "-" if t is None else f"{t:.1f} s"]
        steps = row.get("steps_to_target")
        out.append(f"| {name} | {'not reached' if steps is None else steps} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(FRONTIER), help=f"of {', '.join(FRONTIER)}")
    p.add_argument("--output_dir", default="runs/wan", help="wan.py's: its pretrained start and corpus are reused")
    p.add_argument("--tag", default="frontier", help="the runs go under <output_dir>/<tag> (<tag>_seed<N> for "
                                                     "several seeds)")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters instead of every weight (0: full)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--seeds", help="several fine-tune seeds, comma-separated (instead of --seed): a table each")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (a GPU shared by several; 1 on CPUs)")
    p.add_argument("--width", type=int, default=256, help="a wider model pretrains its own start in --output_dir")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", help="also write the figures here (several seeds: keyed by seed)")
    p.add_argument("--time_mbit", default="", help="emulated link rates, Mbit/s, comma-separated (e.g. 100,0.25): "
                   "each row's step timed there, one run at a time after the curves, and its time to the 1%% target")
    p.add_argument("--latency_ms", type=float, default=50.0, help="the emulated link's one-way delay a message")
    p.add_argument("--timing_steps", type=int, default=4)
    p.add_argument("--timing_budget", type=float, default=120.0,
                   help="seconds a timed run's bytes may take on the link; a row over it is not timed there")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in FRONTIER:
            p.error(f"row {r!r}: expected one of {', '.join(FRONTIER)}")
    args.seed_list = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    shape = Shape(width=args.width, layers=args.layers, family="llama", vocab="gpt2", seq_len=128, micro_batch_size=4,
                  num_micro_batches=4)
    out = Path(args.output_dir)
    model, corpus = prepare(shape, out, args.pretrain_steps, args.timeout)
    results: dict[int, dict[str, dict[str, Any]]] = {seed: {} for seed in args.seed_list}
    lock = threading.Lock()

    def task(seed: int, name: str) -> None:
        row = one_row(name, seed, args, shape, model, corpus, out)
        with lock:  # the figures so far, written as each row ends: a run cut short keeps what it finished
            results[seed][name] = row
            write()

    def write() -> None:
        if args.json:
            ordered = {s: {n: results[s][n] for n in rows if n in results[s]} for s in args.seed_list}
            figures = ordered[args.seed_list[0]] if len(ordered) == 1 else {str(k): v for k, v in ordered.items()}
            Path(args.json).write_text(json.dumps(figures, indent=1))

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for future in [pool.submit(task, seed, name) for seed in args.seed_list for name in rows]:
            future.result()
    rates = [float(r) for r in args.time_mbit.split(",") if r]
    args.results = results
    for rate in rates:  # one run at a time: timings side by side are worthless
        for seed in args.seed_list:
            for name in rows:
                step_s = timed(name, seed, rate, args, shape, model, corpus, out)
                results[seed][name].setdefault("step_s", {})[str(rate)] = step_s
                print(f"seed {seed} {name} at {rate:g} Mbit/s: {step_s} s a step", flush=True)
                write()
    for seed, table_rows in results.items():
        to_target(table_rows)
        print(f"seed {seed}:" if len(results) > 1 else "")
        print(table({name: table_rows[name] for name in rows}))
        if rates:
            print(time_table({name: table_rows[name] for name in rows}, rates))
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
