"""What a resume may change, setting by setting, against a table written here rather than read from the fields: a
setting that changes what is trained (the data, its targets, the model, the optimizer, the codecs) must stay as the
checkpoint has it, and a resume that gives it another value is refused in one line naming its flag; a setting of the
run's length, its evaluation, saving, logging or processes is free; the shape (stages, blocks per stage) reshards
the checkpoint (aqpipe/reshape.py), its `auto` taking the checkpoint's blocks where the stage count is the same. A
field marked FREE that changes what is trained (the loss switches would be such fields) fails here, and so does a
setting added without a rule in this table."""
import json
from dataclasses import replace

import pytest
import torch

from aqpipe import checkpoint
from aqpipe.compression.fields import FREE, KEPT, RESHAPES, SAME
from aqpipe.config import SECTIONS, RunConfig, destinations
from aqpipe.flags import value_at

# every setting: its rule, and another value a user might give it on resume
RULES = {
    "model": (SAME, "other/model"), "dropout": (SAME, 0.2), "seed": (SAME, 7), "micro_batch_size": (SAME, 2),
    "num_micro_batches": (SAME, 2), "epochs": (FREE, 5), "max_steps": (FREE, 10), "eval_every": (FREE, 5),
    "report_to": (FREE, "tensorboard"), "activation_checkpointing": (FREE, True), "compile": (FREE, True),
    "use_liger_kernel": (FREE, True), "bf16": (SAME, True), "compression_preset": (FREE, "wan"),
    "skip_nonfinite": (FREE, True),
    "data.dataset": (SAME, "other.jsonl"), "data.dataset_config": (SAME, "x"),
    "data.eval_dataset": (SAME, "held_out.jsonl"), "data.text_column": (SAME, "body"),
    "data.text_pair_column": (SAME, "body2"), "data.label_column": (SAME, "y"), "data.seq_len": (SAME, 64),
    "data.packing": (SAME, True), "data.packing_overflow": (SAME, "error"),
    "data.assistant_only_loss": (SAME, False), "data.completion_only_loss": (SAME, False),
    "data.chat_template": (SAME, "chatml"), "data.max_train_samples": (SAME, 100),
    "data.max_eval_samples": (FREE, 10), "data.eval_fraction": (SAME, 0.1),
    "optimization.lr": (SAME, 2e-3), "optimization.optimizer": (SAME, {"type": "Adam", "params": {}}),
    "optimization.scheduler": (SAME, None), "optimization.loss_average": (SAME, "micro_batches"),
    "optimization.gradient_clipping": (SAME, 0.5), "optimization.param_dtype": (SAME, "bfloat16"),
    "checkpointing.output_dir": (FREE, "elsewhere"), "checkpointing.save_every": (FREE, 10),
    "checkpointing.save_total_limit": (FREE, 5), "checkpointing.copy_checkpoints": (FREE, False),
    "checkpointing.overwrite_output_dir": (FREE, True), "checkpointing.resume": (FREE, "latest"),
    "checkpointing.save_on_signal": (FREE, False), "checkpointing.signal_grace": (FREE, 60.0),
    "distributed.pipeline_stages": (RESHAPES, 2), "distributed.schedule": (SAME, "gpipe"),
    "distributed.partition": (RESHAPES, "uniform"), "distributed.placement": (FREE, "auto"),
    "distributed.cluster": (FREE, "cluster.yaml"), "distributed.placement_trials": (FREE, 1),
    "distributed.backend": (FREE, "gloo"),
    "distributed.dist_timeout": (FREE, 60.0), "distributed.peer_timeout": (FREE, 10.0),
    "compression.forward": (SAME, "direct"), "compression.forward_bits": (SAME, 4),
    "compression.backward": (SAME, "none"), "compression.backward_bits": (SAME, 8),
    "compression.subspace_rank": (SAME, 16), "compression.subspace_energy": (SAME, 0.9),
    "compression.subspace_max_rank": (SAME, 32), "compression.backward_basis": (SAME, "own"),
    "compression.backward_feedback": (SAME, True), "compression.first_visit": (KEPT, "hadamard"),
    "compression.first_visit_bits": (SAME, 4), "compression.first_visit_base": (SAME, "none"),
    "compression.warmup_epochs": (SAME, 1), "compression.buffer_dtype": (SAME, torch.float32),
    "compression.buffer_bits": (SAME, 8), "compression.buffer_dir": (FREE, "buffers_elsewhere"),
    "compression.buffer_memory_gb": (FREE, 1.0), "compression.buffer_disk_gb": (FREE, 1.0),
    "compression.forward_group_size": (SAME, 32), "compression.backward_group_size": (SAME, 32),
    "compression.stochastic": (SAME, False), "compression.scale_dtype": (SAME, "bfloat16"),
    "compression.entropy_coding": (FREE, False), "compression.tie": (SAME, "none"),
    "compression.tie_bits": (SAME, 4), "compression.tie_rank": (SAME, 4), "compression.tie_rows_rank": (SAME, 4),
    "compression.auto_bits_min": (SAME, 3),
    "compression.auto_bits_max": (SAME, 6), "compression.auto_bits_every": (SAME, 10),
    "compression.auto_bits_slack": (SAME, 0.05), "compression.link_mbit": (SAME, [100.0]),
    "data_parallel.replicas": (RESHAPES, 2), "data_parallel.algorithm": (SAME, "qadam"),
    "data_parallel.bits": (SAME, 4),
    "data_parallel.warmup_steps": (KEPT, 5), "data_parallel.shares": (KEPT, [5, 3]),
    "data_parallel.local_steps": (SAME, 2),
    "data_parallel.topk_ratio": (SAME, 0.05), "data_parallel.random_ratio": (SAME, 0.2),
    "data_parallel.topology": (SAME, "ring"), "data_parallel.peer_selection": (SAME, "all"),
    "data_parallel.interval": (SAME, 2),
    "lora.rank": (SAME, 8), "lora.alpha": (SAME, 32), "lora.dropout": (SAME, 0.1),
    "lora.target_modules": (SAME, ["q_proj"]), "lora.load_in_4bit": (SAME, True),
    "lora.bnb_4bit_quant_type": (SAME, "fp4"), "lora.merge": (FREE, True), "lora.use_bnb_nested_quant": (SAME, True),
}
NEEDS = {dest: {"lora.rank": 8} for dest in ("lora.alpha", "lora.dropout", "lora.target_modules", "lora.load_in_4bit",
                                          "lora.use_bnb_nested_quant")}  # valid only beside another value
NEEDS["lora.use_bnb_nested_quant"]["lora.load_in_4bit"] = True
NEEDS["distributed.cluster"] = {"distributed.placement": "auto"}
NEEDS["data_parallel.shares"] = {"data_parallel.replicas": 2, "num_micro_batches": 4}
for _dest in ("compression.backward_basis", "compression.backward_feedback"):  # a subspace backward's
    NEEDS[_dest] = {"compression.forward_bits": 4, "compression.forward": "subspace", "compression.backward_bits": 4,
                    "compression.backward": "subspace"}
NEEDS["compression.backward_feedback"]["compression.backward_basis"] = "own"  # feedback needs the own basis


def flag(dest: str) -> str:
    return dict(destinations())[dest].metadata.get("flag", dest.rpartition(".")[2])


def with_values(cfg: RunConfig, values: dict) -> RunConfig:
    for dest, value in values.items():
        section, _, name = dest.rpartition(".")
        cfg = replace(cfg, **({section: replace(getattr(cfg, section), **{name: value})} if section
                              else {name: value}))
    return cfg


def saved(tmp_path, cfg: RunConfig, shape: bool = True):
    """A checkpoint directory whose manifest records `cfg` (what check_compatible reads of it), and its blocks per
    stage and data position (`shape`; a checkpoint from before they were recorded has neither)."""
    manifest = {"format": checkpoint.FORMAT, "fingerprint": checkpoint.fingerprint(cfg)}
    if shape:
        manifest["stage_blocks"] = [2, 2]
        manifest["position"] = {"epoch": 0, "index": 1, "dealt": [cfg.replicas, cfg.num_micro_batches]}
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return tmp_path


def test_every_setting_has_its_rule_here_and_its_field_declares_it():
    declared = {dest: f.metadata.get("resume", SAME) for dest, f in destinations()}
    assert set(declared) == set(RULES), (sorted(set(declared) - set(RULES)), sorted(set(RULES) - set(declared)))
    wrong = {dest: (declared[dest], rule) for dest, (rule, _) in RULES.items() if declared[dest] != rule}
    assert not wrong, f"declared vs this table: {wrong}"
    assert set(SECTIONS) == {dest.split(".")[0] for dest in RULES if "." in dest}


@pytest.mark.parametrize("dest", [d for d, (rule, _) in RULES.items() if rule in (SAME, KEPT)])
def test_a_setting_that_must_stay_is_refused_in_one_line_naming_its_flag(tmp_path, dest):
    base = with_values(RunConfig(task="causal_lm"), NEEDS.get(dest, {}))
    other = with_values(base, {dest: RULES[dest][1]})
    assert value_at(other, dest) != value_at(base, dest)
    with pytest.raises(ValueError) as refused:
        checkpoint.check_compatible(saved(tmp_path, base), other)
    line = str(refused.value)
    assert "\n" not in line and f"{flag(dest)}=" in line and "written by a different run" in line, line
    assert checkpoint.check_compatible(saved(tmp_path, other), other) == other  # its own value resumes


@pytest.mark.parametrize("dest", [d for d, (rule, _) in RULES.items() if rule == FREE])
def test_a_free_setting_takes_the_resumed_runs_value(tmp_path, dest):
    base = with_values(RunConfig(task="causal_lm"), NEEDS.get(dest, {}))
    other = with_values(base, {dest: RULES[dest][1]})
    assert value_at(other, dest) != value_at(base, dest)
    assert checkpoint.check_compatible(saved(tmp_path, base), other) == other


@pytest.mark.parametrize("dest", [d for d, (rule, _) in RULES.items() if rule == KEPT])
def test_auto_takes_what_the_checkpoints_run_resolved_a_kept_setting_to(tmp_path, dest):
    resolved = with_values(with_values(RunConfig(task="causal_lm"), NEEDS.get(dest, {})), {dest: RULES[dest][1]})
    auto = with_values(resolved, {dest: "auto"})
    assert value_at(checkpoint.check_compatible(saved(tmp_path, resolved), auto), dest) == RULES[dest][1]


def test_all_the_training_samples_resume_as_all_of_them_however_said(tmp_path):
    """--max_train_samples 0 and none both mean every sample: a checkpoint of one resumes with the other."""
    zero = with_values(RunConfig(task="causal_lm"), {"data.max_train_samples": 0})
    none = RunConfig(task="causal_lm")
    assert checkpoint.check_compatible(saved(tmp_path, zero), none) == none
    assert checkpoint.check_compatible(saved(tmp_path, none), zero) == zero


@pytest.mark.parametrize("dest", [d for d, (rule, _) in RULES.items() if rule == RESHAPES])
def test_a_shape_setting_may_change_and_reshards(tmp_path, dest):
    base = RunConfig(task="causal_lm")
    other = with_values(base, {dest: RULES[dest][1]})
    assert value_at(other, dest) != value_at(base, dest)
    kept = other if dest != "data_parallel.replicas" else with_values(other, {"num_micro_batches": 2})  # 1 x 4 = 2 x 2
    assert checkpoint.check_compatible(saved(tmp_path, with_values(base, {"distributed.pipeline_stages": 4})),
                                       other) == kept


def test_another_replica_count_keeps_the_global_batch_or_is_refused_in_one_line(tmp_path):
    """2 replicas x 2 micro-batches resume as 1 x 4 or 4 x 1 (the LR plan and the epoch's steps are the run's); a
    count the global batch does not split over, another num_micro_batches, and a checkpoint that does not say its
    data position are refused naming the value."""
    two = with_values(RunConfig(task="causal_lm"), {"data_parallel.replicas": 2, "num_micro_batches": 2})
    ckpt = saved(tmp_path, two)
    for replicas, each in ((1, 4), (4, 1), (2, 2)):
        cfg = checkpoint.check_compatible(ckpt, with_values(two, {"data_parallel.replicas": replicas}))
        assert (cfg.replicas, cfg.num_micro_batches) == (replicas, each)
        assert checkpoint.check_compatible(ckpt, cfg) == cfg  # asked again with what it resolved
    with pytest.raises(ValueError, match=r"resume on 3 replicas: the checkpoint's global batch of 4 micro-batches "
                                         r"\(2 x 2 replicas\) does not split over 3; expected a replica count "
                                         "dividing 4"):
        checkpoint.check_compatible(ckpt, with_values(two, {"data_parallel.replicas": 3}))
    with pytest.raises(ValueError, match="num_micro_batches=2 in the checkpoint, 3 in this run"):
        checkpoint.check_compatible(ckpt, with_values(two, {"data_parallel.replicas": 1, "num_micro_batches": 3}))
    with pytest.raises(ValueError, match="was written before checkpoints recorded their data position; expected "
                                         "replicas=2"):
        checkpoint.check_compatible(_unplaced(tmp_path, two), with_values(two, {"data_parallel.replicas": 1}))


def test_a_regrouped_runs_checkpoint_resumes_with_the_flags_its_launch_was_given(tmp_path):
    """An elastic restart passes the first launch's flags again: 2 micro-batches, which the shrunk run took as 4 on 1
    replica. Its checkpoint (1 replica x 4, launched with 2) resumes with 2 as 4, at 1 replica or back at 2 as 2; 3 is
    another setting, refused."""
    shrunk = with_values(RunConfig(task="causal_lm"), {"num_micro_batches": 4})
    ckpt = saved(tmp_path, shrunk)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest["position"]["launched"] = 2
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    given = with_values(shrunk, {"num_micro_batches": 2})
    assert checkpoint.check_compatible(ckpt, given).num_micro_batches == 4
    back = checkpoint.check_compatible(ckpt, with_values(given, {"data_parallel.replicas": 2}))
    assert (back.replicas, back.num_micro_batches) == (2, 2)
    with pytest.raises(ValueError, match="num_micro_batches=4 in the checkpoint, 3 in this run"):
        checkpoint.check_compatible(ckpt, with_values(shrunk, {"num_micro_batches": 3}))


def _unplaced(tmp_path, cfg: RunConfig):
    """A checkpoint that records its blocks per stage but not its data position (written before positions were)."""
    directory = saved(tmp_path, cfg)
    manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
    del manifest["position"]
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return directory


def test_auto_blocks_take_the_checkpoints_only_on_its_stage_count(tmp_path):
    """The blocks a run resolved (a plan's) hold for its stage count; on another, `auto` resolves anew."""
    planned = with_values(RunConfig(task="causal_lm"), {"distributed.pipeline_stages": 2,
                                                        "distributed.partition": [3, 1]})
    same = with_values(planned, {"distributed.partition": "auto"})
    assert checkpoint.check_compatible(saved(tmp_path, planned), same).distributed.partition == [3, 1]
    other = with_values(same, {"distributed.pipeline_stages": 4})
    assert checkpoint.check_compatible(saved(tmp_path, planned), other).distributed.partition == "auto"


def test_a_checkpoint_that_does_not_record_its_blocks_keeps_its_shape(tmp_path):
    base = with_values(RunConfig(task="causal_lm"), {"distributed.pipeline_stages": 4})
    for dest, value in (("distributed.pipeline_stages", 2), ("distributed.partition", [1, 1, 1, 1])):
        with pytest.raises(ValueError, match=f"{flag(dest)}="):
            checkpoint.check_compatible(saved(tmp_path, base, shape=False), with_values(base, {dest: value}))


def test_unequal_shares_stay_on_as_many_replicas_and_are_the_new_runs_own_on_another_count(tmp_path):
    """A checkpoint of replicas taking 5 and 3 micro-batches: `auto` keeps them on two replicas (the shards hold the
    AQ-SGD rows), another list is refused; on one replica or four the run's own shares deal the rest of the epoch."""
    two = with_values(RunConfig(task="causal_lm"), {"data_parallel.replicas": 2, "num_micro_batches": 4,
                                                    "data_parallel.shares": [5, 3]})
    ckpt = saved(tmp_path, two)
    auto = with_values(two, {"data_parallel.shares": "auto"})
    assert checkpoint.check_compatible(ckpt, auto).data_parallel.shares == [5, 3]
    with pytest.raises(ValueError, match=r"micro_batch_shares=\[5, 3\] in the checkpoint, \[4, 4\] in this run"):
        checkpoint.check_compatible(ckpt, with_values(two, {"data_parallel.shares": [4, 4]}))
    for replicas, each in ((1, 8), (4, 2)):
        cfg = checkpoint.check_compatible(ckpt, with_values(auto, {"data_parallel.replicas": replicas}))
        assert (cfg.replicas, cfg.num_micro_batches, cfg.data_parallel.shares) == (replicas, each, "auto")
    # given by hand on another count, they must hold the checkpoint's global batch of 8 micro-batches
    assert checkpoint.check_compatible(ckpt, with_values(two, {"data_parallel.replicas": 4, "data_parallel.shares":
                                                               [3, 3, 1, 1]})).num_micro_batches == 2
    with pytest.raises(ValueError, match=r"micro_batch_shares=6,6,2,2 sum to 16 micro-batches, the checkpoint's global "
                                         r"batch 8 \(4 x 2 replicas\)"):
        checkpoint.check_compatible(ckpt, with_values(two, {"data_parallel.replicas": 4,
                                                            "data_parallel.shares": [6, 6, 2, 2]}))
