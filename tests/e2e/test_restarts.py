"""torchrun's own restarts (`--max_restarts`): a worker SIGKILLed mid-run, the launcher restarts every worker, they
rejoin under fresh keys of its store, resume from the newest checkpoint every rank holds (`--resume auto`) and
finish with the uninterrupted run's losses and model, each step logged once."""
import json
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.killed_recipe import FLAGS, RECIPE
from tests.helpers.processes import ROOT, checkout_env, free_port


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("killed", [1])  # rank 0 too in benchmarks/restart_drill.py
def test_a_worker_killed_under_max_restarts_rejoins_resumes_and_finishes_as_the_uninterrupted_run(
        tmp_path, reference_run, killed):
    out = tmp_path / "out"
    cmd = ["torchrun", "--nproc_per_node", "2", "--max_restarts", "2", "--master_port", str(free_port()), RECIPE,
           *FLAGS, "--output_dir", str(out), "--save_every", "3", "--resume", "auto"]
    proc = subprocess.run(cmd, cwd=ROOT, env=checkout_env(AQPIPE_FAULT=f"kill:{killed}:5"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"local_rank: {killed}" in proc.stderr and "exitcode: -9" in proc.stderr  # it did die, and came back
    assert proc.stderr.count("data: train 16") == 2, proc.stderr[-3000:]  # one restart: the fault fires once
    want, got = records(reference_run), records(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 6]  # step 4 redone from the step-3 checkpoint, logged once
    for a, b in zip(want, got):
        for key in ("loss", "eval_loss", "fwd_bytes", "bwd_bytes"):
            assert b.get(key) == pytest.approx(a.get(key), rel=1e-6), (key, a, b)
    ref, resumed = (AutoModelForCausalLM.from_pretrained(d / "model").state_dict() for d in (reference_run, out))
    for key, value in ref.items():
        assert torch.allclose(resumed[key], value, rtol=1e-6, atol=0), key
