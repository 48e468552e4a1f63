"""A placement changes who computes what, not what is computed: 2 stages x 2 replicas of GPT2 under torchrun's
environment, with compression off and dropout on, resumed from its checkpoint at step 2 under a plan that moves every
(stage, replica) to another rank, ends with the losses of the same run in rank order, to the bit. A plan whose blocks
are not the run's is refused in one line."""
import json

import pytest

from tests.helpers.processes import launch_aqpipe

FLAGS = ["--seq_len", "16", "--max_train_samples", "32", "--max_eval_samples", "4", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--pipeline_stages", "2", "--replicas", "2", "--epochs", "1", "--save_every",
         "2", "--forward_compress", "none", "--backward_compress", "none", "--partition", "2,2"]
MOVED = [3, 2, 1, 0]  # replica 0 on ranks 3 (stage 0) and 2, replica 1 on ranks 1 and 0: every place moved


def gpt2(out, *flags):
    """`torchrun --nproc_per_node 4 -m aqpipe gpt2 ...`, its ranks forked (launch_aqpipe)."""
    return launch_aqpipe(["gpt2", *FLAGS, "--output_dir", str(out), *flags], 4, out.parent / f"{out.name}.logs")


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "lr" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    plan = root / "plan.json"
    # its shares would deal other shards than the checkpoint's: a resume keeps the checkpoint's (equal)
    plan.write_text(json.dumps({"stages": 2, "replicas": 2, "placement": MOVED, "partition": [2, 2],
                                "shares": [3, 1]}))
    straight = gpt2(root / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    # its checkpoint at step 2 (a restart lands on machines the rendezvous numbered otherwise), under the plan
    resumed = gpt2(root / "moved", "--resume", str(root / "straight" / "checkpoints" / "step_00000002"),
                   "--placement", str(plan))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return root, resumed.stderr


def test_a_run_resumed_under_another_placement_trains_as_the_rank_ordered_one_to_the_bit(runs):
    root, said = runs
    assert f"placement {root / 'plan.json'}: ranks by (stage, replica) {MOVED}, blocks per stage [2, 2]\n" in said
    straight, moved = losses(root / "straight"), losses(root / "moved")
    assert len(straight) == 4 and moved == straight[2:]  # steps 3 and 4 under the plan: the same bits
    manifest = json.loads((root / "moved" / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert manifest["placement"] == MOVED  # the checkpoint records who held what, and each rank wrote its place's
    written = {entry["rank"]: entry["file"] for entry in manifest["files"]}
    assert written == {3: "stage0_replica0.pt", 2: "stage1_replica0.pt", 1: "stage0_replica1.pt",
                       0: "stage1_replica1.pt"}


def test_a_plan_with_other_blocks_than_the_runs_is_refused_in_one_line(runs):
    root, _ = runs
    other = root / "other.json"
    other.write_text(json.dumps({"stages": 2, "replicas": 2, "placement": MOVED, "partition": [3, 1]}))
    proc = gpt2(root / "moved", "--resume", "latest", "--placement", str(other), "--epochs", "2")
    assert proc.returncode != 0 and "ValueError" not in proc.stderr, proc.stderr[-2000:]  # no traceback of ours
    assert "its blocks per stage [3, 1] are not this run's partition=[2, 2] ([2, 2])" in proc.stderr
