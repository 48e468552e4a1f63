"""`--use_liger_kernel` as a TRL user passes it (`use_liger_kernel=True` to `aqpipe.finetune`): a 2-stage chat job
over a tied Llama trains with the fused loss on its last stage (Triton's CPU interpreter here) to the same losses as
the chunked loss, its training rows log no token accuracy (no logits; TRL's rows neither), its evaluation does. Both
jobs run from one script in one launch, one after the other, as a user's sweep would."""
import json
import subprocess

import pytest

from tests.helpers.chat import chat_llama_dir
from tests.helpers.processes import checkout_env, free_port

SCRIPT = '''
import sys
import datasets
import aqpipe

model, out = sys.argv[1], sys.argv[2]
rows = [{"prompt": [{"role": "user", "content": " ".join(["hi"] * (1 + i % 5)) + " there"}],
         "completion": [{"role": "assistant", "content": ["hello how can", "see you later"][i % 2]}]}
        for i in range(40)]
for liger in (True, False):
    aqpipe.finetune("causal-lm", model=model, dataset=datasets.Dataset.from_list(rows), seq_len=24,
                    micro_batch_size=2, num_micro_batches=2, max_steps=4, lr=1e-2, output_dir=f"{out}{int(liger)}",
                    dist_timeout=60, chat_template="chatml", use_liger_kernel=liger, eval_every=2)
'''


def test_a_job_trains_with_the_fused_loss_as_with_the_chunked_one(tmp_path):
    chat_llama_dir(tmp_path / "model")
    (tmp_path / "job.py").write_text(SCRIPT)
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), str(tmp_path / "job.py"),
           str(tmp_path / "model"), str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=checkout_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    fused, chunked = ([json.loads(line) for line in (tmp_path / f"out{i}" / "metrics.jsonl").read_text().splitlines()]
                      for i in (1, 0))
    train = [[r for r in job if "lr" in r] for job in (fused, chunked)]
    assert len(train[0]) == len(train[1]) == 4
    assert [r["loss"] for r in train[0]] == pytest.approx([r["loss"] for r in train[1]], rel=1e-4)
    assert all(r.get("mean_token_accuracy") is None for r in train[0])
    assert all(r.get("mean_token_accuracy") is not None for r in train[1])
    evals = [[r for r in job if "eval_loss" in r] for job in (fused, chunked)]
    assert evals[0] and all(r.get("eval_mean_token_accuracy") is not None for r in evals[0])
    assert [r["eval_loss"] for r in evals[0]] == pytest.approx([r["eval_loss"] for r in evals[1]], rel=1e-4)
