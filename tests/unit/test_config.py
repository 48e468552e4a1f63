"""Run configuration: file < flags precedence, DeepSpeed keys, and one clear line for each bad value."""
import dataclasses
import json
import shutil
from pathlib import Path
import re

import pytest
import torch

from aqpipe import cli
from aqpipe.config import CheckpointingSettings, DataSettings, DistributedSettings, OptimizationSettings, RunConfig
from aqpipe.data_parallel import DataParallelConfig
from aqpipe.pipeline import CompressionConfig
from aqpipe.settings import resolve
from aqpipe.tasks import TASKS
from aqpipe.pipeline.compression_config import AUTO_GROUP_SIZE


def run(argv, monkeypatch, world=1):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return resolve("causal_lm", argv, "test")


def test_flags_override_the_file_which_overrides_defaults(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5, "train_batch_size": 15,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "pipeline": {"stages": 2, "schedule": "gpipe", "activation_checkpoint_interval": 1},
        "compression": {"forward": "direct", "forward_bits": 3, "backward": "none", "tie": "none", "tie_bits": 5},
        "run": {"seq_len": 32, "epochs": 7},
    }))
    cfg = run(["--deepspeed_config", str(path), "--forward_bits", "4", "--lr", "0.01"], monkeypatch, world=2)
    dist = cfg.distributed
    assert (cfg.micro_batch_size, cfg.num_micro_batches, dist.pipeline_stages, dist.schedule) == (3, 5, 2, "gpipe")
    c = cfg.compression
    assert (c.forward, c.forward_bits, c.backward, c.tie, c.tie_bits) == ("direct", 4, "none", "none", 5)
    optim = cfg.optimization
    assert (optim.lr, optim.optimizer["type"], cfg.data.seq_len, cfg.epochs) == (0.01, "SGD", 32, 7)
    assert cfg.activation_checkpointing


@pytest.mark.parametrize("world,stages", [(1, 1), (2, 2), (3, 3)])
def test_auto_stages_fill_the_launchers_world(monkeypatch, world, stages):
    assert run([], monkeypatch, world=world).distributed.pipeline_stages == stages


@pytest.mark.parametrize("world,replicas", [(2, 1), (4, 2), (6, 3)])
def test_auto_replicas_are_every_whole_pipeline_the_world_holds(monkeypatch, world, replicas):
    cfg = run(["--pipeline_stages", "2", "--replicas", "auto"], monkeypatch, world=world)
    assert (cfg.replicas, cfg.distributed.pipeline_stages) == (replicas, 2)


@pytest.mark.parametrize("argv,message", [
    (["--replicas", "auto"], "replicas=auto with pipeline_stages=auto: expected a stage count (--pipeline_stages N)"),
    (["--replicas", "auto", "--pipeline_stages", "2"], "replicas=auto: the launcher's 1 processes are not a multiple "
                                                      "of pipeline_stages=2"),
    (["--replicas", "0"], "replicas=0: expected an int >= 1 or auto"),
    (["--forward_bits", "9"], "forward_bits=9: expected an integer from 1 to 8"),
    (["--backward_bits", "0"], "backward_bits=0: expected an integer from 1 to 8"),
    (["--tie_bits", "9"], "tie_bits=9: expected an integer from 1 to 8"),
    (["--tie_compress", "zip"], "tie_compress='zip': expected one of auto, none, aqsgd"),
    (["--forward_compress", "int4"], "forward_compress='int4': expected one of none, direct, hadamard, aqsgd"),
    (["--backward_compress", "aqsgd"], "backward_compress='aqsgd': expected one of none, direct"),
    (["--schedule", "zigzag"], "schedule='zigzag': expected one of gpipe, 1f1b"),
    (["--compile", "--schedule", "zb1"], "compile=True with schedule='zb1': a compiled stage's backward is one step"),
    (["--num_micro_batches", "0"], "num_micro_batches=0: expected an integer >= 1"),
    (["--micro_batch_size", "-2"], "micro_batch_size=-2: expected an integer >= 1"),
    (["--seq_len", "1"], "seq_len=1: expected at least 2 tokens"),
    (["--pipeline_stages", "3"], "pipeline_stages=3 does not divide the launcher's 1 processes"),
    (["--dataset", "/no/such/corpus.txt"], "dataset='/no/such/corpus.txt': no such file"),
    (["--save_every", "-1"], "save_every=-1: expected an integer >= 0"),
    (["--peer_timeout", "0"], "peer_timeout=0.0: expected a positive number of seconds"),
    (["--backend", "mpi"], "backend='mpi': expected one of auto, gloo, nccl"),
    (["--backend", "nccl"], "backend=nccl: no CUDA GPU on this machine; expected gloo (or auto) on CPUs"),
    (["--pipeline_stages", "two"], "pipeline_stages='two': expected a positive integer or auto"),
    (["--partition", "2,x"], "argument --partition: '2,x': expected a word such as parameters, or block counts"),
    (["--partition", "2,0"], "partition=[2, 0]: expected auto, parameters, uniform, or block counts like 2,2"),
    (["--lr", "0"], "lr=0.0: expected a positive learning rate"),
    (["--dropout", "1"], "dropout=1.0: expected a probability in [0, 1)"),
    (["--lora_rank", "-1"], "lora_rank=-1: expected an integer >= 0"),
    (["--lora_rank", "8", "--lora_alpha", "0"], "lora_alpha=0.0: expected a positive number"),
    (["--lora_rank", "8", "--lora_dropout", "1"], "lora_dropout=1.0: expected a probability in [0, 1)"),
    (["--lora_target_modules", "q_proj"], "lora_target_modules=['q_proj'] without --lora_rank: expected a LoRA rank"),
    (["--lora_rank", "8", "--lora_target_modules", "all-linear,q_proj"],
     "lora_target_modules=all-linear,q_proj: all-linear stands alone"),
    (["--lora_rank", "8", "--lora_target_modules", "q_proj,"], "argument --lora_target_modules: 'q_proj,': expected "
                                                              "comma-separated names"),
    (["--model", "/no/such/model"], "model='/no/such/model': no such file or directory"),
    (["--deepspeed_config", "/no/such.json"], "--deepspeed_config /no/such.json: no such file"),
    (["--buffer_dtype", "int8"], "buffer_dtype='int8': expected one of float16, bfloat16, float32"),
    (["--buffer_bits", "6"], "buffer_bits=6: expected one of 4, 8, or none"),
    (["--forward_bits", "auto", "--auto_bits_min", "6", "--auto_bits_max", "4"],
     "auto_bits_min=6 > auto_bits_max=4: expected min <= max"),
    (["--forward_bits", "auto", "--auto_bits_every", "0"], "auto_bits_every=0: expected a positive number of steps"),
    (["--forward_bits", "auto", "--auto_bits_slack", "1.5"],
     "auto_bits_slack=1.5: expected a fraction in [0, 1]"),
    (["--link_mbit", "100,0"], "link_mbit=[100.0, 0.0]: expected positive rates in Mbit/s, one per boundary"),
    (["--link_mbit", "100,20"], "link_mbit=[100.0, 20.0]: expected 0 rates, one per boundary of 1 stages"),
    (["--dp_algorithm", "gossip"], "dp_algorithm='gossip': expected one of allreduce"),
    (["--dp_bits", "9"], "dp_bits=9: expected an integer from 1 to 8"),
    (["--dp_topk_ratio", "1.5"], "dp_topk_ratio=1.5: expected a fraction in (0, 1]"),
    (["--dp_peer_selection", "ring"], "dp_peer_selection='ring': expected one of shift_one, all"),
    (["--dp_random_ratio", "0"], "dp_random_ratio=0.0: expected a fraction in (0, 1]"),
    (["--dp_algorithm", "cocktail_sgd", "--dp_topk_ratio", "0.2"],
     "dp_topk_ratio=0.2: expected at most dp_random_ratio=0.1"),
    (["--dp_topology", "star"], "dp_topology='star': expected one of directed_ring, ring"),
    (["--dp_local_steps", "0"], "dp_local_steps=0: expected an integer >= 1"),
    (["--group_size", "0"], "forward_group_size=0: expected a positive integer, auto, or none"),
    (["--backward_group_size", "-4"], "backward_group_size=-4: expected a positive integer, auto, or none"),
])
def test_bad_values_exit_2_with_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --backend nccl's line, on any machine
    with pytest.raises(SystemExit) as exit_info:
        run(argv, monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def refusal(config, tmp_path, monkeypatch, capsys) -> str:
    """What resolving with `config` (a dict, or raw text) as the config file prints as it exits with status 2."""
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        run(["--deepspeed_config", str(path)], monkeypatch)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# how checkpoints of format 4 named the settings of these sections: alone ("seq_len" for "data.seq_len")
FORMAT_4_NAMES = {f"{section}.{f.name}": f.name for section, kind in (
    ("data", DataSettings), ("optimization", OptimizationSettings), ("checkpointing", CheckpointingSettings),
    ("distributed", DistributedSettings)) for f in dataclasses.fields(kind)}


def test_inconsistent_train_batch_size_is_refused(tmp_path, monkeypatch, capsys):
    config = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    assert ("train_batch_size=10: expected micro_batch_size x num_micro_batches x replicas = 4 x 2 x 1"
            in refusal(config, tmp_path, monkeypatch, capsys))


def test_unknown_run_setting_and_bad_json_are_refused(tmp_path, monkeypatch, capsys):
    unknown = refusal({"run": {"sequence_length": 64}}, tmp_path, monkeypatch, capsys)
    assert "unknown setting(s) sequence_length" in unknown
    assert "not valid JSON" in refusal("{not json", tmp_path, monkeypatch, capsys)


def test_odd_replicas_for_shift_one_are_refused_before_starting(monkeypatch, capsys):
    from aqpipe import data_parallel
    monkeypatch.setitem(data_parallel.REGISTRY, "decentralized", object)  # registered by its own module
    with pytest.raises(SystemExit):
        run(["--replicas", "3", "--pipeline_stages", "1", "--dp_algorithm", "decentralized"], monkeypatch, world=3)
    assert "replicas=3: decentralized with shift_one pairs replicas, expected an even count" in capsys.readouterr().err


def test_data_parallel_block_of_the_config_file(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"data_parallel": {"replicas": 2, "algorithm": "allreduce", "bits": 4}}))
    cfg = run(["--deepspeed_config", str(path), "--pipeline_stages", "2"], monkeypatch, world=4)
    assert (cfg.replicas, cfg.data_parallel.algorithm, cfg.data_parallel.bits,
            cfg.distributed.pipeline_stages) == (2, "allreduce", 4, 2)


def _model_config(tmp_path, layers=2, positions=64):
    from transformers import GPT2Config

    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    GPT2Config(n_embd=32, n_layer=layers, n_head=2, n_positions=positions).to_json_file(path)
    return str(path)


@pytest.mark.parametrize("case", ["stages_over_blocks", "builtin_stages_over_blocks", "seq_len_over_positions",
                                  "stages_not_dividing_world", "replicas_not_matching", "bad_fault_spec"])
def test_late_looking_mistakes_are_caught_before_any_process_group(tmp_path, monkeypatch, capsys, case):
    """Each needs the model's config, the launcher's world size or the environment; none may start a run."""
    model, out = _model_config(tmp_path), tmp_path / "never"
    argv, world, message = {
        "stages_over_blocks": (["--model", model, "--pipeline_stages", "3"], 3,
                               f"pipeline_stages=3: model '{model}' has 2 blocks; expected at most 2 stages"),
        "builtin_stages_over_blocks": ([], 5, "pipeline_stages=5: model the built-in shape has 4 blocks"),
        "seq_len_over_positions": (["--model", model, "--seq_len", "128"], 1,
                                   f"seq_len=128: model '{model}' has 64 positions; expected seq_len <= 64"),
        "stages_not_dividing_world": (["--pipeline_stages", "3"], 4,
                                      "pipeline_stages=3 does not divide the launcher's 4 processes"),
        "replicas_not_matching": (["--pipeline_stages", "2", "--replicas", "3"], 4,
                                  "pipeline_stages=2 x replicas=3 needs 6 processes; the launcher started 4"),
        "bad_fault_spec": ([], 1, "AQPIPE_FAULT='kill:x': expected KIND:RANK:STEP"),
    }[case]
    if case == "bad_fault_spec":
        monkeypatch.setenv("AQPIPE_FAULT", "kill:x")
    with pytest.raises(SystemExit) as exit_info:
        run([*argv, "--output_dir", str(out)], monkeypatch, world=world)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1
    assert not out.exists()


def test_resume_is_checked_before_starting(tmp_path, monkeypatch, capsys):
    from aqpipe import checkpoint

    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        run(["--output_dir", str(out), "--resume"], monkeypatch)
    assert "resume='latest': no checkpoint at" in capsys.readouterr().err and not out.exists()
    # a checkpoint written by 2 stages, resumed by 1
    theirs = run(["--output_dir", str(out)], monkeypatch, world=2)
    step = out / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    manifest = {"format": checkpoint.FORMAT, "fingerprint": checkpoint.fingerprint(theirs)}
    (step / "manifest.json").write_text(json.dumps(manifest))
    (out / "checkpoints" / "latest").write_text(step.name)
    with pytest.raises(SystemExit):
        run(["--output_dir", str(out), "--resume", "latest"], monkeypatch)
    assert ("was written by a different run: pipeline_stages=2 in the checkpoint, 1 in this run"
            in capsys.readouterr().err)
    assert run(["--output_dir", str(out), "--resume", "latest"], monkeypatch, world=2).checkpointing.resume == str(step)
    del manifest["fingerprint"]["compression.auto_bits_slack"]  # written before the setting existed: its default
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert run(["--output_dir", str(out), "--resume", "latest"], monkeypatch, world=2).checkpointing.resume == str(step)
    assert run(["--output_dir", str(tmp_path / "fresh"), "--resume", "auto"], monkeypatch).checkpointing.resume is None


PRINTED = [[], ["--group_size", "none", "--partition", "1,1", "--buffer_dtype", "bfloat16", "--link_mbit", "5",
               "--no_stochastic", "--bf16", "--forward_bits", "auto", "--dp_warmup_steps", "7", "--dropout", "0.2",
               "--max_steps", "3", "--model", "config.json", "--lora_rank", "4", "--lora_target_modules", "c_attn"]]


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("flags", PRINTED, ids=["defaults", "flags"])
def test_a_printed_config_runs_the_settings_it_was_printed_from(name, flags, monkeypatch, tmp_path, capsys):
    """`aqpipe TASK [flags] --print_config > f.json`, then `aqpipe TASK --deepspeed_config f.json`: the same run."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)  # the default output_dir, relative, must hold no earlier run
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_positions": 256}))
    task = TASKS[name]
    with pytest.raises(SystemExit) as printed:
        resolve(task.kind, [*flags, "--print_config"], "t", task.defaults)
    assert printed.value.code == 0
    (tmp_path / "f.json").write_text(capsys.readouterr().out)
    from_file = resolve(task.kind, ["--deepspeed_config", "f.json"], "t")
    assert from_file == resolve(task.kind, flags, "t", task.defaults)
    assert from_file != resolve(task.kind, ["--deepspeed_config", "f.json", "--seed", "7"], "t")


def test_a_task_states_only_where_it_differs_from_the_run_defaults():
    """One home per default: a task restating RunConfig's value would be a second copy to keep in step."""
    from dataclasses import fields

    from aqpipe.config import RunConfig

    base = {f.name: f.default for f in fields(RunConfig)}
    for task in TASKS.values():
        same = [key for key, value in task.defaults.items() if base.get(key) == value]
        assert not same, f"{task.name} restates RunConfig's defaults {same}"


def test_the_command_line_names_the_tasks(capsys):
    assert cli.main([]) == 2 and "usage: aqpipe {causal-lm,classify,gpt2,deberta}" in capsys.readouterr().out
    assert cli.main(["--local_rank=0", "bert"]) == 2
    assert "task 'bert': expected one of causal-lm, classify, gpt2, deberta" in capsys.readouterr().err


def test_group_sizes_and_rounding_reach_the_compression_section(tmp_path, monkeypatch):
    c = run(["--group_size", "32", "--backward_group_size", "none", "--no_stochastic", "--no_entropy_coding"],
            monkeypatch).compression
    assert (c.forward_group_size, c.backward_group_size, c.stochastic, c.entropy_coding) == (32, None, False, False)
    assert (c.group_size("forward", 768), c.group_size("backward", 768)) == (32, None)
    c = run([], monkeypatch).compression  # auto: groups at 2 bits (the default forward), whole rows at 4
    assert (c.stochastic, c.group_size("forward", 768), c.group_size("backward", 768)) == (True, AUTO_GROUP_SIZE, None)
    assert c.entropy_coding
    assert c.group_size("forward", AUTO_GROUP_SIZE) is None  # rows no wider than a group stay rows
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"compression": {"forward_bits": 4, "backward_bits": 2, "forward_group_size": 128,
                                                "stochastic": False}}))
    c = run(["--deepspeed_config", str(path)], monkeypatch).compression
    assert (c.group_size("forward", 768), c.group_size("backward", 768), c.stochastic) == (128, AUTO_GROUP_SIZE, False)


def test_an_unknown_key_in_a_section_is_named(tmp_path, monkeypatch, capsys):
    err = refusal({"compression": {"forward_bit": 4}}, tmp_path, monkeypatch, capsys)
    assert "unknown setting(s) forward_bit in the config's compression block" in err


def test_a_run_block_takes_any_setting_by_its_flags_name_and_a_sections_block_wins(tmp_path, monkeypatch, capsys):
    """A config file's run block names settings as the command line does (`forward_compress`, `dp_bits`, `seq_len`),
    as files printed before the sections had blocks did; the same setting in its section's block wins; a name no flag
    has is refused, naming the block key it may have meant."""
    path = tmp_path / "flat.json"
    path.write_text(json.dumps({"run": {"forward_compress": "direct", "forward_bits": 3, "dp_bits": 4, "seq_len": 32},
                                "data": {"seq_len": 16}}))
    cfg = run(["--deepspeed_config", str(path)], monkeypatch)
    assert (cfg.compression.forward, cfg.compression.forward_bits, cfg.data_parallel.bits, cfg.data.seq_len) == \
        ("direct", 3, 4, 16)
    err = refusal({"run": {"forward": "none", "bits": 4}}, tmp_path, monkeypatch, capsys)
    assert "unknown setting(s) bits, forward in the config's run block" in err
    assert ("bits is data_parallel block key bits (its flag: dp_bits); forward is compression block key forward (its "
            "flag: forward_compress)") in err


def test_another_runs_results_are_not_overwritten_without_being_told(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert run(["--output_dir", str(out)], monkeypatch).checkpointing.overwrite_output_dir is False  # absent: fine
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    run(["--output_dir", str(out)], monkeypatch)  # nothing a run writes: fine
    (out / "summary.json").write_text("{}")
    (out / "model").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        run(["--output_dir", str(out)], monkeypatch)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "holds another run's results (summary.json, model): expected --overwrite_output_dir" in err
    assert "--resume to continue that run" in err
    assert run(["--output_dir", str(out), "--overwrite_output_dir"],
               monkeypatch).checkpointing.overwrite_output_dir is True
    with pytest.raises(SystemExit):  # auto: nothing saved to continue from, so it would start over them
        run(["--output_dir", str(out), "--resume", "auto"], monkeypatch)
    assert "holds another run's results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["--output_dir", str(out), "--overwrite_output_dir", "--resume"], monkeypatch)
    assert "expected one of them" in capsys.readouterr().err


def test_checkpoints_keep_the_newest_two_by_default(monkeypatch):
    assert run([], monkeypatch).checkpointing.save_total_limit == 2
    assert run(["--save_total_limit", "0"], monkeypatch).checkpointing.save_total_limit == 0  # 0: keep all


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_bad_flag_is_one_line_from_rank_0_first(rank, monkeypatch, capsys):
    """Rank 0 says it at once; another rank waits (a launcher stops it meanwhile, since rank 0 has ended) and only
    then says it, naming itself: what it found may be its own machine's (a file missing there)."""
    import time

    from aqpipe import speech

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(speech, "QUIET_EXIT_DELAY", 0.5)
    for argv in (["--forward_bits", "2.5"], ["--forward_bits", "9"], ["--no_such_flag"]):
        started = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            run(argv, monkeypatch)
        waited = time.monotonic() - started
        captured = capsys.readouterr()
        assert exit_info.value.code == 2 and captured.out == ""
        assert captured.err.count("\n") == 1 and "usage:" not in captured.err, captured.err
        assert (waited >= 0.5) == (rank == "1") and captured.err.endswith(" (rank 1)\n") == (rank == "1")
    with pytest.raises(SystemExit) as exit_info:
        run(["--help"], monkeypatch)
    assert exit_info.value.code == 0 and bool(capsys.readouterr().out) == (rank == "0")


def test_qadam_warms_up_for_a_tenth_of_the_run_and_says_so(monkeypatch):
    from aqpipe.data_parallel import DataParallelConfig

    cfg = run(["--replicas", "2", "--pipeline_stages", "2", "--dp_algorithm", "qadam"], monkeypatch, world=4)
    assert cfg.data_parallel.warmup_steps == "auto" and cfg.data_parallel.warmup_for(96) == 10
    assert cfg.data_parallel.plan(96) == ("qadam: full-precision gradients for the first 10 of 96 steps "
                                          "(dp_warmup_steps), then 8-bit momentum")
    fixed = DataParallelConfig(replicas=2, algorithm="qadam", warmup_steps=100)
    assert fixed.warmup_for(96) == 100 and "covers all 96 steps of this run" in fixed.plan(96)
    assert DataParallelConfig(replicas=2, algorithm="allreduce").plan(96) is None
    assert run(["--dp_warmup_steps", "5"], monkeypatch).data_parallel.warmup_for(96) == 5


@pytest.mark.parametrize("name", ["gpt2", "deberta"])
def test_the_first_step_learns_and_the_schedule_says_nothing(name, monkeypatch, capfd, tmp_path):
    """DeepSpeed's warm-up gave warmup_min_lr (0) to steps 1 and 2 and warned that its lr was read before its
    start; step k now runs at iteration k, and the decay ends after the last step, not on it."""
    import torch

    from aqpipe.train import build_scheduler

    monkeypatch.chdir(tmp_path)
    cfg = resolve(TASKS[name].kind, [], "t", TASKS[name].defaults)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=cfg.optimization.lr)
    scheduler = build_scheduler(cfg, optimizer, total_steps=40)
    lrs = []
    for _ in range(40):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # a 4-step warm-up (a tenth of 40), then decay
    assert 0 < lrs[0] < lrs[1] < lrs[3] == pytest.approx(cfg.optimization.lr)
    assert lrs[-1] > 0 and lrs[-1] < lrs[-2]
    out = capfd.readouterr()
    assert "Attempting to get learning rate" not in out.out + out.err


def test_an_auto_warm_up_keeps_the_number_it_resolved_to_across_a_resume(tmp_path, monkeypatch):
    """A resume with more epochs has more steps; the warm-up of the run it continues must not change with them."""
    from aqpipe import checkpoint

    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--replicas", "2", "--pipeline_stages", "1", "--dp_algorithm", "qadam"]
    started = run(argv, monkeypatch, world=2)
    started = started.for_run(96)  # what the trainer records at start
    step = out / "checkpoints" / "step_00000096"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": checkpoint.FORMAT,
                                                    "fingerprint": checkpoint.fingerprint(started)}))
    (out / "checkpoints" / "latest").write_text(step.name)
    resumed = run([*argv, "--epochs", "6", "--resume"], monkeypatch, world=2)
    assert resumed.data_parallel.warmup_steps == 10 and resumed.data_parallel.warmup_for(192) == 10
    with pytest.raises(SystemExit):  # a number given on the command line is a setting like any other
        run([*argv, "--epochs", "6", "--resume", "--dp_warmup_steps", "20"], monkeypatch, world=2)


def test_auto_first_visits_stay_auto_and_an_older_checkpoints_resolved_codec_is_kept(tmp_path, monkeypatch):
    """auto chooses per sample (whole where the run reads a sample back), so a run records auto and a resume with more
    epochs goes on choosing; a checkpoint from when auto was resolved by the run's epochs keeps what it resolved, and
    one from before first-visit codecs resumes with whole first visits."""
    from aqpipe import checkpoint

    def checkpoint_of(fingerprint, name):
        out = tmp_path / name
        step = out / "checkpoints" / "step_00000008"
        step.mkdir(parents=True)
        (step / "manifest.json").write_text(json.dumps({"format": checkpoint.FORMAT, "fingerprint": fingerprint}))
        (out / "checkpoints" / "latest").write_text(step.name)
        return ["--output_dir", str(out)]

    one_epoch = run(["--output_dir", str(tmp_path / "x"), "--epochs", "1"], monkeypatch).for_run(8)
    assert one_epoch.compression.first_visit == "auto"
    resumed = run([*checkpoint_of(checkpoint.fingerprint(one_epoch), "one"), "--epochs", "3", "--resume"], monkeypatch)
    assert resumed.compression.first_visit == "auto"
    resolved = {**checkpoint.fingerprint(one_epoch), "compression.first_visit": "hadamard"}  # an older one-epoch run
    assert run([*checkpoint_of(resolved, "resolved"), "--epochs", "3", "--resume"],
               monkeypatch).compression.first_visit == "hadamard"
    older = {k: v for k, v in checkpoint.fingerprint(one_epoch).items() if not k.startswith("compression.first_visit")}
    old = run([*checkpoint_of(older, "old"), "--epochs", "1", "--resume"], monkeypatch)
    assert old.compression.first_visit == "none"


def test_a_manifest_the_previous_format_wrote_resumes_and_refuses_by_flag(tmp_path, monkeypatch, capsys):
    """tests/data/manifest_format4.json was written by aqpipe's format 4 (a 2-replica QAdam LoRA run of 8 steps):
    read once into this format's names, it resumes the run it came from (its resolved warm-up kept), refuses another
    naming the flag, and a format this aqpipe never wrote is refused in one line."""
    out = tmp_path / "out"
    step = out / "checkpoints" / "step_00000008"
    step.mkdir(parents=True)
    shutil.copy(Path(__file__).parent.parent / "data" / "manifest_format4.json", step / "manifest.json")
    (out / "checkpoints" / "latest").write_text(step.name)
    argv = ["--output_dir", str(out), "--seq_len", "64", "--lora_rank", "4", "--lora_alpha", "16", "--replicas", "2",
            "--pipeline_stages", "1", "--dp_algorithm", "qadam", "--epochs", "3", "--resume"]
    resumed = run(argv, monkeypatch, world=2)
    assert resumed.checkpointing.resume == str(step) and resumed.data_parallel.warmup_steps == 1
    for other, says in ((["--seq_len", "32"], "seq_len=64 in the checkpoint, 32 in this run"),
                        (["--lora_rank", "8"], "lora_rank=4 in the checkpoint, 8 in this run"),
                        (["--lr", "0.01"], "lr=0.001 in the checkpoint, 0.01 in this run")):
        with pytest.raises(SystemExit):
            run([*argv, *other], monkeypatch, world=2)
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    manifest = json.loads((step / "manifest.json").read_text())
    # format 4 as written before --eval_dataset existed (every run then held out the last eval_fraction)
    older = {**manifest, "fingerprint": {k: v for k, v in manifest["fingerprint"].items() if k != "eval_dataset"}}
    (step / "manifest.json").write_text(json.dumps(older))
    assert run(argv, monkeypatch, world=2).checkpointing.resume == str(step)
    with pytest.raises(SystemExit):
        run([*argv, "--eval_dataset", str(step / "manifest.json")], monkeypatch, world=2)
    assert "eval_dataset=None in the checkpoint" in capsys.readouterr().err
    (step / "manifest.json").write_text(json.dumps({**manifest, "format": 3}))
    with pytest.raises(SystemExit):
        run(argv, monkeypatch, world=2)
    assert "format 3, this aqpipe reads 4, 5" in capsys.readouterr().err


def test_what_an_older_checkpoint_meant_is_a_value_the_setting_takes():
    """A setting's `older` (what a checkpoint from before it meant) is one of its choices where it declares them,
    and a section made with every `older` value is valid: a typo there would refuse or misread old checkpoints."""
    from aqpipe.compression.fields import THIS_RUN
    from aqpipe.config import SECTIONS

    for kind in SECTIONS.values():
        olders = {f.name: f.metadata["older"] for f in dataclasses.fields(kind)
                  if "older" in f.metadata and f.metadata["older"] is not THIS_RUN}
        for f in dataclasses.fields(kind):
            if f.name in olders and "choices" in f.metadata:
                assert olders[f.name] in f.metadata["choices"], (kind.__name__, f.name)
        kind(**olders)


def test_fp16_compute_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    err = refusal({"fp16": {"enabled": True}}, tmp_path, monkeypatch, capsys)
    assert err.count("\n") == 1 and "fp16 enabled; expected bf16 (float16 compute needs a loss scaler" in err
    (tmp_path / "off.json").write_text(json.dumps({"fp16": {"enabled": False}}))
    assert run(["--deepspeed_config", str(tmp_path / "off.json")], monkeypatch).bf16 is False


def test_param_dtype_takes_float32_or_bfloat16_with_adam(tmp_path, monkeypatch, capsys):
    assert run(["--param_dtype", "bfloat16"], monkeypatch).optimization.param_dtype == "bfloat16"
    for flags, says in ((["--param_dtype", "float16"], "param_dtype='float16': expected float32 or bfloat16 "
                                                       "(float16 weights need a loss scaler"),
                        (["--param_dtype", "int8"], "param_dtype='int8': expected float32 or bfloat16\n")):
        with pytest.raises(SystemExit):
            run(flags, monkeypatch)
        assert says in capsys.readouterr().err
    path = tmp_path / "sgd.json"
    path.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    with pytest.raises(SystemExit):
        run(["--deepspeed_config", str(path), "--param_dtype", "bfloat16"], monkeypatch)
    assert "param_dtype=bfloat16 with optimizer 'SGD': expected Adam or AdamW" in capsys.readouterr().err


def test_param_dtype_bfloat16_names_the_optimizer_options_it_cannot_take(tmp_path, monkeypatch, capsys):
    path = tmp_path / "adam.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}}))
    with pytest.raises(SystemExit):
        run(["--deepspeed_config", str(path), "--param_dtype", "bfloat16"], monkeypatch)
    assert "param_dtype=bfloat16 with optimizer params amsgrad: expected only betas, eps and weight_decay" in \
        capsys.readouterr().err


def test_files_and_checkpoints_from_before_the_lora_section_and_the_chat_settings_still_resume(tmp_path, monkeypatch,
                                                                                              capsys):
    """LoRA's settings are a section now ("lora.rank", a config file's "lora" block): a printed file with them in
    its run block reads the same, and a checkpoint with flat lora_* keys and no chat settings (one conversation a
    sample, a micro-batch's mean loss) resumes with those, and is refused with others, naming them."""
    from aqpipe import checkpoint
    from aqpipe.pipeline.adapters import LoraSettings

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"run": {"lora_rank": 4, "lora_target_modules": ["q_proj"]}}))
    assert run(["--deepspeed_config", str(path)], monkeypatch).lora == LoraSettings(4, target_modules=("q_proj",))
    flags = ["--output_dir", str(tmp_path / "out"), "--lora_rank", "4", "--lora_alpha", "16"]
    cfg = run([*flags, "--loss_average", "micro_batches"], monkeypatch).for_run(24)
    new = checkpoint.fingerprint(cfg)
    assert (new["lora.rank"], new["lora.alpha"], new["optimization.loss_average"]) == (4, 16, "micro_batches")
    older = {FORMAT_4_NAMES.get(k, k.replace("lora.", "lora_")): v for k, v in new.items()
             if k not in ("optimization.loss_average", "data.packing", "data.packing_overflow", "data.chat_template")}
    step = tmp_path / "out" / "checkpoints" / "step_00000008"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": 4, "fingerprint": older}))
    (tmp_path / "out" / "checkpoints" / "latest").write_text(step.name)
    resumed = run([*flags, "--loss_average", "micro_batches", "--resume"], monkeypatch)
    assert resumed.lora.rank == 4 and resumed.optimization.loss_average == "micro_batches" and not resumed.data.packing
    out = ["--output_dir", str(tmp_path / "out"), "--resume"]
    for other, says in ((["--lora_rank", "4", "--lora_alpha", "16", "--loss_average", "tokens"],
                         "loss_average='micro_batches' in the checkpoint, 'tokens' in this run"),
                        (["--lora_rank", "4", "--lora_alpha", "8", "--loss_average", "micro_batches"],
                         "lora_alpha=16.0 in the checkpoint, 8.0 in this run")):
        with pytest.raises(SystemExit):
            run([*out, *other], monkeypatch)
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("section, values, says", [
    (DataSettings, {"seq_len": 1}, "seq_len=1: expected at least 2 tokens"),
    (DataSettings, {"seq_len": 0}, "seq_len=0: expected an integer >= 1"),
    (DataSettings, {"packing_overflow": "drop"}, "packing_overflow='drop': expected one of"),
    (OptimizationSettings, {"lr": 0.0}, "lr=0.0: expected a positive learning rate"),
    (OptimizationSettings, {"optimizer": {"type": "Lion"}}, "optimizer type 'Lion': expected one of"),
    (CheckpointingSettings, {"save_every": -1}, "save_every=-1: expected an integer >= 0"),
    (CheckpointingSettings, {"overwrite_output_dir": True, "resume": "latest"}, "--overwrite_output_dir with --resume"),
    (DistributedSettings, {"schedule": "interleaved"}, "schedule='interleaved': expected one of"),
    (DistributedSettings, {"pipeline_stages": 0}, "pipeline_stages=0: expected an integer >= 1"),
    (CompressionConfig, {"forward": "zip"}, "forward_compress='zip': expected one of"),
    (CompressionConfig, {"entropy_coding": "yes"}, "entropy_coding='yes': expected true or false"),
    (DataParallelConfig, {"replicas": 2, "algorithm": "gossip"}, "dp_algorithm='gossip': expected one of"),
])
def test_each_section_checks_itself_as_it_is_made(section, values, says):
    """No validate() to forget: a section made with a bad value (by a script, a test, the settings) raises naming
    it, and its defaults pass."""
    section()
    with pytest.raises(ValueError, match=re.escape(says)):
        section(**values)


def test_the_checks_across_sections_run_as_the_run_config_is_made():
    with pytest.raises(ValueError, match="packing with task classification: expected causal-lm"):
        RunConfig(task="classification", data=DataSettings(packing=True))
    with pytest.raises(ValueError, match="compile=True with schedule='zb1'"):
        RunConfig(task="causal_lm", compile=True, distributed=DistributedSettings(schedule="zb1"))


def test_a_file_printed_before_the_sections_reads_as_the_file_printed_now(tmp_path, monkeypatch, capsys):
    """The sections are blocks of the printed file, and a file with their settings flat in its run block (as files
    were printed before) gives the same run."""
    flags = ["--seq_len", "32", "--packing", "--loss_average", "micro_batches", "--save_every", "3", "--backend",
             "gloo", "--peer_timeout", "9", "--max_eval_samples", "5"]
    with pytest.raises(SystemExit):
        run([*flags, "--print_config"], monkeypatch)
    printed = json.loads(capsys.readouterr().out)
    assert printed["data"]["seq_len"] == 32 and printed["data"]["packing"] is True
    assert printed["optimization"]["loss_average"] == "micro_batches"
    assert (printed["checkpointing"]["save_every"], printed["distributed"]["peer_timeout"]) == (3, 9.0)
    assert not {"seq_len", "save_every", "backend", "loss_average"} & set(printed["run"])
    old = {k: v for k, v in printed.items() if k not in ("data", "optimization", "checkpointing", "distributed")}
    old["run"] = {**printed["run"], **{k: v for section in ("data", "optimization", "checkpointing", "distributed")
                                       for k, v in printed[section].items()}}
    (tmp_path / "new.json").write_text(json.dumps(printed))
    (tmp_path / "old.json").write_text(json.dumps(old))
    new_cfg = run(["--deepspeed_config", str(tmp_path / "new.json")], monkeypatch)
    old_cfg = run(["--deepspeed_config", str(tmp_path / "old.json")], monkeypatch)
    assert old_cfg == new_cfg == run(flags, monkeypatch)
    assert new_cfg.data.max_eval_samples == 5 and new_cfg.distributed.backend == "gloo"


def test_deepspeeds_own_checkpoint_block_is_left_to_deepspeed(tmp_path, monkeypatch):
    """DeepSpeed's file has a "checkpoint" block of its own (tag_validation, ...): aqpipe's section is
    "checkpointing", so a DeepSpeed file keeps working and its block sets nothing of aqpipe's."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"checkpoint": {"tag_validation": "Warn", "load_universal": False},
                                "checkpointing": {"save_every": 5}}))
    cfg = run(["--deepspeed_config", str(path)], monkeypatch)
    assert cfg.checkpointing.save_every == 5 and cfg.checkpointing == CheckpointingSettings(save_every=5)


def test_a_section_given_whole_beside_a_flat_setting_of_its_own_is_one_line():
    from aqpipe.settings import build

    cfg = build("causal_lm", {"data": DataSettings(seq_len=32, packing=True), "epochs": 2})
    assert (cfg.data.seq_len, cfg.data.packing, cfg.epochs) == (32, True, 2)
    with pytest.raises(ValueError, match="max_eval_samples given beside the data section given whole: expected it "
                                         "inside the section"):
        build("causal_lm", {"data": DataSettings(seq_len=32), "max_eval_samples": 5})


def test_a_printed_constant_rate_stays_constant(tmp_path, monkeypatch):
    """No scheduler (a constant rate) is printed as null: a file without the key would take the default's warm-up
    and decay instead."""
    from aqpipe import config_file
    from aqpipe.settings import build

    cfg = build("causal_lm", {"scheduler": None, "seq_len": 16})
    path = tmp_path / "constant.json"
    path.write_text(json.dumps(config_file.write(cfg)))
    assert run(["--deepspeed_config", str(path)], monkeypatch).optimization.scheduler is None


def test_a_compression_preset_sets_every_wire_under_what_is_given(tmp_path, monkeypatch, capsys):
    from aqpipe.presets import PRESETS

    c = run(["--compression_preset", "wan"], monkeypatch).compression
    for key, value in PRESETS["wan"]["compression"].items():
        assert getattr(c, key) == value, key
    assert (c.forward, c.backward, c.tie_rank) == ("subspace", "subspace", 16)
    # a flag wins over the preset, and so does a config file's value; the preset wins over the task's defaults
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"compression": {"subspace_rank": 8}, "run": {"compression_preset": "wan"}}))
    c = run(["--deepspeed_config", str(path), "--forward_bits", "3"], monkeypatch).compression
    assert (c.forward, c.forward_bits, c.backward_bits, c.subspace_rank) == ("subspace", 3, 4, 8)
    assert run([], monkeypatch).compression.forward == "aqsgd"  # no preset: the defaults
    with pytest.raises(SystemExit) as refused:
        run(["--compression_preset", "lan"], monkeypatch)
    assert refused.value.code == 2
    assert "compression_preset='lan': expected one of wan" in capsys.readouterr().err


TRL_COMMAND = ["--learning_rate", "2e-4", "--num_train_epochs", "2.0", "--per_device_train_batch_size", "2",
               "--gradient_accumulation_steps", "8", "--max_length", "512", "--max_grad_norm", "0.5",
               "--eval_steps", "10", "--save_steps", "20", "--save_total_limit", "1", "--warmup_ratio", "0.03",
               "--lr_scheduler_type", "cosine", "--weight_decay", "0.01", "--seed", "3", "--bf16", "True",
               "--gradient_checkpointing", "--dataset_name", "data.jsonl", "--dataset_text_field", "body",
               "--chat_template_path", "chatml", "--packing", "--output_dir", "out", "--assistant_only_loss", "False",
               "--completion_only_loss", "false", "--lora_r", "8", "--lora_alpha", "16"]
OURS = ["--lr", "2e-4", "--epochs", "2", "--micro_batch_size", "2", "--num_micro_batches", "8", "--seq_len", "512",
        "--gradient_clipping", "0.5", "--eval_every", "10", "--save_every", "20", "--save_total_limit", "1",
        "--warmup_ratio", "0.03", "--lr_scheduler_type", "cosine", "--weight_decay", "0.01", "--seed", "3", "--bf16",
        "--activation_checkpointing", "--dataset", "data.jsonl", "--text_column", "body", "--chat_template",
        "chatml", "--packing", "--output_dir", "out", "--no_assistant_only_loss", "--no_completion_only_loss",
        "--lora_rank", "8", "--lora_alpha", "16"]


def test_hf_and_trl_names_set_the_very_settings_aqpipes_names_set(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"body": "a line"}\n')
    trl, ours = run(TRL_COMMAND, monkeypatch), run(OURS, monkeypatch)
    assert trl == ours
    assert (trl.optimization.lr, trl.epochs, trl.data.seq_len, trl.eval_every) == (2e-4, 2, 512, 10)
    assert (trl.data.assistant_only_loss, trl.data.completion_only_loss, trl.lora.rank, trl.bf16) == \
        (False, False, 8, True)
    assert run(["--max_seq_length", "64"], monkeypatch).data.seq_len == 64
    with pytest.raises(SystemExit):  # HF's name for --resume: the checkpoint it names is looked for
        run(["--resume_from_checkpoint", "ckpt"], monkeypatch)
    assert "resume='ckpt': no checkpoint at ckpt" in capsys.readouterr().err


@pytest.mark.parametrize("twice", [["--lr", "1e-3", "--learning_rate", "2e-3"], ["--max_length", "64",
                                                                                   "--max_seq_length=32"]])
def test_one_setting_under_two_names_is_refused_in_one_line(twice, monkeypatch, capsys):
    with pytest.raises(SystemExit) as refused:
        run(twice, monkeypatch)
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    first, second = twice[0], twice[2].split("=")[0]
    assert len(err) == 1 and f"{first} and {second} both set" in err[0], err


def test_hf_flags_aqpipe_does_its_own_way_are_said_in_one_line_and_change_nothing(monkeypatch, capsys):
    cfg = run(["--logging_steps", "10", "--eval_strategy", "steps", "--push_to_hub"], monkeypatch)
    assert cfg == run([], monkeypatch)
    err = capsys.readouterr().err
    assert "note: --logging_steps 10: aqpipe writes every step's row" in err and "note: --eval_strategy steps" in err
    assert "note: --push_to_hub True: aqpipe writes the model" in err


@pytest.mark.parametrize("words, lora", [
    (["--use_peft"], (16, 32.0, 0.05)),  # TRL's ModelConfig defaults
    (["--use_peft", "True", "--lora_r", "8"], (8, 32.0, 0.05)),
    (["--use_peft", "--lora_alpha", "4", "--lora_dropout", "0"], (16, 4.0, 0.0)),
    (["--use_peft", "false"], (0, None, None)),
    (["--lora_r", "8"], (8, None, None)),  # aqpipe's own: a rank alone trains adapters, with PEFT's defaults
])
def test_use_peft_trains_lora_with_trls_defaults_under_what_is_given(words, lora, monkeypatch):
    cfg = run(words, monkeypatch).lora
    assert (cfg.rank, cfg.alpha, cfg.dropout) == lora


def test_use_peft_keeps_a_files_lora_settings_and_the_api_takes_it(tmp_path, monkeypatch):
    from aqpipe.api import as_layer
    from aqpipe.settings import finalize

    path = tmp_path / "lora.json"
    path.write_text(json.dumps({"lora": {"rank": 4}}))
    cfg = run(["--deepspeed_config", str(path), "--use_peft"], monkeypatch).lora
    assert (cfg.rank, cfg.alpha, cfg.dropout) == (4, 32.0, 0.05)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert finalize("causal_lm", [{}, as_layer({"use_peft": "True"})]).lora.rank == 16
    with pytest.raises(ValueError, match="use_peft='maybe': 'maybe': expected true or false"):
        finalize("causal_lm", [{}, as_layer({"use_peft": "maybe"})])


def test_the_api_takes_hf_and_trl_names_as_the_command_line_does(monkeypatch):
    """Each field declares its HF and TRL names (`hf`): `finetune(learning_rate=...)` as a Trainer user writes it; both
    names of one setting at once are refused."""
    from aqpipe.api import as_layer, flag_destinations
    from aqpipe.config import RunConfig
    from aqpipe.flags import build_parser, settings
    from aqpipe.settings import finalize

    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = finalize("causal_lm", [{}, as_layer({"learning_rate": 2e-4, "max_length": 64, "lora_r": 8,
                                                "gradient_accumulation_steps": 3})])
    assert (cfg.optimization.lr, cfg.data.seq_len, cfg.lora.rank, cfg.num_micro_batches) == (2e-4, 64, 8, 3)
    assert as_layer({"resume_from_checkpoint": True}) == {"checkpointing": {"resume": "latest"}}
    with pytest.raises(ValueError, match="lr and learning_rate are the same setting"):
        as_layer({"lr": 1e-3, "learning_rate": 2e-3})
    parser = build_parser(RunConfig, "x")  # every name the command line takes for a setting, the API takes alike
    fields = {dest for dest, _, _ in settings(RunConfig)}
    named = {o.lstrip("-"): a.dest for a in parser._actions for o in a.option_strings if a.dest in fields}
    assert {k: v for k, v in named.items() if not k.startswith("no_")}.items() <= flag_destinations().items()
    assert "learning_rate" in named and "lora_r" in named
    from aqpipe.api import finetune

    with pytest.raises(ValueError, match="dataset and dataset_name are the same setting"):  # a Dataset object too
        finetune("causal-lm", dataset=object(), dataset_name="imdb")


@pytest.mark.parametrize("words, value", [(["--packing"], True), (["--packing", "True"], True),
                                          (["--packing=yes"], True), (["--packing", "false"], False),
                                          (["--packing", "0"], False), (["--no_assistant_only_loss"], False),
                                          (["--assistant_only_loss", "True"], True), ([], False)])
def test_a_switch_takes_hfs_written_value_or_its_default(words, value, monkeypatch):
    cfg = run(words, monkeypatch)
    name = "assistant_only_loss" if "assistant" in "".join(words) else "packing"
    assert getattr(cfg.data, name) is value  # unset: packing off, as TRL's SFTConfig has it


def test_a_switch_given_a_word_it_cannot_read_is_one_line(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(["--packing", "maybe"], monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'maybe': expected true or false" in err[0], err


def test_trls_model_and_lora_rank_names_are_aqpipes_settings():
    from aqpipe.config import RunConfig
    from aqpipe.flags import build_parser

    parser = build_parser(RunConfig, "test")
    args = vars(parser.parse_args(["--model_name_or_path", "some/model", "--lora_r", "16"]))
    assert args["model"] == "some/model" and args["lora.rank"] == 16


def test_a_choice_given_as_a_list_in_a_file_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A choice looked up in a registry (a dict) cannot hash a list: it is named like any other bad choice."""
    err = refusal({"compression": {"scale_dtype": ["bfloat16"]}}, tmp_path, monkeypatch, capsys)
    assert err.count("\n") == 1 and "scale_dtype=['bfloat16']: expected one of float32, bfloat16" in err
