"""Every wire's bytes per step and every rank's peak memory, full fine-tuning against LoRA, at 2 stages x 2 replicas.

The model is the tied Llama of `benchmarks/rank_memory.py` as a user has it: >100M parameters, GPT-2's 50257-token
vocabulary, bf16 safetensors shards with its tokenizer. Each row is the real job, `torchrun --nproc_per_node 4 -m
aqpipe causal-lm --replicas 2` (so 2 stages x 2 replicas, allreduce between the replicas), with the boundary in
full precision (`--forward_compress none --backward_compress none`) or AQ-SGD's default (2-bit changes forward,
4-bit gradients back), and every weight trained (float32 master weights) or `--lora_rank 16` (PEFT's default
targets for Llama, q_proj and v_proj; the base frozen in bf16 under autocast). 16 training samples make one step an
epoch, so from step 2 AQ-SGD sends changes against its buffers: the table gives step 1 (every sample's first
visit) and the last step. The bytes are the job's per step (metrics.jsonl: `fwd_bytes`, `bwd_bytes`, `tie_bytes`,
`dp_bytes`); every rank's peak resident memory is read when it exits (rank_memory.py's hook).

    python -m benchmarks.lora_wires                 # 4 jobs, ~5 min on 2 cores
    python -m benchmarks.lora_wires --quick         # a tiny shape, 2 jobs (what the test runs)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.rank_memory import FAMILIES, HOOK, write_model

JOB = ["--seq_len", "128", "--micro_batch_size", "2", "--num_micro_batches", "4", "--max_train_samples", "16",
       "--max_eval_samples", "8", "--max_steps", "4", "--replicas", "2", "--lr", "1e-4"]
BOUNDARIES = {"fp32": ["--forward_compress", "none", "--backward_compress", "none"], "aqsgd": []}
TRAINING = {"full": [], "lora": ["--lora_rank", "16"]}
WIRES = ("fwd_bytes", "bwd_bytes", "tie_bytes", "dp_bytes")


def run(model: Path, work: Path, name: str, flags: list[str], port: int) -> dict[str, Any]:
    """One job on 4 processes: its per-step records and every rank's peak MB."""
    peaks, hook, out = work / f"peaks_{name}", work / "hook", work / f"out_{name}"
    peaks.mkdir(parents=True)
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(root)]), "AQPIPE_PEAK_DIR": str(peaks),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(port),
           "-m", "aqpipe", "causal-lm", "--model", str(model), *flags, "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"lora_wires: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    return {"steps": steps, "peak_mb": [int((peaks / f"rank{r}.kb").read_text()) / 1024 for r in range(4)]}


def table(runs: dict[str, dict[str, Any]]) -> str:
    lines = ["| training | boundary | step | forward | backward | tied weights | data parallel | all wires | "
             "s/step | largest rank's peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        training, boundary = name.split("_")
        for label, step in (("1", r["steps"][0]), (str(len(r["steps"])), r["steps"][-1])):
            mb = [step[w] / 1e6 for w in WIRES]
            lines.append(f"| {training} | {boundary} | {label} | " + " | ".join(f"{v:.3f} MB" for v in mb) +
                         f" | {sum(mb):.3f} MB | {step['seconds']:.2f} | {max(r['peak_mb']):.0f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny tied Llama, the AQ-SGD boundary only")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.quick:
            FAMILIES["llama"]["config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2)
        params = write_model("llama", work / "model")
        job = [*JOB, "--seq_len", "32", "--max_steps", "2"] if args.quick else JOB
        boundaries = {"aqsgd": BOUNDARIES["aqsgd"]} if args.quick else BOUNDARIES
        runs = {}
        for port, (training, extra) in enumerate(TRAINING.items(), start=29610):
            for offset, (boundary, flags) in enumerate(boundaries.items()):
                name = f"{training}_{boundary}"
                runs[name] = run(work / "model", work, name, [*job, *extra, *flags], port + 10 * offset)
                print(f"{name}: last step {[runs[name]['steps'][-1][w] for w in WIRES]} bytes, peak MB by rank "
                      f"{[round(x) for x in runs[name]['peak_mb']]}", flush=True)
    print(f"\ntied Llama, {params / 1e6:.1f}M parameters, bf16 checkpoint, 2 stages x 2 replicas (bytes per step, "
          "the job's):\n")
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": params, "job": JOB, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
