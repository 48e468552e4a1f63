"""A resume may change the run's length (its LR plan is stretched, continuous at the resume step), evaluation,
saving and logging; any other change is refused naming the setting. No metrics row is lost or doubled, in
metrics.jsonl or TensorBoard, across a crash."""
import json

import pytest

from tests.helpers.processes import launch_aqpipe

TINY = ["--seq_len", "16", "--max_train_samples", "32", "--max_eval_samples", "4", "--micro_batch_size", "2",
        "--num_micro_batches", "2", "--save_every", "4", "--eval_every", "2", "--report_to", "tensorboard",
        "--lr_scheduler_type", "linear", "--warmup_steps", "2", "--lr", "0.01"]


def gpt2(out, *flags, fault=None):
    """`aqpipe gpt2 ...` in one process, forked (launch_aqpipe); `fault`: AQPIPE_FAULT."""
    return launch_aqpipe(["gpt2", *TINY, "--output_dir", str(out), *flags], 1, out.parent / f"{out.name}.logs",
                         **({"AQPIPE_FAULT": fault} if fault else {}))


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """8 steps an epoch; killed before step 7, after the checkpoint at step 4 and the evaluation at step 6."""
    out = tmp_path_factory.mktemp("resume") / "out"
    proc = gpt2(out, "--epochs", "1", fault="kill:0:7")
    assert proc.returncode != 0 and (out / "checkpoints" / "step_00000004").is_dir(), proc.stderr[-2000:]
    return out, rows(out)


def test_a_longer_resume_continues_the_rate_and_loses_no_row(crashed):
    out, before = crashed
    planned = {r["step"]: r["lr"] for r in before if "lr" in r}
    proc = gpt2(out, "--epochs", "2", "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = rows(out)
    train = [r for r in after if "lr" in r]
    assert [r["step"] for r in train] == list(range(1, 17))
    assert [r["lr"] for r in train[:4]] == [planned[s] for s in range(1, 5)]  # the checkpoint's rows, kept
    assert train[4]["lr"] == planned[5]  # step 5 at the rate the 8-step plan gave it: continuous
    lrs = [r["lr"] for r in train[4:]]
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < planned[5] / 8  # stretched to 16, to ~0
    # TRL's num_tokens carries on from the checkpoint: 2 x 2 samples of 16 tokens a step, counted since step 1
    assert [r["num_tokens"] for r in train] == [64 * s for s in range(1, 17)]
    evals = [r["step"] for r in after if "eval_loss" in r]
    assert evals == [2, 4, 6, 8, 10, 12, 14, 16]  # the evaluation at 6 once: the crashed run's was past step 4
    assert [r["eval_num_tokens"] for r in after if "eval_loss" in r] == [64 * s for s in evals]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/lr")] == list(range(1, 17))  # step 5 and 6 once each
    assert [e.step for e in events.Scalars("eval/eval_loss")] == evals
    finished = gpt2(out, "--epochs", "3", "--resume", "latest")  # its linear decay reached 0 at step 16
    assert finished.returncode == 2 and "Traceback" not in finished.stderr, finished.stderr[-2000:]
    assert finished.stderr.strip().splitlines()[-1].endswith(
        "the checkpoint's learning-rate schedule ended at step 16 with rate 0, so no step after it would learn; "
        "expected a new run from its model to train further")


def test_any_other_change_is_refused_naming_each(crashed):
    """One launch with two changes: the refusal's one line names both (a run's own setting and a section's)."""
    out, _ = crashed
    proc = gpt2(out, "--epochs", "2", "--resume", "latest", "--seed", "3", "--dropout", "0.2", "--seq_len", "8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    for said in ("seed=42 in the checkpoint, 3 in this run", "dropout=None in the checkpoint, 0.2 in this run",
                 "seq_len=16 in the checkpoint, 8 in this run"):
        assert said in line, line


def test_a_finished_constant_rate_goes_on_and_keeps_its_last_evaluation(tmp_path):
    out = tmp_path / "out"
    flat = ["--lr_scheduler_type", "constant_with_warmup", "--eval_every", "3"]
    assert gpt2(out, "--epochs", "1", *flat).returncode == 0
    first = (out / "metrics.jsonl").read_text()
    again = gpt2(out, "--epochs", "1", "--resume", "latest", *flat)  # the end's checkpoint holds its evaluation
    assert again.returncode == 0 and (out / "metrics.jsonl").read_text() == first, again.stderr[-2000:]
    proc = gpt2(out, "--epochs", "2", "--resume", "latest", *flat)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = rows(out)
    assert [r["step"] for r in after if "lr" in r] == list(range(1, 17))
    assert [r["step"] for r in after if "eval_loss" in r] == [3, 6, 8, 9, 12, 15, 16]  # the first run's end, once
    assert {r["lr"] for r in after if "lr" in r and r["step"] > 2} == {0.01}
