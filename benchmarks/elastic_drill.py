"""The elastic drill: a machine lost for good mid-run, and back later, under torchrun's elastic launch.

2 stages x 2 replicas of GPT2 (4 blocks, tied head) as two machines of 2 processes, each launched as a user launches
a machine of an elastic job, in a directory of its own (no shared filesystem; checkpoint copies on the other machine):

    torchrun --nnodes 1:2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id drill \\
        --max_restarts 3 -m aqpipe gpt2 --pipeline_stages 2 --replicas auto --resume auto --save_every 2 ...

After step `--kill_after`, machine 1's launcher and its workers are SIGKILLed (a machine gone). The survivors' ranks
stop on the lost peer, their launcher restarts them in the world that is left (1 replica of 2 stages), and they
resume from the newest complete checkpoint, the rest of the epoch dealt over one replica with the global batch kept.
Once that world has taken `--back_after` steps, machine 1 starts again with an empty directory (a new machine in its
place); the launcher stops the workers (a SIGTERM: they save the step in flight) and all four resume as 2 x 2, the
newcomer fetching its files from its peer.

Printed and written (`--json`): seconds from the loss to the first step of the smaller world; the shapes each world
said; each step once and the epoch's samples trained once (target tokens / tokens a sample); the final eval loss
against the uninterrupted 2 x 2 run's (the same global batches, step by step); the grown world's next checkpoint on
both machines. Compute is stretched (AQPIPE_COMPUTE_SLOWDOWN) so steps last long enough to kill one mid-run.

    python -m benchmarks.elastic_drill --json benchmarks/results/elastic_drill.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.recipe_runs import free_port

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32
JOB = ["gpt2", "--seq_len", str(SEQ), "--max_train_samples", "192", "--max_eval_samples", "16",
       "--micro_batch_size", "2", "--num_micro_batches", "2", "--epochs", "1", "--pipeline_stages", "2",
       "--save_every", "2", "--save_total_limit", "0", "--peer_timeout", "15", "--output_dir", "out"]
ELASTIC = ["--replicas", "auto", "--resume", "auto"]


def _rows(out: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    except (OSError, json.JSONDecodeError):
        return []


def _steps(out: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in _rows(out) if "lr" in r}


def machine(directory: Path, port: int, env: dict[str, str], hosts: bool) -> subprocess.Popen:
    """One machine's launcher, in its own directory and session (to kill it with its workers, as a machine dies).
    `hosts`: its launcher hosts the rendezvous store (is_host: on one host every launcher's address matches the
    endpoint's, and a second store could bind the same port)."""
    directory.mkdir(parents=True, exist_ok=True)
    cmd = ["torchrun", "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
           f"127.0.0.1:{port}", "--rdzv_id", "drill", "--rdzv_conf", f"last_call_timeout=5,is_host={int(hosts)}",
           "--max_restarts", "3",
           "--monitor_interval", "1", "-m", "aqpipe", *JOB, *ELASTIC]
    log = (directory / "launcher.log").open("a")
    return subprocess.Popen(cmd, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def gone(launcher: subprocess.Popen) -> None:
    """SIGKILL a machine's launcher and every process under it (its workers run in sessions of their own)."""
    tree = psutil.Process(launcher.pid)
    for proc in [*tree.children(recursive=True), tree]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


def _said(directory: Path, text: str) -> list[str]:
    try:
        return [line for line in (directory / "launcher.log").read_text().splitlines() if text in line]
    except OSError:
        return []


def _wait(what: str, until, timeout: float, procs: list[subprocess.Popen]) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return time.monotonic()
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise RuntimeError(f"the drill did not see {what} within {timeout:.0f} s")


def reference(root: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """The uninterrupted 2 x 2 run, on one machine."""
    directory = root / "reference"
    directory.mkdir(parents=True)
    cmd = ["torchrun", "--nproc_per_node", "4", "--master_port", str(free_port()), "-m", "aqpipe", *JOB,
           "--replicas", "2"]
    proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"the reference run failed:\n{proc.stderr[-3000:]}")
    return _rows(directory / "out")


def _seen(outs: list[Path]) -> set[tuple[int, float]]:
    return {(r["step"], r["time"]) for o in outs for r in _steps(o).values()}


def drill(root: Path, kill_after: int, back_after: int, env: dict[str, str]) -> dict[str, Any]:
    """The two machines: machine 1 killed after step `kill_after`, back (empty) after `back_after` steps of the
    smaller world; when each thing happened."""
    nodes = [root / "node0", root / "node1"]
    outs = [n / "out" for n in nodes]
    port = free_port()
    procs = [machine(nodes[0], port, env, True)]
    time.sleep(2)  # machine 0 first: its launcher hosts the rendezvous (the one that stays)
    procs.append(machine(nodes[1], port, env, False))
    begun = time.monotonic()
    _wait(f"step {kill_after}", lambda: any(max(_steps(o), default=0) >= kill_after for o in outs), 900, procs)
    gone(procs[1])  # machine 1 gone: its launcher and workers at once
    procs[1].wait()
    lost, before = time.monotonic(), _seen(outs)
    at_loss = max(max(_steps(o), default=0) for o in outs)
    fresh = lambda: sorted(s for s, t in _seen(outs[:1]) - before)  # noqa: E731 - rows the smaller world wrote
    went_on = _wait("the smaller world's first step", lambda: bool(fresh()), 900, procs)
    shrunk_from = fresh()[0]
    _wait(f"{back_after} steps of the smaller world", lambda: len(fresh()) >= back_after, 900, procs)
    for path in sorted(nodes[1].rglob("*"), reverse=True):  # a new machine in its place: nothing of the run on it
        path.unlink() if path.is_file() else path.rmdir()
    rejoined, steps_at_rejoin = time.monotonic(), max(_steps(outs[0]), default=0)
    procs[1] = machine(nodes[1], port, env, False)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=900))
        except subprocess.TimeoutExpired:
            gone(p)
            codes.append(None)
    return {"codes": codes, "nodes": nodes, "at_loss": at_loss, "seconds_to_smaller_world": went_on - lost,
            "smaller_world_from_step": shrunk_from, "rejoined_at_step": steps_at_rejoin,
            "seconds_total": time.monotonic() - begun, "seconds_after_rejoin": time.monotonic() - rejoined}


def figures(run: dict[str, Any], ref: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the drill shows: each step once, the epoch's samples once, the worlds each start said, the final eval
    loss against the uninterrupted run's, and the grown world's next checkpoint on both machines."""
    nodes = run["nodes"]
    out = next(n / "out" for n in nodes if (n / "out" / "summary.json").exists())  # where rank 0 ended
    rows = _rows(out)
    steps = [r for r in rows if "lr" in r]
    said = [line.split("; kept")[0] for n in nodes for line in _said(n, "resume on another shape:")]
    samples = sum(r["target_tokens"] for r in steps) / (SEQ - 1)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    grown = [d for d in sorted((nodes[0] / "out" / "checkpoints").glob("step_*"))
             if int(d.name.split("_")[1]) > run["rejoined_at_step"]]
    first = grown[0].name if grown else None
    complete = first is not None and all(
        sorted(f["file"] for f in json.loads((n / "out/checkpoints" / first / "manifest.json").read_text())["files"])
        == sorted(p.name for p in (n / "out/checkpoints" / first).glob("*.pt")) for n in nodes)
    result = {**{k: v for k, v in run.items() if k != "nodes"}, "worlds_said": said,
              "steps_each_once": [r["step"] for r in steps] == list(range(1, len(steps) + 1)),
              "steps": len(steps), "samples_trained": samples, "final_eval_loss": evals[-1] if evals else None,
              "grown_next_checkpoint": first, "grown_next_checkpoint_complete_on_both": complete}
    if ref is not None:
        ref_evals = [r["eval_loss"] for r in ref if "eval_loss" in r]
        result["reference_eval_loss"] = ref_evals[-1]
        result["eval_loss_vs_reference"] = evals[-1] / ref_evals[-1] - 1
        result["reference_samples"] = sum(r["target_tokens"] for r in ref if "lr" in r) / (SEQ - 1)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kill_after", type=int, default=10, help="machine 1 dies after this step")
    p.add_argument("--back_after", type=int, default=4, help="steps of the smaller world before machine 1 returns")
    p.add_argument("--slowdown", type=float, default=20.0, help="compute stretched this many times")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--workdir", type=Path, help="keep the machines' directories here (default: a temporary one)")
    p.add_argument("--no_reference", action="store_true", help="skip the uninterrupted run")
    p.add_argument("--placement", default="rank", help="the machines' --placement (auto: every world re-planned)")
    args = p.parse_args(argv)
    ELASTIC.extend(["--placement", args.placement])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AQPIPE_COMPUTE_SLOWDOWN": str(args.slowdown),
           # torch 2.13's launchers share the rendezvous store from round 0 on, and a machine joining a running job
           # then waits forever for an address the old rank 0 never publishes again (README: elastic launch)
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="elastic_drill_") as tmp:
        root = args.workdir or Path(tmp)
        ref = None if args.no_reference else reference(root, env)
        result = figures(drill(root, args.kill_after, args.back_after, env), ref)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
