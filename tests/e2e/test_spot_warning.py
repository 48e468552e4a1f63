"""A spot warning (SIGTERM to every process of the machine, as a cloud's shutdown sends it; SIGUSR1, as SLURM's
--signal does) under python, torchrun and the deepspeed launcher: every rank finishes the step in flight, saves it,
says so in one line each and stops (143 after SIGTERM, 0 after SIGUSR1); the next launch resumes from that step and
ends with the uninterrupted run's losses to the last digit. With --no_save_on_signal, SIGTERM stops at once, as
Ctrl-C does."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import ROOT, checkout_env, free_port, launch_aqpipe

QUICK = ["--seq_len", "32", "--max_train_samples", "64", "--max_eval_samples", "8", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--epochs", "2"]
LAUNCHERS = {
    "python": lambda port: [sys.executable, "-m", "aqpipe", "gpt2"],
    "torchrun": lambda port: ["torchrun", "--nproc_per_node", "2", "--master_port", str(port), "-m", "aqpipe", "gpt2"],
    "deepspeed": lambda port: ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--module", "aqpipe",
                               "gpt2"],
}


def steps(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]


def signalled(launcher: str, out, sig: int = signal.SIGTERM, *flags: str) -> tuple[int, str, float]:
    """The job, its own process group, signalled (every process, as a machine's shutdown does) after step 5: its
    status, output and how long it took to end after the signal."""
    cmd = [*LAUNCHERS[launcher](free_port()), *QUICK, "--output_dir", str(out), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or len(steps(out)) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    sent = time.monotonic()
    os.killpg(proc.pid, sig)
    output, _ = proc.communicate(timeout=120)
    return proc.returncode, output, time.monotonic() - sent


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_spot_warning_saves_the_step_in_flight_on_every_rank_and_stops(launcher, tmp_path):
    out = tmp_path / "out"
    status, output, took = signalled(launcher, out)
    ranks = ["aqpipe gpt2"] if launcher == "python" else [f"aqpipe gpt2: rank {r}" for r in (0, 1)]
    said = sorted(re.findall(r"aqpipe gpt2: [^\r\n]*", output))
    done = steps(out)[-1]["step"]  # the step in flight when the signal came, finished
    assert said == sorted(f"{who}: stopped: SIGTERM: the step in flight, step {done}, saved in {out / 'checkpoints'} "
                          "within the 25 s a save on a signal may take (--signal_grace); --resume continues the run "
                          "from it" for who in ranks), output[-3000:]
    assert took < 25, took  # within the grace it printed
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{done:08d}"
    manifest = json.loads((out / "checkpoints" / f"step_{done:08d}" / "manifest.json").read_text())
    assert manifest["step"] == done and len(manifest["files"]) == len(ranks)
    assert not re.search(r'File "[^"]*/aqpipe/', output), output[-3000:]  # no traceback of ours
    if launcher == "python":
        assert status == 143  # the launchers' own statuses are theirs: torchrun 1, deepspeed's runner its SIGTERM
    if launcher == "torchrun":  # the next launch: the uninterrupted run's losses, to the last digit (both launches
        # of what the run computes, their ranks forked as torchrun starts them: launch_aqpipe)
        resumed = launch_aqpipe(["gpt2", *QUICK, "--output_dir", str(out), "--resume"], 2, tmp_path / "logs_resumed")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        straight = launch_aqpipe(["gpt2", *QUICK, "--output_dir", str(tmp_path / "straight")], 2,
                                 tmp_path / "logs_straight")
        assert straight.returncode == 0, straight.stderr[-3000:]
        assert [s["loss"] for s in steps(out)] == [s["loss"] for s in steps(tmp_path / "straight")]
        assert [s["step"] for s in steps(out)] == list(range(1, 33))  # no step lost or trained twice


def test_sigusr1_saves_and_stops_cleanly_and_without_the_switch_sigterm_stops_at_once(tmp_path):
    status, output, _ = signalled("python", tmp_path / "usr1", signal.SIGUSR1)
    assert status == 0 and "aqpipe gpt2: stopped: SIGUSR1: the step in flight, step" in output, output[-3000:]
    status, output, _ = signalled("python", tmp_path / "off", signal.SIGTERM, "--no_save_on_signal")
    assert status == 130 and "aqpipe gpt2: error: interrupted" in output, output[-3000:]
    assert not (tmp_path / "off" / "checkpoints").exists()
    status, output, _ = signalled("python", tmp_path / "late", signal.SIGTERM, "--signal_grace", "0.001")
    assert status == 143 and "aqpipe gpt2: the save on SIGTERM took more than 0.001 s (--signal_grace): stopping " \
        "without it" in output, output[-3000:]
    assert not (tmp_path / "late" / "checkpoints" / "latest").exists()  # nothing half-written stands as a save
