"""QLoRA across data-parallel replicas as the trainer builds it (aqpipe/train.py `build_engine`): 2 stages x 2
replicas of a bf16 tied Llama whose blocks' frozen base each rank packs in 4 bits (NF4, bitsandbytes) from its own
shards, the adapters injected before the replicas' algorithm is handed the parameters. Every replica packs the same
4-bit weights; under allreduce the replicas' adapters stay equal and equal one process's on the combined batch; under
a compressed algorithm they stay equal too; the data-parallel wire carries the adapters' bytes and nothing else.
(LoRA over a bf16 base under replicas: tests/multiprocess/test_lora.py.)"""
import dataclasses
import math

import pytest
import torch

from aqpipe.config import RunConfig
from aqpipe.settings import build
from aqpipe.data import load_tokenizer
from aqpipe.models import resolve_model
from aqpipe.world import World
from aqpipe.data_parallel import DataParallelConfig
from aqpipe.pipeline import CompressionConfig, owned_parameters
from aqpipe.pipeline.adapters import LoraSettings, adapter_state_dict
from aqpipe.pipeline.lora import lora_config
from tests.helpers.files import tiny_llama_dir
from tests.helpers.processes import spawn
from tests.helpers.reference import random_batches

SEQ, MBS, MICRO, STEPS = 12, 2, 2, 3
ALGORITHMS = {"allreduce": DataParallelConfig(replicas=2),
              # replicas that agree after every sync (QAdam would too, but it steps the optimizer's parameters and
              # never the ones it is handed, so it cannot see the bug this file guards against)
              "qsparse_local_sgd": DataParallelConfig(replicas=2, algorithm="qsparse_local_sgd", local_steps=1,
                                                      topk_ratio=0.25, bits=8)}


def settings(directory: str, stages: int, dp: DataParallelConfig) -> RunConfig:
    return build("causal_lm", {"model": directory, "seq_len": SEQ, "pipeline_stages": stages, "lr": 1e-2,
                               "lora": LoraSettings(rank=4, alpha=16, load_in_4bit=True),
                               "compression": CompressionConfig(),
                               "data_parallel": dp, "micro_batch_size": MBS, "num_micro_batches": MICRO,
                               "scheduler": None})


def steps(vocab: int) -> list[list[dict[str, torch.Tensor]]]:
    """The combined batch of each step: replica r takes micro-batches r, r + 2, ..."""
    return random_batches(STEPS, 2 * MICRO, MBS, SEQ, vocab)


def train(rank: int, world: int, directory: str, stages: int, dp: DataParallelConfig) -> dict:
    from aqpipe.train import build_engine

    torch.set_num_threads(1)
    cfg = settings(directory, stages, dp)
    tokenizer = load_tokenizer(directory)
    spec = resolve_model(directory, "llama", "causal_lm", tokenizer, SEQ, None, frozen=True)
    adapters = lora_config(spec.model_class, spec.config, cfg.lora, False, stages, cfg.distributed.partition)
    engine = build_engine(cfg, spec, World(rank, world, rank, torch.device("cpu")), 4 * MBS * MICRO * STEPS, STEPS,
                          adapters)
    replicas = world // stages
    log = [engine.train_batch(step[engine.groups.replica::replicas]).record() for step in steps(len(tokenizer))]
    adapters = adapter_state_dict(engine.stage)
    packed = {name: p.detach().clone() for name, p in engine.stage.named_parameters() if p.dtype == torch.uint8}
    return {"log": log, "adapters": adapters, "adapter_numel": sum(v.numel() for v in adapters.values()),
            "trained_numel": sum(p.numel() for p in owned_parameters(engine.stage, engine.ties)), "packed": packed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tiny_llama_dir(tmp_path_factory.mktemp("lora_replicas") / "llama"))
    out = {name: spawn(train, 4, directory, 2, dp) for name, dp in ALGORITHMS.items()}
    out["alone"] = spawn(train, 1, directory, 1, dataclasses.replace(ALGORITHMS["allreduce"], replicas=1))
    return out


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_replicas_adapters_stay_equal_and_the_wire_carries_them_alone(runs, name):
    ranks = runs[name]
    for stage in (0, 1):  # ranks stage and stage + 2 hold a stage's two replicas
        packed, again = ranks[stage]["packed"], ranks[stage + 2]["packed"]  # the 4-bit base: each block's, alike
        assert len(packed) >= 7 and set(packed) == set(again) and all(torch.equal(packed[k], again[k]) for k in packed)
        a, b = ranks[stage]["adapters"], ranks[stage + 2]["adapters"]
        assert a and set(a) == set(b)
        assert all(a[k].abs().max() > 0 for k in a if ".lora_B." in k)  # trained: B starts at zero
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    for rank in ranks:
        assert rank["trained_numel"] == rank["adapter_numel"] > 0  # nothing but the adapters trains or syncs
    adapters = sum(rank["adapter_numel"] for rank in ranks)  # dp_bytes is the job's: every rank's sends
    logs = [[s["dp_bytes"] for s in rank["log"]] for rank in ranks]
    assert all(log == logs[0] for log in logs)  # every rank reports the job's total
    if name == "allreduce":  # a ring allreduce of R = 2 replicas: each sends 2 (R - 1) / R of its float32 gradients
        assert logs[0] == [4 * adapters] * STEPS
    else:  # each replica's top quarter of its drift, 8-bit codes and 4-byte indices, allgathered by 2 replicas
        sent = sum(math.ceil(rank["adapter_numel"] / 4) * (4 + 1) + 8 for rank in ranks)  # index, code; min/step
        assert logs[0] == [sent] * STEPS

def test_allreduced_replicas_train_as_one_process_on_the_combined_batch(runs):
    alone = runs["alone"][0]
    combined = {k: v for rank in runs["allreduce"] for k, v in rank["adapters"].items()}
    assert set(combined) == set(alone["adapters"])
    for key, value in alone["adapters"].items():  # float reordering only; a replica training alone is off by ~lr
        torch.testing.assert_close(combined[key], value, rtol=1e-4, atol=1e-5, msg=key)
    losses = [(a["loss"] + b["loss"]) / 2 for a, b in zip(runs["allreduce"][1]["log"], runs["allreduce"][3]["log"])]
    assert losses == pytest.approx([s["loss"] for s in alone["log"]], rel=1e-5)
