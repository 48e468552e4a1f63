"""Ctrl-C (SIGINT to the launcher's process group) under python, torchrun and the deepspeed launcher: every rank the
launcher lets run says so in one line and ends with status 130, no rank prints a traceback, and the checkpoint
written before it is intact (every file its manifest names, by checksum)."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import ROOT, checkout_env, free_port

QUICK = ["--seq_len", "32", "--max_train_samples", "64", "--max_eval_samples", "8", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--epochs", "50", "--save_every", "2"]
LAUNCHERS = {
    "python": lambda port: [sys.executable, "-m", "aqpipe", "gpt2"],
    # torchrun with restarts allowed (what a plain torchrun launch does, and more): Ctrl-C still ends the run, never a
    # restart loop (the lines below appear once a rank)
    "torchrun_restarts": lambda port: ["torchrun", "--nproc_per_node", "2", "--max_restarts", "2", "--master_port",
                                       str(port), "-m", "aqpipe", "gpt2"],
    "deepspeed": lambda port: ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--module", "aqpipe",
                               "gpt2"],
}


def interrupted(launcher: str, out) -> tuple[int, str]:
    """The job started as a terminal starts it (its own process group), Ctrl-C'd once its step-4 checkpoint is
    written: its status and output."""
    cmd = [*LAUNCHERS[launcher](free_port()), *QUICK, "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "step_00000004" / "manifest.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    time.sleep(0.5)  # mid-step
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    return proc.returncode, output


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_ctrl_c_is_one_line_a_rank_and_the_checkpoint_survives(launcher, tmp_path):
    out = tmp_path / "out"
    status, output = interrupted(launcher, out)
    ours = re.findall(r"aqpipe gpt2: error: [^\r\n]*", output)  # a progress bar's \r may come before one
    if launcher == "python":
        assert status == 130 and ours == ["aqpipe gpt2: error: interrupted; a checkpoint it wrote earlier continues "
                                          "the run with --resume"], output[-3000:]
    else:  # one line a rank; the launcher's own status: torchrun's 1, the deepspeed runner dies of the SIGINT
        # (and on it terminates its workers: a rank that hears the runner's SIGTERM before its own SIGINT names it)
        signals = ("SIGINT", "SIGTERM") if launcher == "deepspeed" else ("SIGINT",)
        said = sorted(re.sub(r"\((SIGINT|SIGTERM)\)", lambda m: "(SIGINT)" if m.group(1) in signals else m.group(0),
                             line) for line in ours)
        assert said == [f"aqpipe gpt2: error: rank {r} (stage {r}, replica 0) interrupted (SIGINT); a "
                        "checkpoint it wrote earlier continues the run with --resume" for r in (0, 1)], output[-3000:]
        assert status != 0, output[-3000:]  # the launcher's own: torchrun 1, deepspeed's runner dies of the SIGINT
    # no rank's traceback, Python's or torch's C++ one (a store call after rank 0's process took the store away)
    assert not re.search(r'File "[^"]*/(aqpipe|pipeline|compression|data_parallel)/', output), output[-3000:]
    for text in ("Connection closed by peer", "frame #", "[c10d]"):
        assert text not in output, output[-3000:]
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    manifest = json.loads((latest / "manifest.json").read_text())
    for entry in manifest["files"]:  # every file the manifest names, whole
        assert hashlib.sha256((latest / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
