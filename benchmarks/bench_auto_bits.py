"""Bits per link: 4 stages where the middle link is slow and the other two fast, `auto` against fixed bits.

One network namespace per stage (benchmarks/netns.py); the link between stages 1 and 2 is shaped to
`--slow` each way, every other pair of hosts to `--fast` (the tied embedding's rows travel between
stages 0 and 3 on a fast one). Each method is one run of the GPT2 recipe (tied LM head, the same seed
and data), launched as `torchrun` per host. Reported per method: seconds per step in the steady state
(epochs after the first, whose AQ-SGD visits travel whole), the final eval loss, the bytes per step of
every wire, and for `auto` the bits it chose per boundary.

    sudo python -m benchmarks.bench_auto_bits                     # ~10 min on 2 cores
    sudo python -m benchmarks.bench_auto_bits --slow 5mbit --epochs 3
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.netns import Network, can_build
from benchmarks.slow_link import ROOT, SCRIPTS, Shape, launch, steady_figures, write_model

AQSGD = ["--forward_compress", "aqsgd", "--backward_compress", "direct"]
METHODS: dict[str, list[str]] = {
    **{f"aqsgd_{fw}_{bw}": [*AQSGD, "--forward_bits", str(fw), "--backward_bits", str(bw)]
       for fw, bw in ((2, 4), (3, 6), (4, 8), (8, 8))},
    "auto": [*AQSGD, "--forward_bits", "auto", "--backward_bits", "auto"],
}


def eval_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["eval_loss"]


def chosen_bits(run_dir: Path) -> dict[str, int] | None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((r["bits"] for r in reversed(rows) if r.get("bits")), None)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | s/step (steady) | eval loss | forward KB/step | backward KB/step | tie KB/step "
             "| bits chosen |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bytes_per_step"]
        bits = ", ".join(f"{k} {v}" for k, v in r["bits"].items()) if r["bits"] else "-"
        kb = " | ".join(f"{b[k] / 1e3:.1f}" for k in ("fwd_bytes", "bwd_bytes", "tie_bytes"))
        lines.append(f"| {r['method']} | {r['seconds_per_step']:.3f} | {r['eval_loss']:.4f} | {kb} | {bits} |")
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's test: auto at least as fast as the fastest fixed setting, better than it on eval loss or bytes,
    and no fixed setting better than auto on both speed and eval loss."""
    auto = next(r for r in rows if r["method"] == "auto")
    fixed = [r for r in rows if r["method"] != "auto"]
    fastest = min(fixed, key=lambda r: r["seconds_per_step"])
    wire = sum(auto["bytes_per_step"].values())
    dominated = [r["method"] for r in fixed if r["seconds_per_step"] < auto["seconds_per_step"]
                 and r["eval_loss"] < auto["eval_loss"]]
    return {"fastest_fixed": fastest["method"], "auto_vs_fastest_speed": fastest["seconds_per_step"]
            / auto["seconds_per_step"], "auto_better_loss_than_fastest": auto["eval_loss"] < fastest["eval_loss"],
            "auto_fewer_bytes_than_fastest": wire < sum(fastest["bytes_per_step"].values()),
            "fixed_better_on_both": dominated}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slow", default="10mbit", help="the middle link's rate each way")
    p.add_argument("--fast", default="1gbit", help="every other link's rate")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--slack", type=float, default=None, help="auto's --auto_bits_slack (default: the recipe's)")
    p.add_argument("--output_dir", default="runs/bench_auto_bits")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "auto_bits.json"))
    args = p.parse_args(argv)
    if why := can_build():
        print(f"network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    shape = Shape(samples=args.samples, epochs=args.epochs)
    out = Path(args.output_dir)
    model = write_model(shape, out)
    flags = [*shape.flags(model), "--max_eval_samples", "128", "--eval_every", str(shape.steps_per_epoch),
             "--seed", "42", "--overwrite_output_dir"]
    rows = []
    with Network(4) as net:
        net.shape_links({(1, 2): args.slow, (2, 1): args.slow}, args.fast)
        measured = {"slow": net.throughput_mbit(1, 2), "fast": net.throughput_mbit(0, 1, 32 << 20, port=29998)}
        print(f"links: middle {measured['slow']:.1f} Mbit/s, others {measured['fast']:.0f} Mbit/s", flush=True)
        for name in args.methods.split(","):
            run_dir = out / name
            extra = ["--auto_bits_slack", str(args.slack)] if name == "auto" and args.slack is not None else []
            launch(SCRIPTS["aqpipe"], [*flags, *METHODS[name], *extra, "--output_dir", str(run_dir)], 4, net,
                   out / f"{name}.log", timeout=1800)
            row = {"method": name, **steady_figures(run_dir, shape), "eval_loss": eval_loss(run_dir),
                   "bits": chosen_bits(run_dir)}
            row.pop("losses")
            rows.append(row)
            print(f"  {name:<10} {row['seconds_per_step']:.3f} s/step  eval {row['eval_loss']:.4f}  "
                  f"bits {row['bits']}", flush=True)
    print("\n" + table(rows))
    result = {"command": " ".join(["python", "-m", "benchmarks.bench_auto_bits", *(argv or sys.argv[1:])]),
              "links": {"slow": args.slow, "fast": args.fast, "measured_mbit": measured}, "shape": vars(shape),
              "slack": args.slack,
              "runs": rows, "verdict": verdict(rows) if any(r["method"] == "auto" for r in rows) else None}
    print(json.dumps(result["verdict"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
