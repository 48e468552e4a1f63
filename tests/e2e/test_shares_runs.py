"""Replicas taking unequal shares of a step's micro-batches (`--micro_batch_shares 3,1`: a faster replica takes 3 of
every 4), as a user runs them: 2 stages x 2 replicas of the default tied Llama under torchrun's environment, AQ-SGD
on. Each replica deals from a shard sized to its share; a resume continues the run exactly (the shares are kept with
the checkpoint, each replica's AQ-SGD rows with its shard); a resume on one replica takes the rest of the epoch as the
global batches the shares dealt and runs to the end."""
import json

import pytest

from tests.helpers.processes import launch_aqpipe

FLAGS = ["causal-lm", "--seq_len", "16", "--max_train_samples", "40", "--max_eval_samples", "4",
         "--micro_batch_size", "2", "--num_micro_batches", "2", "--pipeline_stages", "2", "--epochs", "2",
         "--save_every", "4", "--save_total_limit", "0"]


def run(out, processes, *flags):
    proc = launch_aqpipe([*FLAGS, "--output_dir", str(out), *flags], processes, out.parent / f"{out.name}.logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "lr" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shares")
    said = {"straight": run(root / "straight", 4, "--replicas", "2", "--micro_batch_shares", "3,1")}
    ckpt = str(root / "straight" / "checkpoints" / "step_00000004")
    said["resumed"] = run(root / "resumed", 4, "--replicas", "2", "--resume", ckpt)  # shares: auto, the checkpoint's
    said["one"] = run(root / "one", 2, "--replicas", "1", "--resume", ckpt)
    return root, said


def test_each_replica_deals_from_a_shard_sized_to_its_share(runs):
    root, said = runs
    assert "replicas take 3,1 micro-batches a step (micro_batch_shares), each from a shard sized to its share " \
           "(30, 10 samples)" in said["straight"]
    assert "rows for 30 of replica 0's 30 samples visited again, 10 of replica 1's 10" in said["straight"]
    assert sorted(steps(root / "straight")) == list(range(1, 11))  # 40 samples of 8 a step, twice: 10 steps


def test_a_resume_keeps_the_shares_and_continues_the_run_exactly(runs):
    root, said = runs
    assert "replicas take 3,1 micro-batches a step" in said["resumed"]
    straight, resumed = steps(root / "straight"), steps(root / "resumed")
    assert sorted(resumed) == list(range(5, 11)) and all(resumed[k] == straight[k] for k in resumed)


def test_a_resume_on_one_replica_takes_the_rest_of_the_epoch_the_shares_dealt(runs):
    root, said = runs
    assert "epoch 0, begun over 2 replicas, goes on over 1 to its step 5: each step's global batch is the one it " \
           "began with (2 replicas taking 3,1 micro-batches of 2), 4 micro-batches a replica" in said["one"]
    assert sorted(steps(root / "one")) == list(range(5, 11))
