"""Launch one recipe under torchrun and read back what it wrote (metrics.jsonl, summary.json).

The benchmarks compare runs of the real recipes rather than re-implementing a training loop, so
what they measure is what a user launches. Each run gets its own free port (runs may overlap with
other people's on a shared machine) and OMP_NUM_THREADS=1 per process unless the caller's
environment already chooses, so two stages do not oversubscribe two cores.

    from benchmarks.recipe_runs import run_recipe
    rows, summary = run_recipe("finetune_gpt2.py", ["--epochs", "1"], Path("runs/x"))
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port nobody listens on right now (torchrun's rendezvous needs one per concurrent run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_run(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every record of metrics.jsonl (steps carry "loss", evaluations "eval_loss") and summary.json."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    return records, summary


def run_recipe(script: str, args: list[str], out: Path, *, nproc: int = 2,
               timeout: float | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run recipes/<script> (or, for "aqpipe TASK", the installed trainer's task) on `nproc` processes with
    --output_dir `out`; raise with stderr's tail on failure.

    A previous summary.json in `out` is removed first, so a failed run can never be mistaken for
    a finished one.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    target = [str(ROOT / "recipes" / script)] if script.endswith(".py") else ["-m", *script.split()]
    cmd = ["torchrun", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
           *target, *args, "--output_dir", str(out), "--overwrite_output_dir"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not (out / "summary.json").exists():
        raise RuntimeError(f"{script} {' '.join(args)} failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    return read_run(out)
