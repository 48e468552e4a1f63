"""A DeBERTa fine-tune on the user's own CSV in QNLI's layout, as a user runs it: no column flags, string
labels, and the merged model's config naming them."""
import json
import subprocess
import sys

from transformers import AutoConfig

from tests.helpers.processes import ROOT, checkout_env


def test_qnli_layout_csv_trains_with_no_flag_and_the_model_keeps_the_label_names(tmp_path):
    path = tmp_path / "qnli.csv"
    lines = ["question,sentence,label"] + [
        f"Who speaks line {i}?,The speaker of line {i} is {'Portia' if i % 2 else 'Shylock'}.,"
        f"{'entailment' if i % 3 else 'not_entailment'}" for i in range(48)]
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "aqpipe", "deberta", "--dataset", str(path), "--max_steps", "2", "--seq_len", "32",
           "--max_train_samples", "16", "--max_eval_samples", "4", "--micro_batch_size", "2",
           "--num_micro_batches", "2", "--output_dir", str(out)]
    env = checkout_env(WORLD_SIZE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    config = AutoConfig.from_pretrained(out / "model")
    assert config.id2label == {0: "entailment", 1: "not_entailment"}
    assert config.label2id == {"entailment": 0, "not_entailment": 1}
