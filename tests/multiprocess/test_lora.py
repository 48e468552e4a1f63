"""LoRA through PEFT inside each stage: with compression off, 2 stages train as PEFT's own LoRA on the unpartitioned
model (tests/helpers/reference.py); only the adapters (and a new classification head) train, under every
data-parallel algorithm, and a resumed engine continues as the uninterrupted one."""
import pytest
import torch
import transformers

from aqpipe import data_parallel
from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups, owned_parameters
from aqpipe.pipeline.loading import build_stage
from aqpipe.pipeline.adapters import adapter_state_dict, seed_adapters
from aqpipe.pipeline.lora import LoraSettings, add_lora, lora_config
from tests.helpers.processes import spawn
from tests.helpers.reference import random_batches, train_reference

VOCAB, SEQ, MBS, MICRO, STEPS, LAYERS = 96, 12, 2, 2, 3, 4
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
         "num_attention_heads": 4, "max_position_embeddings": 64, "pad_token_id": 0}
# what sets each case apart: a tied head in bf16 as Llama 3.2 ships, its adapters' dropout on; GPT2's Conv1D
# (fan_in_fan_out) over all of its linear layers; a classifier whose new head trains in full
CASES = {
    "llama_bf16": ("LlamaForCausalLM", {**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True},
                   torch.bfloat16, LoraSettings(rank=4, alpha=16, dropout=0.1)),
    "gpt2": ("GPT2LMHeadModel", {"vocab_size": VOCAB, "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "n_positions": 64},
             torch.float32, LoraSettings(rank=4, target_modules=("all-linear",))),
    "qwen3_classifier": ("Qwen3ForSequenceClassification", {**SMALL, "num_key_value_heads": 2, "head_dim": 8,
                                                            "num_labels": 3}, torch.float32, LoraSettings(rank=2)),
}
DROPOUT_PARTS = {"llama_bf16": "decoder", "gpt2": "gpt2", "qwen3_classifier": "decoder"}


def batches(classify: bool) -> list[list[dict[str, torch.Tensor]]]:
    return random_batches(STEPS, MICRO, MBS, SEQ, VOCAB, classes=3 if classify else None)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def stage_with_adapters(name, directory, stage_index, stages):
    cls_name, _, _, settings = CASES[name]
    cls = getattr(transformers, cls_name)
    config = transformers.AutoConfig.from_pretrained(directory)
    stage, ties, _ = build_stage(cls, config, stage_index, stages, checkpoint=directory, dtype=config.dtype)
    adapters = lora_config(cls, config, settings, train_head="Classification" in cls_name)
    add_lora(stage, adapters, seed=0, dtype=torch.float32)
    return stage, ties


def train_each_case(rank, world, checkpoints):
    groups = build_groups(Grid.for_world(world, world), rank)
    out = {}
    for name, directory in checkpoints.items():
        stage, ties = stage_with_adapters(name, directory, groups.stage, world)
        base = {k: v.clone() for k, v in stage.named_parameters(remove_duplicate=False) if not v.requires_grad}
        engine = PipelineEngine(stage, groups, optimizer(owned_parameters(stage, ties)),
                                EngineSettings(num_samples=MBS * MICRO * STEPS, seq_len=SEQ, gradient_clipping=1.0),
                                ties=ties, compression=CompressionConfig())
        log = [engine.train_batch(mbs).record() for mbs in batches("Classification" in CASES[name][0])]
        state = engine.state_dict()
        del state["model"][next(iter(state["model"]))]  # a saved state lacking a weight that trains
        try:
            engine.load_state_dict(state)
            refused = None
        except ValueError as exc:
            refused = str(exc)
        out[name] = {"log": log, "adapters": adapter_state_dict(stage), "autocast": engine.bf16, "refused": refused,
                     "merged": {k: v.clone() for k, v in engine.hf_state_dict().items()},
                     "dtypes": {p.dtype for p in stage.parameters() if not p.requires_grad},
                     "base_kept": all(torch.equal(v, stage.get_parameter(k)) for k, v in base.items()),
                     "state": sorted(engine.state_dict()["model"]), "frozen": set(base),
                     "trained": sorted(n for n, p in stage.named_parameters() if p.requires_grad)}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("lora"), {}
    for name, (cls_name, values, dtype, _) in CASES.items():
        config = getattr(transformers, cls_name).config_class(**values)
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        model.to(dtype).save_pretrained(root / name, max_shard_size="40KB")
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def pipelines(checkpoints):
    return spawn(train_each_case, 2, checkpoints)


def peft_reference(name, directory):
    """PEFT's own LoRA on the unpartitioned model, its adapters seeded as the stages seed theirs; over a bf16 base
    the forward under bf16 autocast, as the engine runs it (the optimizer outside: under autocast its norms and
    updates would compute in bf16)."""
    from peft import get_peft_model, get_peft_model_state_dict

    cls_name, _, dtype, settings = CASES[name]
    cls = getattr(transformers, cls_name)
    model = cls.from_pretrained(directory, dtype=dtype)
    config = lora_config(cls, model.config, settings, train_head="Classification" in cls_name)
    peft_model = get_peft_model(model, config)
    inner = peft_model.base_model.model
    seed_adapters(inner, seed=0)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if dtype == torch.bfloat16:
        inner.forward = torch.autocast("cpu", dtype=torch.bfloat16)(inner.forward)
    ref = train_reference(inner, batches("Classification" in cls_name), family=DROPOUT_PARTS[name], num_blocks=LAYERS,
                          clip=1.0, optimizer=optimizer([p for p in peft_model.parameters() if p.requires_grad]))
    return ref, get_peft_model_state_dict(peft_model), peft_model.merge_and_unload().state_dict()


@pytest.mark.parametrize("name", list(CASES))
def test_two_stages_with_adapters_train_as_peft_on_the_unpartitioned_model(checkpoints, pipelines, name):
    ref, adapters, merged = peft_reference(name, checkpoints[name])
    runs = [r[name] for r in pipelines]
    for run in runs:
        assert [s["loss"] for s in run["log"]] == pytest.approx(ref["loss"], rel=1e-5)
        assert [s["grad_norm"] for s in run["log"]] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert all(s["tie_bytes"] == 0 for s in run["log"])  # a frozen tie: no rows, no gradients
    mine = {k: v for run in runs for k, v in run["adapters"].items()}
    assert set(mine) == set(adapters)  # PEFT's names, the head (modules_to_save) included
    # within float reordering (Adam scales the rounding of near-zero gradients up); an error moves them by the lr
    for key, value in adapters.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-4, msg=key)
    # the merged model (what the export writes): PEFT's merge_and_unload, a tied head written once, by its owner;
    # ours folds in float32 and rounds once, PEFT adds in the base's dtype: a bf16 step apart at most
    ours = {k: v for run in runs for k, v in run["merged"].items()}
    assert set(ours) <= set(merged)  # the tied embedding's follower (stage 0) leaves it to its owner, the head:
    tied = {"llama_bf16": {"model.embed_tokens.weight"}, "gpt2": {"transformer.wte.weight"}}
    assert set(merged) - set(ours) == tied.get(name, set())
    step = 1e-2 if CASES[name][2] == torch.bfloat16 else 1e-4
    for key, value in ours.items():
        torch.testing.assert_close(value.to(merged[key].dtype), merged[key], rtol=step, atol=step, msg=key)


@pytest.mark.parametrize("name", list(CASES))
def test_only_adapters_train_and_the_base_stays_in_its_checkpoint_dtype(pipelines, name):
    dtype = CASES[name][2]
    for run in pipelines:
        r = run[name]
        assert r["base_kept"] and r["dtypes"] == {dtype}
        assert r["autocast"] == (dtype == torch.bfloat16)  # a bf16 base under float32 adapters
        assert r["trained"] and all(".lora_" in n or n.startswith("score.") for n in r["trained"])
        assert r["refused"].startswith("the saved stage") and "here but not saved" in r["refused"]
        # the checkpoint holds what trains (and buffers), not the base: that stays in the model it came from
        assert set(r["trained"]) <= set(r["state"]) and not set(r["state"]) & r["frozen"]


ALGORITHMS = {
    "allreduce": {}, "decentralized": {"peer_selection": "shift_one"}, "low_precision_decentralized": {"bits": 8},
    "qadam": {"warmup_steps": 1, "bits": 8}, "qsparse_local_sgd": {"local_steps": 2, "topk_ratio": 0.25, "bits": 8},
    "cocktail_sgd": {"random_ratio": 0.5, "topk_ratio": 0.25, "bits": 8},
}
DP_CASE = "llama_bf16"  # as users bring it: a bf16 base, float32 adapters


def engine_with_adapters(directory, groups, grid, name, options):
    stage, ties = stage_with_adapters(DP_CASE, directory, groups.stage, grid.stages)
    owned = owned_parameters(stage, ties)
    algorithm = data_parallel.create(name, owned, data_parallel.Comm(groups.data_parallel,
                                                                     grid.data_parallel_ranks(groups.stage)),
                                     **options)
    return PipelineEngine(stage, groups, algorithm.wrap_optimizer(optimizer(owned)),
                          EngineSettings(num_samples=2 * MBS * MICRO * STEPS, seq_len=SEQ, gradient_clipping=1.0),
                          ties=ties, compression=CompressionConfig(), data_parallel=algorithm)


def every_algorithm_with_adapters(rank, world, directory):
    """2 stages x 2 replicas, each replica on its own micro-batches; after step 2 the engine's state goes through a
    checkpoint's bytes into a new engine, which takes step 3 again."""
    import io

    grid = Grid.for_world(world, 2)
    groups = build_groups(grid, rank)
    steps = [step[groups.replica::2] + step[groups.replica::2] for step in batches(False)]
    out = {}
    for name, options in ALGORITHMS.items():
        engine = engine_with_adapters(directory, groups, grid, name, options)
        base = {k: v.clone() for k, v in engine.stage.named_parameters() if not v.requires_grad}
        log, saved = [], None
        for index, mbs in enumerate(steps):
            if index == 2:
                saved = io.BytesIO()
                torch.save(engine.state_dict(), saved)
            log.append(engine.train_batch(mbs).record())
        resumed = engine_with_adapters(directory, groups, grid, name, options)
        saved.seek(0)
        resumed.load_state_dict(torch.load(saved, weights_only=True))
        again = resumed.train_batch(steps[2]).record()
        owned = owned_parameters(engine.stage, engine.ties)
        out[name] = {"log": log, "again": again, "adapters": adapter_state_dict(engine.stage),
                     "resumed": adapter_state_dict(resumed.stage), "trained": sum(p.numel() for p in owned),
                     "base_kept": all(torch.equal(v, engine.stage.get_parameter(k)) for k, v in base.items()),
                     "base": sum(v.numel() for v in base.values())}
    return out


@pytest.fixture(scope="module")
def replicas(checkpoints):
    return spawn(every_algorithm_with_adapters, 4, checkpoints[DP_CASE])


def test_allreduce_sends_the_adapters_alone_and_keeps_replicas_identical(replicas):
    trained = [r["allreduce"]["trained"] for r in replicas]
    assert sum(r["allreduce"]["base"] for r in replicas) > 10 * sum(trained)  # what full fine-tuning would send
    # a ring allreduce: each of R replicas sends 2 (R - 1) / R of its float32 gradients; R = 2
    for step in replicas[0]["allreduce"]["log"]:
        assert step["dp_bytes"] == 4 * sum(trained)
    for stage in (0, 1):  # ranks stage and stage + 2 are a stage's two replicas
        a, b = replicas[stage]["allreduce"]["adapters"], replicas[stage + 2]["allreduce"]["adapters"]
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_moves_adapters_only_and_resumes_exactly(replicas, name):
    full = 4 * sum(r[name]["base"] + r[name]["trained"] for r in replicas) / 2  # an allreduce of every weight
    adapters = 4 * sum(r[name]["trained"] for r in replicas) / 2
    for run in (r[name] for r in replicas):
        assert run["base_kept"]
        assert max(s["dp_bytes"] for s in run["log"]) <= 2 * adapters < full / 5
        assert run["again"]["loss"] == run["log"][2]["loss"] and run["again"]["dp_bytes"] == run["log"][2]["dp_bytes"]
        assert all(torch.equal(run["resumed"][k], v) for k, v in run["adapters"].items())


def one_stage_state(rank, world, directory):
    groups = build_groups(Grid.for_world(1, 1), rank)
    stage, ties = stage_with_adapters("llama_bf16", directory, 0, 1)
    engine = PipelineEngine(stage, groups, optimizer(owned_parameters(stage, ties)),
                            EngineSettings(num_samples=8, seq_len=SEQ))
    return sorted(engine.state_dict()["model"]), sorted(stage.state_dict())


def test_a_checkpoint_of_one_stage_holding_a_tied_base_keeps_neither_of_its_names(checkpoints):
    """One stage holds the embedding and the head tied to it: one frozen weight under two names in state_dict()."""
    saved, everything = spawn(one_stage_state, 1, checkpoints["llama_bf16"])[0]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(everything)
    assert saved and all(".lora_" in name for name in saved)
