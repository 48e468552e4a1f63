"""The WAN score: time to a target loss of a fine-tune whose stages sit on two sides of a shaped wide-area link.

Scored as ProtocolNanoGPT scores: steps to a target validation loss x the steady time of a step on the link, the
target being the bf16 wire's final eval loss. Bytes explain the result; the time is the result.

1. A tied Llama shape with GPT-2's 50257-token vocabulary (bf16 safetensors shards, as checkpoints ship) is
   pretrained at FP32 on the plays (one process), then fine-tuned on a held-out corpus (the standard library's
   docstrings, benchmarks/docstring_corpus.py) for 1 and 3 epochs on 2 stages.
2. Curves: each row's fine-tune on loopback, evaluated every --eval_every steps: its eval-loss curve and the bytes of
   every wire per step (neither depends on the link).
3. Timing: each row's first-epoch and later steps on the shaped link, one network namespace per stage (tbf for the
   rate: benchmarks/netns.py) plus a one-way delay per message in the transport (AQPIPE_LINK_LATENCY_MS: this
   kernel has no netem), a few steps of each epoch kind, median seconds and bubble.
4. Score per row: the first eval step at or below the target, and the time to it (each step counted at its
   epoch's steady time).

    sudo python -m benchmarks.wan                           # the table of benchmarks/RESULTS.md (~40 min on 2 cores)
    sudo python -m benchmarks.wan --jobs 1 --rows bf16,aqsgd_first_visit   # a subset
    sudo python -m benchmarks.wan --curves_from benchmarks/results/wan.json --rate 1mbit   # re-time, new rows only
    python -m benchmarks.wan --quick --no_netns             # a tiny shape on loopback, minutes, for a smoke test

Writes results.json and prints the table; every run's metrics.jsonl stays under --output_dir.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.netns import Network, can_build, rate_bits
from benchmarks.recipe_runs import free_port
from benchmarks.slow_link import LLAMA_SCRIPT, ROOT, Shape, launch, write_llama

AQSGD = ["--forward_compress", "aqsgd", "--forward_bits", "2", "--backward_compress", "direct", "--backward_bits", "4"]
ROWS: dict[str, list[str]] = {
    "fp32": ["--forward_compress", "none", "--backward_compress", "none"],
    "bf16": ["--forward_compress", "none", "--backward_compress", "none", "--bf16"],
    "direct_4": ["--forward_compress", "direct", "--forward_bits", "4", "--backward_compress", "direct",
                 "--backward_bits", "4"],
    "hadamard_4": ["--forward_compress", "hadamard", "--forward_bits", "4", "--backward_compress", "direct",
                   "--backward_bits", "4"],  # TAH-Quant's uniform-width cousin: cache-free, rotated
    "aqsgd_whole": [*AQSGD, "--first_visit_compress", "none"],  # the paper's AQ-SGD: first visits whole
    "aqsgd_first_visit": [*AQSGD, "--first_visit_compress", "hadamard", "--first_visit_bits", "3",
                          "--first_visit_base", "position"],  # the trainer's one-epoch preset
}
FIRST_VISIT = ROWS["aqsgd_first_visit"]
ROWS["aqsgd_tie4"] = [*FIRST_VISIT, "--tie_bits", "4"]  # the tied weight's rows and gradients at 4 bits
ROWS["aqsgd_lean"] = [*FIRST_VISIT, "--tie_bits", "4", "--backward_bits", "3"]  # and the backward at 3
ROWS["aqsgd_bw2"] = [*FIRST_VISIT, "--tie_bits", "4", "--backward_bits", "2"]  # the backward at 2
ROWS["aqsgd_lean2"] = [*FIRST_VISIT, "--tie_bits", "2", "--backward_bits", "2"]  # and the tie at 2 too
ROWS["aqsgd_lean_bf16s"] = [*ROWS["aqsgd_lean"], "--scale_dtype", "bfloat16"]  # groups' scales in 4 bytes, not 8
ROWS["aqsgd_lean2_bf16s"] = [*ROWS["aqsgd_lean2"], "--scale_dtype", "bfloat16"]
ROWS["subspace_wan"] = ["--compression_preset", "wan"]  # every wire in a subspace: the preset, as users run it
ROWS["subspace_wan_tie3"] = ["--compression_preset", "wan", "--tie_bits", "3"]  # the preset, the tie a bit wider
CURVE_KEYS = ("evals", "final_eval_loss", "steps", "steps_per_epoch", "bytes_first_epoch", "bytes_later",
              "compute_s")
WIRES = ("fwd_bytes", "bwd_bytes", "tie_bytes", "dp_bytes")
H100_FLOPS = 400e12  # an H100's bf16 rate at about 40% of its dense peak: what a tuned fine-tune reaches
PEER_MBIT, PEER_LATENCY_MS = 200.0, 50.0  # ProtocolNanoGPT's link: every link 200 Mb/s with 50 ms latency
SLACK = 0.01  # a second target: within 1% of the bf16 row's final eval loss


def run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ...: exit {proc.returncode} (log {log}):\n{log.read_text()[-3000:]}")


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def prepare(shape: Shape, out: Path, pretrain_steps: int, timeout: float) -> tuple[Path, Path]:
    """The pretrained start (kept between invocations) and the held-out fine-tuning corpus."""
    pretrained = out / "pretrain" / "model"
    if not pretrained.is_dir():
        model = write_llama(shape, out)
        run([sys.executable, "-m", "aqpipe", "causal-lm", "--model", str(model), "--forward_compress", "none",
             "--backward_compress", "none", "--max_train_samples", "0", "--max_eval_samples", "64",
             "--max_steps", str(pretrain_steps), "--seq_len", str(shape.seq_len), "--micro_batch_size",
             str(shape.micro_batch_size), "--num_micro_batches", str(shape.num_micro_batches), "--lr", "1e-3",
             "--seed", "7", "--output_dir", str(out / "pretrain"), "--overwrite_output_dir"],
            out / "pretrain.log", timeout)
    corpus = out / "docstrings.txt"
    if not corpus.is_file():
        run([sys.executable, "-m", "benchmarks.docstring_corpus", str(corpus)], out / "corpus.log", timeout)
    return pretrained, corpus


def job_flags(shape: Shape, model: Path, corpus: Path, samples: int, epochs: int, eval_samples: int,
              eval_every: int) -> list[str]:
    return ["--model", str(model), "--dataset", str(corpus), "--seq_len", str(shape.seq_len),
            "--micro_batch_size", str(shape.micro_batch_size), "--num_micro_batches", str(shape.num_micro_batches),
            "--max_train_samples", str(samples), "--max_eval_samples", str(eval_samples), "--epochs", str(epochs),
            "--eval_every", str(eval_every), "--lr", "3e-4", "--seed", "7", "--overwrite_output_dir"]


def curve(run_dir: Path) -> dict[str, Any]:
    """The eval curve and each wire's bytes a step, in the first epoch and after it."""
    rows = records(run_dir)
    steps = [r for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]

    def mean_bytes(chosen: list[dict[str, Any]]) -> dict[str, float] | None:
        return {w: statistics.fmean(r[w] for r in chosen) for w in WIRES} if chosen else None

    return {"evals": evals, "final_eval_loss": evals[-1][1], "steps": len(steps),
            "steps_per_epoch": sum(1 for r in steps if r["epoch"] == 0),
            "bytes_first_epoch": mean_bytes([r for r in steps if r["epoch"] == 0]),
            "bytes_later": mean_bytes([r for r in steps if r["epoch"] > 0]),
            "compute_s": statistics.median(r["seconds"] for r in steps[1:]) if len(steps) > 1 else None}


def timing(run_dir: Path) -> dict[str, Any]:
    """Median seconds and bubble of a step on the link, first-epoch steps (the first one, which also pays the
    start, left out) and later ones."""
    steps = [r for r in records(run_dir) if "loss" in r]
    first, later = [r for r in steps if r["epoch"] == 0][1:], [r for r in steps if r["epoch"] > 0]

    def med(chosen: list[dict[str, Any]], key: str) -> float | None:
        return statistics.median(r[key] for r in chosen) if chosen else None

    return {"first_epoch_s": med(first, "seconds"), "later_s": med(later, "seconds"),
            "first_epoch_bubble": med(first, "bubble"), "later_bubble": med(later, "bubble")}


def time_to_target(evals: list[tuple[int, float]], target: float, steps_per_epoch: int, first_s: float,
                   later_s: float | None) -> tuple[int | None, float | None]:
    """The first eval step at or below `target`, and the link time to it: each step at its epoch's steady time."""
    for step, loss in evals:
        if loss <= target:
            first = min(step, steps_per_epoch)
            return step, first * first_s + (step - first) * (later_s if later_s is not None else first_s)
    return None, None


def latency_cover(bytes_per_step: float, micro_batches: int, rate_bits_s: float, latency_ms: float) -> int:
    """Micro-batches in flight that keep the link busy across a round trip: a message takes its bytes' time on the
    link, and the next one must be queued before the previous one's answer is due."""
    message_s = bytes_per_step / micro_batches * 8 / rate_bits_s
    return max(1, math.ceil(2 * latency_ms / 1000 / message_s)) if message_s > 0 else micro_batches


def projected_step_s(row: dict[str, Any], compute_s: float, later: bool) -> float:
    """A step beside an H100 on ProtocolNanoGPT's link (a model, not a measurement): its compute, a round trip of
    the link's latency (the pipeline's fill and drain cross it once each way), and every byte at the link's rate."""
    wires = row["bytes_later"] if later and row["bytes_later"] else row["bytes_first_epoch"]
    return compute_s + 2 * PEER_LATENCY_MS / 1000 + sum(wires.values()) * 8 / (PEER_MBIT * 1e6)


def score(job: dict[str, Any], rate: float, latency_ms: float, micro_batches: int,
          h100_compute_s: float | None = None) -> None:
    """Fill each row of a job with its steps and time to the bf16 row's final eval loss (and to within SLACK of it),
    measured on the link and projected beside an H100 on ProtocolNanoGPT's link, and the ratios."""
    rows = job["rows"]
    target = rows["bf16"]["final_eval_loss"] if "bf16" in rows else None
    job["target_eval_loss"] = target
    for row in rows.values():
        steps, seconds = (None, None) if target is None else time_to_target(
            row["evals"], target, row["steps_per_epoch"], row["first_epoch_s"], row["later_s"])
        row["steps_to_target"], row["time_to_target_s"] = steps, seconds
        near, near_s = (None, None) if target is None else time_to_target(
            row["evals"], target * (1 + SLACK), row["steps_per_epoch"], row["first_epoch_s"], row["later_s"])
        row["steps_to_near_target"], row["time_to_near_target_s"] = near, near_s
        row["projected_h100_s"] = None
        if h100_compute_s is not None and steps is not None:
            row["projected_h100_s"] = time_to_target(row["evals"], target, row["steps_per_epoch"],
                                                     projected_step_s(row, h100_compute_s, False),
                                                     projected_step_s(row, h100_compute_s, True))[1]
        row["vs_bf16_eval"] = row["final_eval_loss"] / target - 1 if target else None
        wire = row["bytes_first_epoch"]
        row["latency_cover_micro_batches"] = latency_cover(wire["fwd_bytes"] + wire["bwd_bytes"], micro_batches,
                                                           rate, latency_ms)
    for name, row in rows.items():
        for base in ("bf16", "hadamard_4"):
            for key, label in (("time_to_target_s", ""), ("time_to_near_target_s", "near_"),
                               ("projected_h100_s", "projected_")):
                other, mine = rows.get(base, {}).get(key), row[key]
                row[f"{label}speedup_vs_{base}"] = other / mine if other and mine else None


def run_mean_bytes(row: dict[str, Any]) -> dict[str, float]:
    """Each wire's bytes a step over the whole run: first-epoch steps and later ones in their proportions."""
    later = row["bytes_later"] or row["bytes_first_epoch"]
    first_steps, later_steps = row["steps_per_epoch"], row["steps"] - row["steps_per_epoch"]
    return {w: (row["bytes_first_epoch"][w] * first_steps + later[w] * later_steps) / row["steps"] for w in WIRES}


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def table(job: dict[str, Any]) -> str:
    out = [f"| {job['epochs']} epoch(s) | fwd MB/step | bwd | tie | all | vs bf16 all | s/step first epoch | "
           "s/step later | bubble | final eval | vs bf16 | steps to target | time to target s | vs bf16 | "
           "vs hadamard_4 | time to 1% above it | vs bf16 | vs hadamard_4 | projected H100 + 200 Mb/s, s | vs bf16 |",
           "|" + "---|" * 20]
    bf16 = job["rows"].get("bf16")
    bf16_total = sum(run_mean_bytes(bf16).values()) if bf16 else None
    for name, row in job["rows"].items():
        mean = run_mean_bytes(row)
        total = sum(mean.values())
        out.append(f"| {name} | {mean['fwd_bytes'] / 1e6:.3f} | {mean['bwd_bytes'] / 1e6:.3f} | "
                   f"{mean['tie_bytes'] / 1e6:.3f} | {total / 1e6:.3f} | "
                   f"{_fmt(bf16_total / total if bf16_total else None, '.2f')}x | {_fmt(row['first_epoch_s'])} | "
                   f"{_fmt(row['later_s'])} | {_fmt(row['first_epoch_bubble'], '.2f')} | "
                   f"{row['final_eval_loss']:.4f} | "
                   f"{_fmt(row['vs_bf16_eval'] * 100 if row['vs_bf16_eval'] is not None else None, '+.2f')}% | "
                   f"{_fmt(row['steps_to_target'], 'd')} | {_fmt(row['time_to_target_s'], '.1f')} | "
                   f"{_fmt(row['speedup_vs_bf16'], '.2f')}x | {_fmt(row['speedup_vs_hadamard_4'], '.2f')}x | "
                   f"{_fmt(row['time_to_near_target_s'], '.1f')} | {_fmt(row['near_speedup_vs_bf16'], '.2f')}x | "
                   f"{_fmt(row['near_speedup_vs_hadamard_4'], '.2f')}x | {_fmt(row['projected_h100_s'], '.2f')} | "
                   f"{_fmt(row['projected_speedup_vs_bf16'], '.2f')}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    p.add_argument("--jobs", default="1,3", help="epochs of each fine-tuning job, comma-separated")
    p.add_argument("--rate", default="5mbit", help="the link's rate (tc units)")
    p.add_argument("--latency_ms", type=float, default=50.0, help="one-way delay a message, added in the transport")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=512, help="fine-tuning samples (an epoch)")
    p.add_argument("--eval_every", type=int, default=4)
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--timing_steps", type=int, default=3, help="steps of each epoch kind timed on the link")
    p.add_argument("--quick", action="store_true", help="tiny shape and data: a smoke test in minutes")
    p.add_argument("--no_netns", action="store_true", help="time on loopback (no shaping; not root)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--output_dir", default="runs/wan")
    p.add_argument("--curves_from", help="an earlier results.json of the same shape and samples: its rows' curves "
                   "are taken from it (they do not depend on the link), only the rows it lacks are run")
    args = p.parse_args(argv)

    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            p.error(f"row {r!r}: expected one of {', '.join(ROWS)}")
    jobs = [int(j) for j in args.jobs.split(",") if j]
    rate = rate_bits(args.rate)
    if not args.no_netns and (why := can_build()):
        p.error(why)
    shape = Shape(width=args.width, layers=args.layers, family="llama", vocab="gpt2", seq_len=128,
                  micro_batch_size=4, num_micro_batches=4)
    samples, eval_every, pretrain_steps = args.samples, args.eval_every, args.pretrain_steps
    if args.quick:
        shape.width, shape.layers, shape.seq_len = 64, 2, 32
        samples, eval_every, pretrain_steps = 64, 2, 10
    out = Path(args.output_dir)
    model, corpus = prepare(shape, out, pretrain_steps, args.timeout)
    per_step = shape.micro_batch_size * shape.num_micro_batches
    result: dict[str, Any] = {"shape": vars(shape), "rate": args.rate, "latency_ms": args.latency_ms,
                              "samples": samples, "jobs": []}
    earlier = {}
    if args.curves_from:
        before = json.loads(Path(args.curves_from).read_text())
        if before["shape"] != vars(shape) or before["samples"] != samples:
            p.error(f"--curves_from {args.curves_from}: shape {before['shape']} and {before['samples']} samples, "
                    f"expected {vars(shape)} and {samples}")
        earlier = {job["epochs"]: job["rows"] for job in before["jobs"]}
    for epochs in jobs:  # the curves: on loopback, the link does not change them
        job = {"epochs": epochs, "rows": {}}
        for name in rows:
            if name in earlier.get(epochs, {}):
                job["rows"][name] = {k: earlier[epochs][name][k] for k in CURVE_KEYS}
                print(f"curve {epochs} epoch(s) {name}: from {args.curves_from}", flush=True)
                continue
            run_dir = out / f"curve_{epochs}" / name
            flags = [*job_flags(shape, model, corpus, samples, epochs, 64, eval_every), *ROWS[name],
                     "--output_dir", str(run_dir)]
            run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), *LLAMA_SCRIPT, *flags],
                run_dir.with_suffix(".log"), args.timeout)
            job["rows"][name] = curve(run_dir)
            print(f"curve {epochs} epoch(s) {name}: final eval {job['rows'][name]['final_eval_loss']:.4f}",
                  flush=True)
        result["jobs"].append(job)
    net = None if args.no_netns else Network(2)
    with net if net is not None else contextlib.nullcontext():
        if net is not None:
            net.shape(args.rate)
            result["measured_mbit"] = net.throughput_mbit(nbytes=2 << 20)
            print(f"link {args.rate}: {result['measured_mbit']:.2f} Mbit/s measured", flush=True)
        timed = {}
        for name in rows:  # a few first-epoch and later steps on the link; the eval at the end is one micro-batch
            run_dir = out / "timing" / name
            flags = [*job_flags(shape, model, corpus, per_step * args.timing_steps, 2, per_step, 0), *ROWS[name],
                     "--output_dir", str(run_dir)]
            launch(LLAMA_SCRIPT, flags, 2, net, run_dir / "launch.log", args.timeout, args.latency_ms)
            timed[name] = timing(run_dir)
            print(f"timing {name}: {timed[name]}", flush=True)
    fp32 = next((job["rows"].get("fp32") for job in result["jobs"]), None)
    if fp32 and fp32["compute_s"]:  # the scaled link: this machine's compute against an H100's for the same step
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        params = config.vocab_size * config.hidden_size + config.num_hidden_layers * (
            4 * config.hidden_size ** 2 + 3 * config.hidden_size * config.intermediate_size)
        params_flops = 6 * params * per_step * shape.seq_len
        h100_s = params_flops / H100_FLOPS
        result["scaled"] = {"compute_here_s": fp32["compute_s"], "compute_h100_s": h100_s,
                            "rate_beside_h100_mbit": rate / 1e6 * fp32["compute_s"] / h100_s}
    h100_s = result.get("scaled", {}).get("compute_h100_s")
    for job in result["jobs"]:
        for name, row in job["rows"].items():
            row.update(timed[name])
        score(job, rate, args.latency_ms, shape.num_micro_batches, h100_s)
        print(f"\n{table(job)}\n")
    if "scaled" in result:
        s = result["scaled"]
        print(f"compute a step: {s['compute_here_s']:.3f} s here, {s['compute_h100_s'] * 1e3:.2f} ms on an H100 "
              f"(6 x params x tokens at {H100_FLOPS / 1e12:.0f} TFLOP/s): {args.rate} here is "
              f"{s['rate_beside_h100_mbit']:.0f} Mbit/s beside an H100")
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
