"""HF Trainer's optimizer and schedule flags: they edit the run's optimizer and scheduler blocks (a config file's
too), a bad value is one line, and a run's learning rates are transformers' schedule step by step."""
import json

import pytest
import torch
from transformers import get_scheduler

from aqpipe.optim import LowPrecisionAdamW
from aqpipe.settings import finalize
from aqpipe.train import build_optimizer
from tests.helpers.processes import launch_aqpipe


def finalized(*layers):
    return finalize("causal_lm", [{}, *layers])


def test_flags_edit_the_blocks_a_config_file_set():
    file = {"optimizer": {"type": "SGD", "params": {"momentum": 0.9, "weight_decay": 0.0}}}
    cfg = finalized(file, {"weight_decay": 0.1})
    assert cfg.optimization.optimizer == {"type": "SGD", "params": {"momentum": 0.9, "weight_decay": 0.1}}
    cfg = finalized(file, {"optim": "adamw", "adam_beta2": 0.95, "adam_epsilon": 1e-6})
    opt = build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-6 and group["weight_decay"] == 0.0
    cfg = finalized({"lr_scheduler_type": "cosine", "warmup_ratio": 0.25})
    assert cfg.optimization.scheduler == {"type": "cosine", "params": {"warmup_steps": 0, "warmup_ratio": 0.25}}
    assert finalized({"warmup_steps": 5}).optimization.scheduler == {"type": "linear", "params": {"warmup_steps": 5,
                                                                                   "warmup_ratio": 0.0}}
    file = {"scheduler": {"type": "cosine", "params": {"warmup_steps": 7, "warmup_ratio": 0.0}}}
    kept = finalized(file, {"lr_scheduler_type": "linear"}).optimization.scheduler["params"]
    assert kept["warmup_steps"] == 7
    assert finalized(file, {"warmup_ratio": 0.1}).optimization.scheduler["params"] == {"warmup_steps": 0,
                                                                                      "warmup_ratio": 0.1}
    cfg = finalized({"adam_beta1": "0.8", "weight_decay": "0.2"})  # an API call's text, parsed as the flag's
    params = cfg.optimization.optimizer["params"]
    assert params["betas"] == [0.8, 0.999] and params["weight_decay"] == 0.2



@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_weights_get_their_own_adamw_compiled_with_the_stage(compiled):
    cfg = finalized({"param_dtype": "bfloat16", "compile": compiled, "weight_decay": 0.1, "seed": 5})
    opt = build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    assert isinstance(opt, LowPrecisionAdamW) and opt.decoupled and opt.seed == 5
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.compile_backend == ("inductor" if compiled else None)

@pytest.mark.parametrize("layer, said", [
    ({"optim": "lion"}, "--optim lion: expected one of adamw, adam, sgd"),
    ({"optim": "sgd", "adam_beta1": 0.8}, "--adam_beta1 with optimizer SGD: expected Adam or AdamW (--optim)"),
    ({"adam_beta2": 1.0}, "--adam_beta2 1.0: expected a number in [0, 1)"),
    ({"weight_decay": -0.1}, "--weight_decay -0.1: expected a number >= 0"),
    ({"weight_decay": "lots"}, "--weight_decay 'lots': expected a number"),
    ({"lr_scheduler_type": "cosine_with_restarts"}, "--lr_scheduler_type cosine_with_restarts: expected one of "
                                                    "constant, constant_with_warmup, linear, cosine"),
    ({"lr_scheduler_type": "constant", "warmup_steps": 3}, "--warmup_steps with --lr_scheduler_type constant"),
    ({"lr_scheduler_type": "linear", "warmup_ratio": 1.5}, "--warmup_ratio 1.5: expected a fraction in [0, 1]"),
])
def test_a_bad_knob_is_one_line_naming_the_flag(layer, said):
    with pytest.raises(ValueError) as err:
        finalized(layer)
    assert str(err.value).startswith(said)


def test_a_run_takes_transformers_schedule_step_by_step(tmp_path):
    out = tmp_path / "run"
    proc = launch_aqpipe(
        ["gpt2", "--seq_len", "32", "--max_train_samples", "48", "--max_eval_samples", "8", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--max_steps", "10", "--lr", "0.01", "--lr_scheduler_type", "cosine",
         "--warmup_ratio", "0.25", "--weight_decay", "0.05", "--output_dir", str(out)], 1, tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    reference = get_scheduler("cosine", opt, num_warmup_steps=3, num_training_steps=10)  # ceil(0.25 x 10)
    expected = []
    for _ in range(10):  # HF's Trainer: step k runs at the schedule's value after k - 1 scheduler steps
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        reference.step()
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(0.01)
    config = json.loads((out / "summary.json").read_text())["config"]
    assert config["optimization"]["optimizer"]["params"]["weight_decay"] == 0.05
