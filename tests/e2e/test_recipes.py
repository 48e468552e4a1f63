"""The recipes as users launch them: python, torchrun and deepspeed, on the built-in data."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPT2Config

from aqpipe import data
from tests.helpers.files import tiny_gpt2_config
from tests.helpers.processes import ROOT, checkout_env, free_port, launch_aqpipe

QUICK = ["--seq_len", "32", "--max_train_samples", "32", "--max_eval_samples", "8", "--micro_batch_size", "2",
         "--num_micro_batches", "2"]
STEP_KEYS = {"step", "epoch", "loss", "lr", "samples_per_s", "fwd_bytes", "bwd_bytes", "dp_bytes", "time"}


def launch(prefix: list[str], recipe: str, out: Path, *flags: str, timeout: int = 300,
           says_once: str | None = None) -> list[dict]:
    env = checkout_env()
    cmd = [*prefix, str(ROOT / "recipes" / recipe), *QUICK, "--output_dir", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert_quiet(proc.stdout + proc.stderr, launcher=prefix[0])
    if says_once is not None:
        assert (proc.stdout + proc.stderr).count(says_once) == 1, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_quiet(output: str, launcher: str) -> None:
    """A normal run prints its bar and its summary; every warning it once printed was removed at its cause (the
    LR schedule read before its start, DeepSpeed probing for a GPU, HF's loss_type, a bar for the model's file).
    The deepspeed launcher's own two processes still say they found no GPU."""
    for noise in ("lr_schedules", "loss_type", "[transformers]", "Writing model shards", "Traceback"):
        assert noise not in output, output[-3000:]
    assert output.count("Setting accelerator to CPU") <= (2 if launcher == "deepspeed" else 0), output[-3000:]


def test_python_and_torchrun_give_the_same_losses_and_a_loadable_model(tmp_path):
    model = tiny_gpt2_config(tmp_path)
    common = ["--model", model, "--max_steps", "3", "--forward_compress", "none", "--backward_compress", "none"]
    one = launch([sys.executable], "finetune_gpt2.py", tmp_path / "one", *common)
    two = launch(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())], "finetune_gpt2.py",
                 tmp_path / "two", *common)
    steps_one, steps_two = [r for r in one if "loss" in r], [r for r in two if "loss" in r]
    assert len(steps_one) == len(steps_two) == 3
    assert all(STEP_KEYS <= set(r) for r in steps_two)
    assert [r["loss"] for r in steps_two] == pytest.approx([r["loss"] for r in steps_one], rel=1e-5)
    assert steps_one[0]["fwd_bytes"] == 0 and steps_two[0]["fwd_bytes"] == 2 * (2 * 32 * 64 * 4 + 2 * 8)
    assert "eval_perplexity" in one[-1] and "eval_loss" in two[-1]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    # the stages merged back into one HF model that transformers loads and runs
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "two" / "model")
    ids = torch.tensor([tok("To be, or not to be").input_ids])
    assert lm(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_a_one_epoch_run_compresses_its_first_visits_from_step_one(tmp_path):
    """The preset's first-visit codec is auto: a one-epoch run (no sample read back) sends 3-bit Hadamard rows from
    step 1 and keeps no buffer row; a two-epoch run sends its first visits whole, the base of its later deltas, and
    says at start where their rows live."""
    from aqpipe.compression import QuantizedTensor

    runs = {}
    plans = {"1": "AQ-SGD buffers: none kept: no sample is visited twice in this run's 32 visits",  # nor stored
             "2": "AQ-SGD buffers: rows for 32 of the 32 samples visited again (32 in a replica's shard), 4.1 kB "
                  "each (float16): rank 0 131 kB in memory, rank 1 131 kB in memory"}  # 32 tokens x 64 values
    for epochs in ("1", "2"):  # the recipe's job, its 2 ranks forked as torchrun starts them (launch_aqpipe)
        out = tmp_path / epochs
        proc = launch_aqpipe(["gpt2", *QUICK, "--output_dir", str(out), "--model", tiny_gpt2_config(out), "--epochs",
                              epochs, "--no_entropy_coding"], 2, tmp_path / f"logs{epochs}")  # packed sizes, below
        assert proc.returncode == 0 and (proc.stdout + proc.stderr).count(plans[epochs]) == 1, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((tmp_path / epochs / "summary.json").read_text())
        runs[epochs] = ([r["fwd_bytes"] for r in rows if "loss" in r], summary["config"]["compression"])
    one, first_visits = runs["1"]
    assert (first_visits["first_visit"], first_visits["first_visit_bits"], first_visits["first_visit_base"]) == (
        "auto", 3, "position")  # auto chooses per sample: here none is read back, so each goes as a one-epoch row
    # two micro-batches a step, each 2 samples x 32 tokens x width 64: 3-bit codes, a min and step per token, ids
    compressed = 2 * (QuantizedTensor.wire_nbytes((2, 32, 64), 3) + 2 * 8)
    assert one == [compressed] * 8  # 32 samples, 4 a step: every step of the epoch, step 1 included
    whole = 2 * (2 * 32 * 64 * 4 + 2 * 8)  # float32 rows
    assert compressed * 7 < whole  # a token of 64 values: 24 bytes of codes and 8 of scales vs 256: 7.9x fewer
    two, whole_visits = runs["2"]
    assert whole_visits["first_visit"] == "auto" and two[:8] == [whole] * 8 and max(two[8:]) < compressed


def test_deberta_with_aqsgd_sends_the_bytes_it_should_and_reports_the_merged_models_accuracy(tmp_path):
    """The DeBERTa recipe's job on 2 stages, its ranks forked as a launcher starts them (launch_aqpipe: the deepspeed
    launcher itself is tested with the 2 x 2 QAdam job below and in test_spot_warning.py, test_interrupts.py)."""
    out = tmp_path / "ds"
    proc = launch_aqpipe(["deberta", *QUICK, "--output_dir", str(out), "--epochs", "2", "--forward_compress", "aqsgd",
                          "--forward_bits", "2", "--backward_compress", "direct", "--backward_bits", "4",
                          "--tie_compress", "none", "--group_size", "16", "--no_entropy_coding"], 2,
                         tmp_path / "logs")  # the codecs' packed sizes, counted below
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_quiet(proc.stdout + proc.stderr, launcher="torchrun")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 * 32 // 4  # two epochs of 32 samples, 4 per step
    # a micro-batch: 2 samples x 32 tokens x width 128; first visits in fp32, later ones as 2-bit changes with a
    # min and a step per group of 16 (--group_size reaches both quantizers: every group's 8 bytes are on the wire),
    # and 8 bytes per sample id; gradients at 4 bits in the same groups
    elements = 2 * 32 * 128
    assert steps[0]["fwd_bytes"] == 2 * (4 * elements + 16)
    assert steps[-1]["fwd_bytes"] == 2 * (elements // 4 + 8 * elements // 16 + 16)
    assert steps[0]["bwd_bytes"] == steps[-1]["bwd_bytes"] == 2 * (elements // 2 + 8 * elements // 16)
    # the reported accuracy is the merged model's on the same 8 eval samples (eval crosses the boundary in
    # full precision; --tie_compress none keeps every stage's copy of the shared weights exact)
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ds" / "model").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "ds" / "model")
    evaluation = data.limit(data.classification_dataset("acceptability", tok, 32, split="eval", seed=42), 8)
    batch = evaluation.batch(range(8))
    with torch.no_grad():
        out = clf(**{k: v for k, v in batch.items() if k != "sample_id"})
    correct = (out.logits.argmax(-1) == batch["labels"]).float().mean().item()
    assert rows[-1]["eval_accuracy"] == pytest.approx(correct, abs=1e-6)
    assert rows[-1]["eval_loss"] == pytest.approx(out.loss.item(), rel=1e-4)  # two equal batches: the same mean


@pytest.mark.parametrize("flags,message", [  # bad values in range checks: tests/unit/test_config.py, in-process
    (["--dataset", "/no/such/corpus.txt"], "'/no/such/corpus.txt': no such file"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, flags, message):
    out = tmp_path / "never"
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune_gpt2.py"), *flags,
                           "--output_dir", str(out)], cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_deepspeed_launch_of_two_stages_by_two_replicas_with_qadam(tmp_path):
    rows = launch(["deepspeed", "--num_gpus", "4", "--master_port", str(free_port())], "finetune_gpt2.py",
                  tmp_path / "dp", "--pipeline_stages", "2", "--replicas", "2", "--dp_algorithm", "qadam",
                  "--max_steps", "4", says_once="qadam: full-precision gradients for the first 1 of 4 steps")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 4
    # the README's example, as it is: the default warm-up (a tenth of the run) ends, the momentum is compressed
    assert steps[0]["dp_bytes"] > 0 and all(r["dp_bytes"] <= 0.3 * steps[0]["dp_bytes"] for r in steps[1:])
    summary = json.loads((tmp_path / "dp" / "summary.json").read_text())
    assert summary["world_size"] == 4


def test_bad_input_under_a_launcher_exits_before_joining_the_process_group(tmp_path):
    """Rank 1 of 2 with rank 0 never started: had it joined the process group first, it would wait there."""
    path = tmp_path / "one-block" / "config.json"
    path.parent.mkdir(parents=True)
    GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64).to_json_file(path)
    out = tmp_path / "never"
    env = checkout_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "recipes" / "finetune_gpt2.py"), "--model", str(path),
                               "--output_dir", str(out)], cwd=ROOT, env={**env, "RANK": r, "LOCAL_RANK": r},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ("0", "1")]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [2, 2]
    assert f"pipeline_stages=2: model '{path}' has 1 blocks; expected at most 1 stages" in err0
    assert err0.count("\n") == 1 and "Traceback" not in err0 and not out.exists()
    # every rank finds it; rank 0 says it at once, rank 1 (no launcher stops it here) seconds later, naming itself
    assert out1 == "" and err1 == err0.replace("\n", " (rank 1)\n")


def test_bad_flags_under_torchrun_are_one_line():
    proc = subprocess.run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                           str(ROOT / "recipes" / "finetune_gpt2.py"), "--forward_bits", "2.5"], cwd=ROOT,
                          env=checkout_env(), capture_output=True, text=True, timeout=120)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "finetune_gpt2.py: error:" in line]
    assert ours == ["finetune_gpt2.py: error: argument --forward_bits: '2.5': expected an integer or auto "
                    "(finetune_gpt2.py --help lists the flags)"]
    assert proc.returncode == 1  # torchrun reports a failed rank as 1 (the README says so)
