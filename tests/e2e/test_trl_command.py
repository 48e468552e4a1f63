"""A TRL user's command, from TRL's own documentation (trl/scripts/sft.py), with only the launcher changed
(`python trl/scripts/sft.py` -> `torchrun --nproc_per_node 2 -m aqpipe causal-lm`), on a ShareGPT file, reporting to
TensorBoard, W&B (offline) and Trackio (local) at once: it trains on 2 stages, keeps the epoch's last partial batch,
logs TRL's token metrics in train and eval rows, says in one line each what it does with TRL's flags it does not
use, and only the rank that owns the metrics reports them. The hub is out of reach here, so the model and the data
are local paths where TRL's docs name hub ones."""
import json
import math
import re
import subprocess

import pytest

from tests.helpers.chat import CHATML, chat_llama_dir
from tests.helpers.processes import checkout_env, free_port

# TRL's docs: python trl/scripts/sft.py --model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/Capybara ...
TRL_DOCS = ["--learning_rate", "2.0e-5", "--num_train_epochs", "1", "--packing", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "8", "--gradient_checkpointing", "--logging_steps", "25",
            "--eval_strategy", "steps", "--eval_steps", "100", "--output_dir", "Qwen2-0.5B-SFT", "--push_to_hub"]
FIGURES = ("loss", "lr", "grad_norm", "samples_per_s", "target_tokens", "fwd_bytes", "bwd_bytes", "tie_bytes",
           "dp_bytes", "bubble", "mean_token_accuracy", "num_tokens")
TURNS = [("human", "hi there"), ("gpt", "hello how can i help"), ("human", "bye"), ("gpt", "see you later")]


def test_trls_documented_sft_command_runs_with_only_the_launcher_changed_and_reports_everywhere(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, data = chat_llama_dir(tmp_path / "model", CHATML, positions=128), tmp_path / "sharegpt.jsonl"
    rows = [{"conversations": [{"from": f, "value": v} for f, v in TURNS[:2 + 2 * (i % 2)]]} for i in range(200)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "aqpipe", "causal-lm",
           "--model_name_or_path", str(model), "--dataset_name", str(data), *TRL_DOCS,
           "--report_to", "tensorboard,wandb,trackio"]
    env = checkout_env(WANDB_MODE="offline", TRACKIO_DIR=str(tmp_path / "trackio"), WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for note in ("note: --logging_steps 25: aqpipe writes every step's row", "note: --eval_strategy steps: aqpipe",
                 "note: --push_to_hub True: aqpipe writes the model"):
        assert proc.stderr.count(note) == 1, proc.stderr[-3000:]  # said once, by rank 0

    out = tmp_path / "Qwen2-0.5B-SFT"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [r for r in records if "lr" in r], [r for r in records if "eval_loss" in r]
    samples = int(re.search(r"data: train (\d+) samples", proc.stderr).group(1))  # packed
    assert len(steps) == math.ceil(samples / 16) and samples % 16, samples  # 2 x 8 a step; the partial one kept
    assert all(0 <= s["mean_token_accuracy"] <= 1 for s in steps)
    tokens = [s["num_tokens"] for s in steps]  # TRL's: input tokens so far, every step's 2 x 8 x 128 (less last)
    assert tokens[0] == 16 * 128 and all(b > a for a, b in zip(tokens, tokens[1:]))
    assert [r["step"] for r in evals] == [len(steps)]  # --eval_steps 100 past the end: the final evaluation
    assert 0 <= evals[0]["eval_mean_token_accuracy"] <= 1 and 0 < evals[0]["eval_entropy"] < math.log(64)
    assert evals[0]["eval_num_tokens"] == tokens[-1]  # as TRL's: the tokens trained on when it evaluated
    assert (out / "model" / "config.json").is_file()

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in FIGURES:
        read = [(e.step, e.value) for e in events.Scalars(f"train/{name}")]
        assert read == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in steps], name
    assert [e.step for e in events.Scalars("eval/eval_loss")] == [r["step"] for r in evals]
    assert "eval/eval_mean_token_accuracy" in events.Tags()["scalars"]

    runs = list((out / "wandb").glob("offline-run-*"))  # one run: only rank 0 reports
    assert len(runs) == 1, runs
    logged = next(runs[0].glob("run-*.wandb")).read_bytes()  # protobuf records: their keys are plain bytes
    for key in (b"train/loss", b"train/mean_token_accuracy", b"eval/eval_loss", b"eval/eval_entropy"):
        assert key in logged, key

    import sqlite3

    with sqlite3.connect(tmp_path / "trackio" / "aqpipe.db") as db:
        rows = [(step, json.loads(metrics)) for step, metrics in db.execute("SELECT step, metrics FROM metrics")]
    assert len({run for (run,) in sqlite3.connect(tmp_path / "trackio" / "aqpipe.db").execute(
        "SELECT DISTINCT run_name FROM metrics")}) == 1  # one run: only rank 0 reports
    trained = [(step, m["train/loss"]) for step, m in rows if "train/loss" in m]
    assert trained == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert [(step, m["eval/eval_loss"]) for step, m in rows if "eval/eval_loss" in m] == \
        [(r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in evals]
