"""What a buffer budget costs: a 2-epoch fine-tune whose AQ-SGD buffers hold rows for a quarter of its samples.

The WAN score's workload (benchmarks/wan.py): a tied Llama with GPT-2's 50257-token vocabulary (bf16 safetensors
shards), pretrained on the plays, fine-tuned under `torchrun -m aqpipe causal-lm` on 2 stages on a held-out corpus
(the standard library's docstrings), 512 samples x 2 epochs, eval every 4 steps on 64 other samples, the trainer's
own compression defaults (AQ-SGD 2-bit changes, DirectQ 4-bit backward, first visits `auto`). Each row is that job
with another buffer budget (unbounded; `--buffer_memory_gb` at a quarter of the rows' bytes and `--buffer_disk_gb 0`,
which keep rows for 128 of the 512 samples, the others sent whole at every visit; or none) and another codec for the
whole rows (auto; `_whole`: all in full precision; `_hadamard`: all 3-bit Hadamard changes from the running base).
Reported per row: every wire's bytes a step in epoch 1 and in epoch 2, and the final eval loss, against the
unbounded row.

    python -m benchmarks.buffer_budget --json benchmarks/results/buffer_budget.json     # ~25 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.recipe_runs import free_port
from benchmarks.slow_link import LLAMA_SCRIPT, Shape
from benchmarks.wan import WIRES, curve, job_flags, prepare, run

QUARTER = "quarter"  # a stand-in in ROWS for the budget that holds a quarter of the rows, filled in at run time
BUDGETS = {"unbounded": [], "quarter": ["--buffer_memory_gb", QUARTER, "--buffer_disk_gb", "0"],
           "none_kept": ["--buffer_memory_gb", "0", "--buffer_disk_gb", "0"]}
# whole rows: auto (the trainer's: a kept sample's first visit in full precision, the others 3-bit Hadamard changes
# from the running base), every one in full precision, or every one 3-bit Hadamard
WHOLE = {"": [], "_whole": ["--first_visit_compress", "none"], "_hadamard": ["--first_visit_compress", "hadamard"]}
ROWS: dict[str, list[str]] = {f"{budget}{kind}": [*flags, *rows] for budget, flags in BUDGETS.items()
                              for kind, rows in WHOLE.items()}


def table(rows: dict[str, dict[str, Any]]) -> str:
    base = rows.get("unbounded")
    out = ["| 2 epochs | plan | epoch 1 fwd MB/step | epoch 2 fwd MB/step | vs unbounded | epoch 2 all wires MB/step | "
           "final eval | vs unbounded |", "|" + "---|" * 8]
    for name, row in rows.items():
        first, later = row["bytes_first_epoch"], row["bytes_later"]
        ratio = later["fwd_bytes"] / base["bytes_later"]["fwd_bytes"] if base else None
        loss = row["final_eval_loss"] / base["final_eval_loss"] - 1 if base else None
        out.append(f"| {name} | {row['plan']} | {first['fwd_bytes'] / 1e6:.3f} | {later['fwd_bytes'] / 1e6:.3f} | "
                   f"{ratio:.2f}x | {sum(later[w] for w in WIRES) / 1e6:.3f} | {row['final_eval_loss']:.4f} | "
                   f"{loss * 100:+.2f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--output_dir", default="runs/buffer_budget")
    p.add_argument("--pretrained_from", default="runs/wan", help="where benchmarks.wan keeps its pretrained start "
                   "and corpus (made there if missing)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    shape = Shape(width=256, layers=4, family="llama", vocab="gpt2", seq_len=128, micro_batch_size=4,
                  num_micro_batches=4)
    model, corpus = prepare(shape, Path(args.pretrained_from), 200, args.timeout)
    row_bytes = shape.seq_len * shape.width * 2  # a float16 row
    quarter = f"{args.samples // 4 * row_bytes / 1e9:.9f}"  # one boundary side a rank: a quarter of the samples
    out, result = Path(args.output_dir), {"shape": vars(shape), "samples": args.samples, "seed": args.seed, "rows": {}}
    for name in args.rows.split(","):
        run_dir = out / name
        flags = [*job_flags(shape, model, corpus, args.samples, 2, 64, 4), "--seed", str(args.seed),
                 *[quarter if f == QUARTER else f for f in ROWS[name]], "--output_dir", str(run_dir)]
        run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), *LLAMA_SCRIPT, *flags],
            run_dir.with_suffix(".log"), args.timeout)
        row = curve(run_dir)
        said = run_dir.with_suffix(".log").read_text().splitlines()
        row["plan"] = next((line.split(": ", 1)[1].split(",")[0] for line in said if line.startswith("AQ-SGD")), "")
        result["rows"][name] = row
        print(f"{name}: epoch 2 fwd {row['bytes_later']['fwd_bytes'] / 1e6:.3f} MB/step, final eval "
              f"{row['final_eval_loss']:.4f} ({row['plan']})", flush=True)
    print("\n" + table(result["rows"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
