"""`aqpipe.finetune` called from a user's script under torchrun, on a `datasets.Dataset` of conversational
prompt/completion rows (TRL's layout: lists of turns in both columns), for a base
model whose tokenizer has no chat template (`chat_template="chatml"`), packed: the summary comes back on every rank,
the loss falls on the assistant's tokens, the template is exported with the tokenizer, and bad input raises one
line."""
import json
import subprocess

import pytest

from tests.helpers.processes import checkout_env, free_port
from aqpipe.data import BUILTIN_CHAT_TEMPLATES
from tests.helpers.chat import chat_llama_dir

SCRIPT = '''
import json, os, sys
import datasets
import aqpipe

model, out = sys.argv[1], sys.argv[2]
said = []  # what this rank saw, written to a file of its own (two ranks' prints interleave on one pipe)
replies = ["hello how can", "see you later", "i help you"]  # three tokens each, plus the end of turn
rows = [{"prompt": [{"role": "user", "content": " ".join(["hi"] * (1 + i % 5)) + " there"}],  # TRL's conversational
         "completion": [{"role": "assistant", "content": replies[i % 3]}]} for i in range(42)]  # prompt/completion
for bad in ({"seq_len": 1}, {"forward_bitz": 2}):
    try:
        aqpipe.finetune("causal-lm", model=model, dataset=datasets.Dataset.from_list(rows), output_dir=out, **bad)
    except ValueError as err:
        said.append(str(err))
summary = aqpipe.finetune("causal-lm", model=model, dataset=datasets.Dataset.from_list(rows), seq_len=24,
                          micro_batch_size=2, num_micro_batches=2, epochs=1, forward_bits="2", lr=1e-2,
                          output_dir=out, dist_timeout=60, chat_template="chatml", packing=True)
said.append({k: summary[k] for k in ("steps", "final_loss", "fwd_bytes", "train_samples")})
with open(os.path.join(sys.argv[3], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(said, f)
'''


def test_the_api_runs_a_chat_job_from_a_script_under_torchrun(tmp_path):
    model = chat_llama_dir(tmp_path / "model")  # a base model's tokenizer: no chat template
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script), str(model),
           str(tmp_path / "out"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=checkout_env(), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for seen in said:  # every rank raises the same line, and gets the same summary
        assert seen[0] == "seq_len=1: expected at least 2 tokens"
        assert seen[1].startswith("unknown setting 'forward_bitz': expected a flag's name")
    summaries = [seen[2] for seen in said]
    assert summaries[0] == summaries[1]
    # 39 training conversations of 11 to 15 tokens packed into 27 samples of 24 (two short ones share a sample): 6
    # steps of 4 samples and the epoch's last 3, kept as HF and TRL keep them
    assert summaries[0]["train_samples"] == 27 and summaries[0]["steps"] == 7 and summaries[0]["fwd_bytes"] > 0
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
             if "lr" in json.loads(line)]
    # 4 samples a step (3 in the last), each of one or two conversations with 3 reply tokens + the end of turn as
    # targets (the completion's assistant turn: the user's turn in the prompt is not a target)
    tokens = [s["target_tokens"] for s in steps]
    assert all(t % 4 == 0 and 16 <= t <= 32 for t in tokens[:-1]) and len(set(tokens)) > 1, tokens
    assert tokens[-1] % 4 == 0 and 12 <= tokens[-1] <= 24, tokens
    losses = [s["loss"] for s in steps]
    assert losses[-1] < losses[0], losses
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["samples_per_s"] * summary["seconds"] == pytest.approx(27)  # the samples trained, not 7 x 4
    saved = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]
    exported = tmp_path / "out" / "model" / "chat_template.jinja"  # the model chats the way it was trained
    template = exported.read_text() if exported.is_file() else \
        json.loads((tmp_path / "out" / "model" / "tokenizer_config.json").read_text())["chat_template"]
    assert template == BUILTIN_CHAT_TEMPLATES["chatml"]
