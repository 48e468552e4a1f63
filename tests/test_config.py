"""Run configuration: file < flags precedence, DeepSpeed keys, and one clear line for each bad value."""
import json

import pytest

from recipes.config import resolve


def run(argv, monkeypatch, world=1):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return resolve("causal_lm", argv, "test")


def test_flags_override_the_file_which_overrides_defaults(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5, "train_batch_size": 15,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "pipeline": {"stages": 2, "schedule": "gpipe", "activation_checkpoint_interval": 1},
        "compression": {"forward": "direct", "forward_bits": 3, "backward": "none"},
        "run": {"seq_len": 32, "epochs": 7},
    }))
    cfg = run(["--deepspeed_config", str(path), "--forward_bits", "4", "--lr", "0.01"], monkeypatch, world=2)
    assert (cfg.micro_batch_size, cfg.num_micro_batches, cfg.pipeline_stages, cfg.schedule) == (3, 5, 2, "gpipe")
    assert (cfg.forward_compress, cfg.forward_bits, cfg.backward_compress) == ("direct", 4, "none")
    assert (cfg.lr, cfg.optimizer["type"], cfg.seq_len, cfg.epochs) == (0.01, "SGD", 32, 7)
    assert cfg.activation_checkpointing


@pytest.mark.parametrize("world,stages", [(1, 1), (2, 2), (3, 3)])
def test_auto_stages_fill_the_launchers_world(monkeypatch, world, stages):
    assert run([], monkeypatch, world=world).pipeline_stages == stages


@pytest.mark.parametrize("argv,message", [
    (["--forward_bits", "9"], "forward_bits=9: expected an integer from 1 to 8"),
    (["--backward_bits", "0"], "backward_bits=0: expected an integer from 1 to 8"),
    (["--forward_compress", "int4"], "forward_compress='int4': expected one of none, direct, aqsgd"),
    (["--backward_compress", "aqsgd"], "backward_compress='aqsgd': expected one of none, direct"),
    (["--schedule", "zigzag"], "schedule='zigzag': expected one of gpipe, 1f1b"),
    (["--num_micro_batches", "0"], "num_micro_batches=0: expected an integer >= 1"),
    (["--micro_batch_size", "-2"], "micro_batch_size=-2: expected an integer >= 1"),
    (["--seq_len", "1"], "seq_len=1: expected at least 2 tokens"),
    (["--pipeline_stages", "3"], "pipeline_stages=3 x replicas=1 needs 3 processes; the launcher started 1"),
    (["--pipeline_stages", "two"], "pipeline_stages='two': expected a positive integer or auto"),
    (["--partition", "2,x"], "partition='2,x': expected parameters, uniform, or block counts"),
    (["--lr", "0"], "lr=0.0: expected a positive learning rate"),
    (["--model", "/no/such/model"], "model='/no/such/model': no such file or directory"),
    (["--deepspeed_config", "/no/such.json"], "--deepspeed_config /no/such.json: no such file"),
    (["--buffer_dtype", "int8"], "buffer_dtype='int8': expected one of float16, bfloat16, float32"),
    (["--dp_algorithm", "gossip"], "dp_algorithm='gossip': expected one of allreduce"),
    (["--dp_bits", "9"], "dp_bits=9: expected an integer from 1 to 8"),
    (["--dp_topk_ratio", "1.5"], "dp_topk_ratio=1.5: expected a fraction in (0, 1]"),
    (["--dp_peer_selection", "ring"], "dp_peer_selection='ring': expected shift_one or all"),
    (["--dp_local_steps", "0"], "dp_local_steps=0: expected an integer >= 1"),
])
def test_bad_values_exit_2_with_one_line(argv, message, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(argv, monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_inconsistent_train_batch_size_is_refused(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2}))
    with pytest.raises(SystemExit):
        run(["--deepspeed_config", str(path)], monkeypatch)
    assert "train_batch_size=10: expected micro_batch_size x num_micro_batches x replicas = 4 x 2 x 1" in capsys.readouterr().err


def test_unknown_run_setting_and_bad_json_are_refused(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"run": {"sequence_length": 64}}))
    with pytest.raises(SystemExit):
        run(["--deepspeed_config", str(path)], monkeypatch)
    assert "unknown setting(s) sequence_length" in capsys.readouterr().err
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        run(["--deepspeed_config", str(path)], monkeypatch)
    assert "not valid JSON" in capsys.readouterr().err


def test_odd_replicas_for_shift_one_are_refused_before_starting(monkeypatch, capsys):
    import data_parallel

    monkeypatch.setitem(data_parallel.REGISTRY, "decentralized", object)  # registered by its own module
    with pytest.raises(SystemExit):
        run(["--replicas", "3", "--pipeline_stages", "1", "--dp_algorithm", "decentralized"], monkeypatch, world=3)
    assert "replicas=3: decentralized with shift_one pairs replicas, expected an even count" in capsys.readouterr().err


def test_data_parallel_block_of_the_config_file(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"data_parallel": {"replicas": 2, "algorithm": "allreduce", "bits": 4}}))
    cfg = run(["--deepspeed_config", str(path), "--pipeline_stages", "2"], monkeypatch, world=4)
    assert (cfg.replicas, cfg.dp_algorithm, cfg.dp_bits, cfg.pipeline_stages) == (2, "allreduce", 4, 2)
