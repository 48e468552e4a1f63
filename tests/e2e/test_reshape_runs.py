"""A checkpoint resumes on another shape: GPT2 (4 blocks, tied head) under torchrun's environment (its ranks forked:
tests/helpers/processes.launch_aqpipe) with one replica and compression off, 6 steps; a 4-stage run saved at step 2
resumes at 2 stages, as a full fine-tune and as LoRA, and the full fine-tune's checkpoint at step 4 resumes at 4
stages again. Every resumed step equals the uninterrupted 4-stage
run's, to float32 rounding: a pipeline without compression computes the unpartitioned model's losses whatever its
stages, so any weight, moment, LR or sample that did not carry shows. One line says what carried.
"""
import json
import math
import pytest

from tests.helpers.processes import launch_aqpipe

FLAGS = ["--seq_len", "16", "--max_train_samples", "24", "--max_eval_samples", "4", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--epochs", "1", "--save_every", "2", "--save_total_limit", "0",
         "--forward_compress", "none", "--backward_compress", "none", "--lr_scheduler_type", "linear"]
MODES = {"full": [], "lora": ["--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0"]}


def gpt2(out, processes, *flags):
    """`torchrun --nproc_per_node processes -m aqpipe gpt2 ...`, its ranks forked (launch_aqpipe); its stderr."""
    proc = launch_aqpipe(["gpt2", *FLAGS, "--output_dir", str(out), *flags], processes, out.parent / f"{out.name}.logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in rows if "lr" in r}


@pytest.fixture(scope="module", params=list(MODES))
def runs(request, tmp_path_factory):
    """The full fine-tune goes 4 -> 2 -> 4 stages; LoRA, 4 -> 2 (the way back is the same code, and a launch less)."""
    root, mode = tmp_path_factory.mktemp(f"reshape_{request.param}"), MODES[request.param]
    said = {4: gpt2(root / "straight", 4, *mode)}
    said[2] = gpt2(root / "two", 2, *mode, "--resume", str(root / "straight/checkpoints/step_00000002"))
    if request.param == "full":
        said[(2, 4)] = gpt2(root / "four_again", 4, *mode, "--resume", str(root / "two/checkpoints/step_00000004"))
    return root, said


def test_a_run_resumed_on_another_shape_goes_on_as_the_uninterrupted_one(runs):
    root, said = runs
    chain = [("two", [3, 4, 5, 6], [2, 2])] + ([("four_again", [5, 6], [1, 1, 1, 1])] if (2, 4) in said else [])
    straight = steps(root / "straight")
    assert sorted(straight) == list(range(1, 7))
    for out, taken, blocks in chain:  # the same data, weights, moments and LR: the same losses, to rounding
        resumed = steps(root / out)
        assert sorted(resumed) == taken
        for step, row in resumed.items():
            for ours, theirs in zip(row, straight[step]):
                assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-7), (out, step, row, straight[step])
        manifest = json.loads((root / out / "checkpoints" / "step_00000006" / "manifest.json").read_text())
        assert manifest["stage_blocks"] == blocks  # its own checkpoints: the new shape
    assert ("resume on another shape: 4 stages (blocks 1,1,1,1) -> 2 (blocks 2,2), 1 replica each; kept: every "
            "weight that trains and its optimizer state") in said[2]
    assert "the boundaries' codecs at the cuts both shapes have (before block 2)" in said[2]
    if (2, 4) in said:
        assert "resume on another shape: 2 stages (blocks 2,2) -> 4 (blocks 1,1,1,1)" in said[(2, 4)]


def same_steps(resumed, straight, taken):
    assert sorted(resumed) == taken
    for step, row in resumed.items():
        for ours, theirs in zip(row, straight[step]):
            assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-7), (step, row, straight[step])


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """2 stages x 2 replicas (allreduce keeps the replicas equal; dropout off, since a micro-batch's dropout is drawn
    from its replica and index, which a regroup changes), 48 samples, saved every 2 steps."""
    root = tmp_path_factory.mktemp("replicated")
    gpt2(root / "straight", 4, "--replicas", "2", "--max_train_samples", "48", "--dropout", "0")
    return root


def test_two_replicas_resume_on_one_stage_each_as_the_uninterrupted_run(replicated):
    """Saved at step 2, resumed as 1 stage x 2 replicas: every rank reads both replicas' files of both old stages,
    and steps 3-6 are the uninterrupted run's."""
    said = gpt2(replicated / "one", 2, "--replicas", "2", "--max_train_samples", "48", "--dropout", "0", "--resume",
                str(replicated / "straight/checkpoints/step_00000002"))
    assert "resume on another shape: 2 stages (blocks 2,2) -> 1 (blocks 4), 2 replicas each" in said
    assert "the replicas' weights and moments averaged into one" in said
    same_steps(steps(replicated / "one"), steps(replicated / "straight"), [3, 4, 5, 6])


def test_a_run_shrinks_to_one_replica_and_grows_back_as_the_uninterrupted_run(replicated):
    """2 x 2 saved at step 2 resumes as 2 stages x 1 replica taking 4 micro-batches a step (the global batch kept),
    and its checkpoint at step 4 as 2 x 2 again: every step is the uninterrupted run's, the epoch's samples are all
    trained once (its target tokens: 48 samples x 15), and each start line says what carried and how the epoch
    goes on."""
    straight = replicated / "straight"
    shrunk = gpt2(replicated / "shrunk", 2, "--replicas", "1", "--max_train_samples", "48", "--dropout", "0",
                  "--resume", str(straight / "checkpoints/step_00000002"))
    assert ("resume on another shape: 2 stages (blocks 2,2) x 2 replicas -> 2 (blocks 2,2) x 1 replica; kept: every "
            "weight that trains and its optimizer state, the LR plan and the data position; started fresh: every "
            "boundary's codecs") in shrunk
    assert ("data: epoch 0, begun over 2 replicas, goes on over 1 to its step 6: each step's global batch is the one "
            "it began with (2 x 2 micro-batches of 2), 4 micro-batches a replica") in shrunk
    grown = gpt2(replicated / "grown", 4, "--replicas", "2", "--max_train_samples", "48", "--dropout", "0",
                 "--resume", str(replicated / "shrunk/checkpoints/step_00000004"))
    assert "2 stages (blocks 2,2) x 1 replica -> 2 (blocks 2,2) x 2 replicas" in grown
    assert "data: epoch 0" not in grown  # it began over 2 replicas: their own shards again
    reference = steps(straight)
    same_steps(steps(replicated / "shrunk"), reference, [3, 4, 5, 6])
    same_steps(steps(replicated / "grown"), reference, [5, 6])
    rows = {o: [json.loads(line) for line in (replicated / o / "metrics.jsonl").read_text().splitlines()]
            for o in ("straight", "shrunk", "grown")}
    tokens = lambda o, taken: sum(r["target_tokens"] for r in rows[o] if r.get("step") in taken and "lr" in r)  # noqa: E731
    assert tokens("straight", {1, 2}) + tokens("shrunk", {3, 4}) + tokens("grown", {5, 6}) == 48 * 15
    manifest = json.loads((replicated / "grown/checkpoints/step_00000006/manifest.json").read_text())
    assert len(manifest["files"]) == 4
    assert manifest["position"] == {"epoch": 0, "index": 6, "dealt": [2, 2], "rows": 24, "launched": 2}


def test_a_shrunk_aqsgd_run_keeps_its_length_and_resumes_again_with_its_launchs_flags(tmp_path):
    """AQ-SGD on, 49 samples (2 shards of 24: 6 steps an epoch; 1 replica: 7), 2 epochs. Shrunk to 1 replica at step
    2, the run is 6 + 7 = 13 steps and its linear LR ends with step 13; its checkpoint at step 10 (epoch 1 on 1
    replica, AQ-SGD rows for the regrouped epoch's ids and the new shard's) resumes with the first launch's flags and
    trains steps 11-13 as the run did."""
    aqsgd = ["--max_train_samples", "49", "--epochs", "2", "--forward_compress", "aqsgd", "--forward_bits", "2"]
    gpt2(tmp_path / "straight", 4, "--replicas", "2", *aqsgd)
    gpt2(tmp_path / "shrunk", 2, "--replicas", "1", *aqsgd, "--resume",
         str(tmp_path / "straight/checkpoints/step_00000002"))
    shrunk = steps(tmp_path / "shrunk")
    assert sorted(shrunk) == list(range(3, 14))
    lr = {k: row[2] for k, row in shrunk.items()}
    assert lr[3] == steps(tmp_path / "straight")[3][2]  # the plan's rate where the run was shrunk, then stretched
    assert math.isclose(lr[13], lr[12] - lr[13], rel_tol=1e-9)  # ... to end after step 13: one decrement left
    again = gpt2(tmp_path / "again", 2, "--replicas", "1", *aqsgd, "--resume",
                 str(tmp_path / "shrunk/checkpoints/step_00000010"))
    assert "resume on another shape" not in again and "data: epoch" not in again
    same_steps(steps(tmp_path / "again"), shrunk, [11, 12, 13])
