"""The DeepSpeed baseline trains what our recipe trains: same model, weights, split, data and optimizer.

One launch of each, side by side (deepspeed for the baseline, torchrun for ours), on a tiny
dropout-free GPT2 with a tied head. Step 1's forward is the same computation in both engines,
so its loss must agree; the schedule's lr is 0, 0, 1e-3 over the first three steps, so step 4's
loss also checks one real update (AdamW, global-norm clipping, the tied wte's gradient sum).
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.files import tiny_gpt2_config
from tests.helpers.processes import ROOT, checkout_env, free_port

SHAPE = ["--seq_len", "32", "--max_train_samples", "32", "--micro_batch_size", "2", "--num_micro_batches", "2",
         "--max_steps", "4"]
STEP_KEYS = {"step", "loss", "seconds", "samples_per_s", "fwd_bytes", "bwd_bytes", "time"}
SUMMARY_KEYS = {"steps", "final_loss", "seconds", "samples_per_s", "world_size"}


def start(prefix: list[str], script: list[str], out: Path, model: str,
          *flags: str) -> tuple[list[str], subprocess.Popen]:
    cmd = [*prefix, "--master_port", str(free_port()), *script, "--model", model, *SHAPE,
           "--output_dir", str(out), *flags]
    return cmd, subprocess.Popen(cmd, cwd=ROOT, env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)


def finish(cmd: list[str], proc: subprocess.Popen, out: Path) -> tuple[list[dict], dict]:
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{log[-4000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], json.loads((out / "summary.json").read_text())


def test_deepspeed_pipeline_matches_our_engine_on_the_same_model_and_data(tmp_path):
    model = tiny_gpt2_config(tmp_path)
    ds_out, ours_out = tmp_path / "deepspeed", tmp_path / "ours"
    ds = start(["deepspeed", "--num_gpus", "2"], ["--module", "benchmarks.deepspeed_pipeline"], ds_out, model)
    ours = start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
                 [str(ROOT / "recipes/finetune_gpt2.py")],
                 ours_out, model, "--forward_compress", "none", "--backward_compress", "none",
                 "--max_eval_samples", "2")
    ds_steps, ds_summary = finish(*ds, ds_out)
    ours_steps, _ = finish(*ours, ours_out)

    assert [r["step"] for r in ds_steps] == [1, 2, 3, 4]
    assert all(STEP_KEYS <= set(r) and math.isfinite(r["loss"]) and r["seconds"] > 0 for r in ds_steps)
    assert SUMMARY_KEYS <= set(ds_summary) and ds_summary["steps"] == 4 and ds_summary["world_size"] == 2
    # the same blocks on each stage: ours split 2 blocks as [1, 1], DeepSpeed's layers 0-1 | 2-4
    assert ds_summary["block_counts"] == [1, 1] and ds_summary["deepspeed_parts"] == [0, 2, 5]
    assert ds_steps[0]["fwd_bytes"] == 2 * 2 * 32 * 64 * 4  # two micro-batches of (2, 32, 64) FP32
    assert ds_steps[0]["loss"] == pytest.approx(ours_steps[0]["loss"], abs=1e-4)
    assert [r["loss"] for r in ds_steps] == pytest.approx([r["loss"] for r in ours_steps], abs=1e-4)
    assert [r["lr"] for r in ds_steps] == pytest.approx([r["lr"] for r in ours_steps])
    # the global gradient norm before clipping, as DeepSpeed's own clipping computes it: a loss scaled by the
    # micro-batch count, or a micro-batch left out of the sum, shows here even where AdamW hides it in the loss
    assert [r["grad_norm"] for r in ds_steps] == pytest.approx([r["grad_norm"] for r in ours_steps], rel=1e-4)
