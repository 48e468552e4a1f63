"""The GPU path on one GPU: stages sharing it over gloo, the data-parallel algorithms past warm-up, bf16.

Each row is the real job, `torchrun --nproc_per_node N -m aqpipe TASK --backend gloo` (N processes on one GPU, every
tensor they exchange staged through pinned host memory), run twice: on the GPU, and on the CPU with the GPU hidden
(`CUDA_VISIBLE_DEVICES=`). The rows: the main job (GPT2's tiny shape) and the tied Llama of `rank_memory.py`
(114M parameters, GPT-2's vocabulary, bf16 shards) at 2 and 4 stages; 2 stages x 2 replicas with QAdam and with
CocktailSGD, past their warm-up; the Llama under `--bf16`. Printed per row: step 1's loss on each device and their
difference, seconds a step after the first (median), and the share of the schedule's time spent staging.

    python -m benchmarks.gpu_path --json benchmarks/results/gpu_path.json   # on a GPU machine, ~10 min
    python -m benchmarks.gpu_path --quick --devices cpu,cpu                  # tiny shapes, both runs on CPU
    python -m benchmarks.bench_quantize --device cuda --backends triton,torch --shape 16,1024,1600 --bits 2,4,8

The quantizer's GB/s, before (torch ops) and after (Triton), come from the last command.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.rank_memory import FAMILIES, write_model

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--seq_len", "128", "--micro_batch_size", "2", "--num_micro_batches", "4", "--max_train_samples", "64",
       "--max_eval_samples", "8", "--max_steps", "6", "--backend", "gloo"]
DP = ["--replicas", "2", "--dp_warmup_steps", "2"]  # steps 3.. run the compressed algorithm
ROWS: dict[str, tuple[str, int, list[str]]] = {  # name -> (model, processes, flags)
    "main job, 2 stages": ("gpt2", 2, []),
    "main job, 4 stages": ("gpt2", 4, ["--pipeline_stages", "4"]),
    "tied Llama, 2 stages": ("llama", 2, []),
    "tied Llama, 4 stages": ("llama", 4, ["--pipeline_stages", "4"]),
    "tied Llama, 2 x 2, QAdam": ("llama", 4, [*DP, "--dp_algorithm", "qadam"]),
    "tied Llama, 2 x 2, CocktailSGD": ("llama", 4, [*DP, "--dp_algorithm", "cocktail_sgd"]),
    "tied Llama, 2 stages, bf16": ("llama", 2, ["--bf16"]),
}
QUICK_ROWS = ("main job, 2 stages", "tied Llama, 2 x 2, CocktailSGD")


def run(work: Path, name: str, model: Path | None, processes: int, flags: list[str], device: str, run: int
        ) -> list[dict]:
    """One job (the `run`-th of the row); its training steps' records."""
    out = work / f"{name.replace(' ', '_').replace(',', '')}_{run}_{device}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    task = ["gpt2"] if model is None else ["causal-lm", "--model", str(model)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(29650 + processes), "-m", "aqpipe", *task, *JOB, *flags, "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"gpu_path: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]


def figures(steps: list[dict]) -> dict[str, Any]:
    later = steps[1:] or steps
    staging = [s["staging"] for s in later if s.get("staging") is not None]
    return {"loss_1": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "s_per_step": statistics.median(s["seconds"] for s in later),
            "staging": statistics.mean(staging) if staging else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny Llama, two rows")
    p.add_argument("--devices", default="cuda,cpu", help="the two devices each row runs on")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    devices = args.devices.split(",")
    rows = {k: ROWS[k] for k in QUICK_ROWS} if args.quick else ROWS
    result: dict[str, Any] = {"job": JOB, "devices": devices, "rows": {}}
    print(f"| row | loss at step 1 ({devices[0]}) | ({devices[1]}) | difference | s/step ({devices[0]}) | "
          f"({devices[1]}) | staging share ({devices[0]}) | last loss ({devices[0]}) | ({devices[1]}) |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llama = None
        for name, (family, processes, flags) in rows.items():
            if family == "llama" and llama is None:
                if args.quick:
                    FAMILIES["llama"]["config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                                       num_attention_heads=4, num_key_value_heads=2)
                llama = work / "llama"
                write_model("llama", llama)
            model = llama if family == "llama" else None
            a, b = (figures(run(work, name, model, processes, flags, d, i)) for i, d in enumerate(devices))
            result["rows"][name] = {devices[0]: a, devices[1]: b}
            share = "-" if a["staging"] is None else f"{a['staging']:.1%}"
            print(f"| {name} | {a['loss_1']:.6f} | {b['loss_1']:.6f} | {abs(a['loss_1'] - b['loss_1']):.2e} | "
                  f"{a['s_per_step']:.3f} | {b['s_per_step']:.3f} | {share} | {a['last_loss']:.4f} | "
                  f"{b['last_loss']:.4f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
