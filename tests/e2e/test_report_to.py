"""--report_to tensorboard: every figure of metrics.jsonl, read back with tensorboard's own reader."""
import json
import subprocess
import sys

import pytest

from aqpipe import reporters
from tests.helpers.processes import ROOT, checkout_env

QUICK = ["--seq_len", "32", "--max_train_samples", "32", "--max_eval_samples", "8", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--max_steps", "3", "--eval_every", "2"]


def test_tensorboard_holds_the_steps_figures_and_evaluations(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "recipes" / "finetune_gpt2.py"), *QUICK, "--output_dir", str(out),
           "--report_to", "tensorboard"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=checkout_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "lr" in r]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("loss", "lr", "grad_norm", "samples_per_s", "target_tokens", "fwd_bytes", "bwd_bytes", "tie_bytes",
                 "dp_bytes", "bubble"):
        read = [(e.step, e.value) for e in events.Scalars(f"train/{name}")]
        assert read == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in steps], name
    evals = [r for r in records if "eval_loss" in r]
    assert [e.step for e in events.Scalars("eval/eval_loss")] == [r["step"] for r in evals] == [2, 3]
    assert "eval/eval_perplexity" in tags and not any(t.startswith("train/eval") for t in tags)


def test_a_reporter_unknown_or_not_installed_is_one_line(monkeypatch):
    with pytest.raises(ValueError, match="report_to='wandb': expected one of none, tensorboard"):
        reporters.check("wandb")
    monkeypatch.setattr(reporters.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"the tensorboard package is not installed; expected pip install "
                                         r"'aqpipe\[tensorboard\]'"):
        reporters.check("tensorboard")
    reporters.check("none")
