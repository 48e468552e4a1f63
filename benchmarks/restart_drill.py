"""A worker SIGKILLed mid-run under torchrun's own restarts: the seconds from the kill to the first new step, the
steps done again, the run's wall time against the uninterrupted run's, and whether it ends as that run did.

The GPT2 recipe's short job (2 stages, AQ-SGD forward, 4-bit backward) for `--steps` steps, a checkpoint every
`--save_every`; each worker in turn SIGKILLed before step `--kill_step` (AQPIPE_FAULT=kill:RANK:STEP, which says the
moment), launched as a user would for it:

    torchrun --nproc_per_node 2 --max_restarts 2 recipes/finetune_gpt2.py ... --save_every 4 --resume auto

The drill watches metrics.jsonl for each step's row as it appears (a resumed run keeps the rows up to its checkpoint
and writes the rest anew), so "the first new step" is the first row written after the kill.

    python -m benchmarks.restart_drill --json benchmarks/results/restart_drill.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.recipe_runs import free_port

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "finetune_gpt2.py")
JOB = ["--seq_len", "32", "--max_train_samples", "64", "--max_eval_samples", "8", "--micro_batch_size", "2",
       "--num_micro_batches", "2", "--forward_compress", "aqsgd", "--forward_bits", "2", "--backward_compress",
       "direct", "--backward_bits", "4", "--peer_timeout", "20", "--resume", "auto"]
KILLED = re.compile(r"AQPIPE_FAULT: rank (\d+) killed before step (\d+) at ([0-9.]+)")


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.endswith("}")]
    except OSError:
        return []


def drill(out: Path, steps: int, save_every: int, fault: str, timeout: float) -> dict[str, Any]:
    """One launch; each metrics row with the wall-clock moment it first appeared."""
    cmd = ["torchrun", "--nproc_per_node", "2", "--max_restarts", "2", "--master_port", str(free_port()), RECIPE,
           *JOB, "--max_steps", str(steps), "--save_every", str(save_every), "--output_dir", str(out)]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AQPIPE_FAULT": fault}
    started = time.time()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        seen: list[str] = []
        events: list[tuple[float, dict[str, Any]]] = []
        rewrites: list[float] = []
        while True:
            ended = proc.poll() is not None
            lines = _lines(out / "metrics.jsonl")
            kept = next((i for i, (a, b) in enumerate(zip(lines, seen)) if a != b), min(len(lines), len(seen)))
            if kept < len(seen):  # a resume rewrote the file, keeping the rows up to its checkpoint
                rewrites.append(time.time())
            events += [(time.time(), json.loads(line)) for line in lines[kept:]]
            seen = lines
            if ended or time.time() - started > timeout:
                break
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
    wall = time.time() - started
    text = log.read_text()
    rows = [json.loads(line) for line in _lines(out / "metrics.jsonl")]
    result: dict[str, Any] = {"status": proc.wait(), "wall_s": round(wall, 2),
                              "steps_logged": [r["step"] for r in rows if "loss" in r],
                              "final_eval_loss": next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r),
                                                      None)}
    killed = KILLED.search(text)
    if killed:
        rank, step, when = int(killed[1]), int(killed[2]), float(killed[3])
        resumed = next((t for t in rewrites if t > when), None)  # rows written after it are the restarted run's
        after = [(t, r) for t, r in events if resumed is not None and t >= resumed and "loss" in r]
        result.update(killed_rank=rank, killed_before_step=step)
        if after:
            result["kill_to_first_new_step_s"] = round(after[0][0] - when, 2)
            result["resumed_at_step"] = after[0][1]["step"]
            result["steps_redone"] = step - after[0][1]["step"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save_every", type=int, default=4)
    p.add_argument("--kill_step", type=int, default=11, help="the worker dies before this step (after the one before)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, fault in [("uninterrupted", ""), *((f"rank {r} killed", f"kill:{r}:{args.kill_step}")
                                                         for r in (0, 1))]:
                got = drill(Path(tmp) / f"{repeat}_{name.replace(' ', '_')}" / "out", args.steps, args.save_every,
                            fault, args.timeout)
                runs.setdefault(name, []).append(got)
                print(f"{name} (run {repeat + 1}): {json.dumps(got)}", flush=True)
    reference = runs["uninterrupted"]
    print("| run | status | wall s | vs uninterrupted | kill to first new step s | steps redone | final eval loss |")
    print("|---|---|---|---|---|---|---|")
    for name, results in runs.items():
        for i, r in enumerate(results):
            lost = r["wall_s"] - reference[i]["wall_s"]
            print(f"| {name} ({i + 1}) | {r['status']} | {r['wall_s']:.1f} | {lost:+.1f} "
                  f"| {r.get('kill_to_first_new_step_s', '-')} | {r.get('steps_redone', '-')} | "
                  f"{r['final_eval_loss']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
