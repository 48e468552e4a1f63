"""Every supported family as users bring it (a bf16 sharded checkpoint), each rank loading only its stage: with
compression off and dropout on, 3 stages train as the plain unpartitioned HF model does (tests/helpers/reference.py):
losses, gradient norms, final weights."""
import pytest
import torch
import transformers

from aqpipe.pipeline import CompressionConfig, Grid, PipelineEngine, EngineSettings, build_groups, owned_parameters
from aqpipe.pipeline.loading import build_stage
from tests.helpers.files import stored_dtypes
from tests.helpers.processes import spawn
from tests.helpers.reference import random_batches, train_reference

VOCAB, SEQ, MBS, MICRO, STEPS, LAYERS = 96, 12, 2, 2, 2, 4
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
         "num_attention_heads": 4, "max_position_embeddings": 64}
DECODER = {**SMALL, "num_key_value_heads": 2, "attention_dropout": 0.1, "pad_token_id": 0}


def configs() -> dict[str, transformers.PretrainedConfig]:
    """A tiny model of each family with what sets it apart: tied or untied heads, grouped-query attention, sliding
    windows, q/k norms, soft-capped logits, residual dropout; classification heads of the lineage and encoders."""
    t = transformers
    return {
        "LlamaForCausalLM": t.LlamaConfig(**DECODER, tie_word_embeddings=True),  # as Llama 3.2
        "Qwen2ForCausalLM": t.Qwen2Config(**DECODER, tie_word_embeddings=True, use_sliding_window=True,
                                          sliding_window=4, max_window_layers=2),  # as Qwen2.5, biases on q/k/v
        "Qwen3ForCausalLM": t.Qwen3Config(**DECODER, head_dim=8, tie_word_embeddings=False),
        "MistralForCausalLM": t.MistralConfig(**DECODER, sliding_window=4),
        "Gemma3ForCausalLM": t.Gemma3TextConfig(**DECODER, head_dim=8, sliding_window=4,
                                                final_logit_softcapping=30.0),
        "Phi3ForCausalLM": t.Phi3Config(**DECODER, resid_pdrop=0.1),
        "LlamaForSequenceClassification": t.LlamaConfig(**DECODER, num_labels=3),
        "Qwen3ForSequenceClassification": t.Qwen3Config(**DECODER, head_dim=8, num_labels=3),
        "BertForSequenceClassification": t.BertConfig(**SMALL, num_labels=3),
        "RobertaForSequenceClassification": t.RobertaConfig(**{**SMALL, "max_position_embeddings": 70}, num_labels=3,
                                                            pad_token_id=1),
    }


SCHEDULES = ("1f1b", "gpipe", "zb1")


def dropout_parts(name: str) -> str:
    return "bert" if name.startswith("Bert") else "roberta" if name.startswith("Roberta") else "decoder"


def batches(name: str, config) -> list[list[dict[str, torch.Tensor]]]:
    return random_batches(STEPS, MICRO, MBS, SEQ, VOCAB, classes=None if "Causal" in name else 3,
                          pad_id=config.pad_token_id)


def optimizer_and_schedule(params):
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))


EXPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "BertForSequenceClassification")  # tied, untied, an encoder


def word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")),
                                   pad_token="<pad>", unk_token="<unk>")


def export(engine, name, config, groups, rank, world, directory):
    """The trained stages written as the trainer writes them (aqpipe/export.py): a shard per stage."""
    from aqpipe.settings import build
    from aqpipe.export import save_model
    from aqpipe.models import ModelSpec
    from aqpipe.world import World

    spec = ModelSpec(getattr(transformers, name), config, None, torch.bfloat16)
    save_model(engine, spec, word_tokenizer(), build("causal_lm", {"output_dir": directory}),
               World(rank, world, rank, torch.device("cpu")), groups)


def train_every_family(rank, world, checkpoints, exports):
    groups = build_groups(Grid.for_world(world, world), rank)
    out = {}
    for n, (name, directory) in enumerate(checkpoints.items()):
        cls = getattr(transformers, name)
        config = transformers.AutoConfig.from_pretrained(directory)
        stage, ties, missing = build_stage(cls, config, groups.stage, world, checkpoint=directory)
        optimizer, scheduler = optimizer_and_schedule(owned_parameters(stage, ties))
        engine = PipelineEngine(stage, groups, optimizer,
                                EngineSettings(num_samples=MBS * MICRO * STEPS, seq_len=SEQ, gradient_clipping=1.0,
                                               schedule=SCHEDULES[n % len(SCHEDULES)]),
                                ties=ties, compression=CompressionConfig(), lr_scheduler=scheduler)
        log = [engine.train_batch(mbs).record() for mbs in batches(name, config)]
        if name in EXPORTED:
            export(engine, name, config, groups, rank, world, f"{exports}/{name}")
        out[name] = {"log": log, "missing": missing, "weights": engine.hf_state_dict(),
                     "ties": sorted(ties), "params": sum(p.numel() for p in stage.parameters())}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family saved as users download it: bf16 safetensors, in several shards."""
    root, out = tmp_path_factory.mktemp("families"), {}
    for name, config in configs().items():
        torch.manual_seed(0)
        model = getattr(transformers, name)(config)
        with torch.no_grad():  # non-trivial norms and biases: every parameter matters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        model.to(torch.bfloat16).save_pretrained(root / name, max_shard_size="40KB")
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def pipelines(checkpoints, exports):
    return spawn(train_every_family, 3, checkpoints, str(exports))


@pytest.mark.parametrize("name", list(configs()))
def test_three_stages_loading_their_own_tensors_train_as_the_unpartitioned_model(checkpoints, pipelines, name):
    directory = checkpoints[name]
    model = getattr(transformers, name).from_pretrained(directory, dtype=torch.float32)
    optimizer, scheduler = optimizer_and_schedule(model.parameters())
    ref = train_reference(model, batches(name, model.config), family=dropout_parts(name), num_blocks=LAYERS,
                          optimizer=optimizer, clip=1.0, scheduler=scheduler)
    runs = [r[name] for r in pipelines]
    assert all(run["missing"] == [] for run in runs)  # every tensor came from the checkpoint
    for run in runs:
        assert [s["loss"] for s in run["log"]] == pytest.approx(ref["loss"], rel=1e-5)
        assert [s["grad_norm"] for s in run["log"]] == pytest.approx(ref["grad_norm"], rel=1e-4)
    # weights within float reordering (GPipe sums micro-batch gradients in another order; Adam scales the rounding of
    # near-zero gradients up to ~4e-5, Gemma 3's gated MLP the most); an error moves them by the lr's order, 3e-3
    weights = {k: v for run in runs for k, v in run["weights"].items()}
    for key, value in weights.items():
        torch.testing.assert_close(value, ref["weights"][key], rtol=1e-4, atol=1e-4, msg=key)
    tied = getattr(model.config, "tie_word_embeddings", False) and "Causal" in name
    assert runs[0]["ties"] == (["model.embed_tokens.weight"] if tied else [])
    # each stage holds its share, not the model
    assert sum(run["params"] for run in runs) < sum(p.numel() for p in model.parameters()) * (1.4 if tied else 1.01)


@pytest.mark.parametrize("name", EXPORTED)
def test_the_export_is_the_trained_model_in_the_checkpoints_layout_dtype_and_tie(checkpoints, pipelines, exports,
                                                                                  name):
    """Each stage wrote its shard: `from_pretrained` loads the trained weights (bf16, as the input), under the input
    checkpoint's names, a tied head tied again."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    def stored(directory):
        index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())["weight_map"]
        out = {}
        for name_, file in index.items():
            with safe_open(str(Path(directory) / file), framework="pt") as f:
                out[name_] = f.get_tensor(name_)
        return out

    exported, original = stored(exports / name / "model"), stored(checkpoints[name])
    assert set(exported) == set(original)  # the same names: a tied head stored once, as the input stored it
    # stored as the checkpoint stores them, bf16 (from_pretrained would cast float32 back on load), each tensor once
    assert set(stored_dtypes(exports / name / "model").values()) == {"BF16"}
    if name == "LlamaForCausalLM":
        assert "lm_head.weight" not in exported
    assert len(list((exports / name / "model").glob("model-0000?-of-00003.safetensors"))) == 3
    trained = {k: v for run in pipelines for k, v in run[name]["weights"].items()}
    loaded = getattr(transformers, name).from_pretrained(exports / name / "model")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    state = loaded.state_dict()
    for key, value in trained.items():  # what the engine trained (the owner's tied copy), rounded to bf16
        assert torch.equal(state[key], value.to(torch.bfloat16)), key
    if "Causal" in name:  # Llama ties its head as it came, Qwen3 keeps its own
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (name == "LlamaForCausalLM")
