"""A stage built alone (aqpipe/pipeline/loading.py): it reads its own tensors and no other's, a config alone gives the
same values on any stage count, and what cannot load is said in one line."""
import json
import sys
import warnings

import pytest
import torch
from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from aqpipe.models import model_class
from aqpipe.pipeline.loading import CheckpointReader, build_stage

SMALL = dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """A Llama with its head tied (as Llama 3.2 ships): bf16, sharded; the checkpoint stores the tie once."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    path = tmp_path_factory.mktemp("llama")
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="30KB")
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_each_rank_reads_its_own_tensors_only(tied_llama):
    path, weights = tied_llama
    stored = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    assert "lm_head.weight" not in stored and len(list(path.glob("*.safetensors"))) > 3
    reads, sizes = [], []
    for s in range(3):
        reader = CheckpointReader(path)
        stage, ties, missing = build_stage(LlamaForCausalLM, LlamaConfig(**SMALL, tie_word_embeddings=True), s, 3,
                                           reader=reader)
        assert missing == []
        reads.append(reader.read)
        sizes.append(reader.bytes_read)
        for name, value in stage.hf_state_dict().items():  # cast to fp32 master weights, as stored
            source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            assert value.dtype == torch.float32 and torch.equal(value, weights[source].float()), name
    blocks = [{n.split(".")[2] for n in r if n.startswith("model.layers.")} for r in reads]
    assert blocks == [{"0", "1"}, {"2", "3"}, {"4", "5"}]  # each stage its blocks' tensors, read once
    assert all(len(r) == len(set(r)) for r in reads)
    assert "model.embed_tokens.weight" in reads[0] and "model.embed_tokens.weight" in reads[2]  # the tied head
    assert "model.norm.weight" in reads[2] and "model.norm.weight" not in reads[0] + reads[1]
    assert set().union(*reads) == stored
    total = sum(v.numel() * 2 for v in weights.values()) - weights["lm_head.weight"].numel() * 2
    assert sum(sizes) == total + weights["model.embed_tokens.weight"].numel() * 2  # the tie read twice, by its holders


def test_a_stage_without_a_4_bit_base_never_imports_bitsandbytes(tied_llama, monkeypatch):
    """Importing it costs every process of every run 1.7 s (it loads torch's compiler) and prints a line."""
    for name in [m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)  # as in a fresh process (restored after the test)
    build_stage(LlamaForCausalLM, LlamaConfig(**SMALL, tie_word_embeddings=True), 2, 3, checkpoint=tied_llama[0])
    build_stage(LlamaForCausalLM, LlamaConfig(**SMALL, tie_word_embeddings=True), 0, 3)  # from its config alone
    assert "bitsandbytes" not in sys.modules


def test_a_config_alone_gives_the_same_weights_on_any_stage_count():
    config = LlamaConfig(**SMALL, tie_word_embeddings=True)
    whole, _, _ = build_stage(LlamaForCausalLM, config, 0, 1, seed=7)
    parts = [build_stage(LlamaForCausalLM, config, s, 3, seed=7)[0] for s in range(3)]
    one = whole.hf_state_dict()
    for part in parts:
        for name, value in part.hf_state_dict().items():
            assert torch.equal(value, one[name]), name
    assert torch.equal(parts[2].lm_head.weight, parts[0].model.embed_tokens.weight)  # the tie: the embedding's init
    assert torch.count_nonzero(one["model.embed_tokens.weight"][0]) == 0  # its padding row, as HF initializes it
    assert whole.model.rotary_emb.inv_freq[0] == 1.0  # buffers computed, not left uninitialized
    other, _, _ = build_stage(LlamaForCausalLM, config, 0, 1, seed=8)
    assert not torch.equal(other.model.layers["0"].mlp.up_proj.weight, whole.model.layers["0"].mlp.up_proj.weight)


def test_a_vocabulary_grown_past_the_checkpoint_keeps_its_rows_and_starts_new_ones_at_their_mean(tied_llama):
    path, weights = tied_llama
    config = LlamaConfig(**{**SMALL, "vocab_size": 84}, tie_word_embeddings=True)
    stage, _, _ = build_stage(LlamaForCausalLM, config, 0, 1, checkpoint=path)
    rows, stored = stage.model.embed_tokens.weight, weights["model.embed_tokens.weight"].float()
    assert torch.equal(rows[:80], stored)
    assert torch.allclose(rows[80:], stored.mean(0, keepdim=True).expand(4, -1))


def test_what_cannot_load_is_one_line_naming_it(tied_llama, tmp_path):
    path, _ = tied_llama
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
                                         r"\(64, 32\); the model expects \(96, 32\)"):
        build_stage(LlamaForCausalLM, LlamaConfig(**{**SMALL, "intermediate_size": 96}), 0, 1, checkpoint=path)
    with pytest.raises(FileNotFoundError, match="no model weights"):
        CheckpointReader(tmp_path)
    # a classifier from a causal LM's checkpoint: the new head is initialized, and said
    _, _, missing = build_stage(LlamaForSequenceClassification, LlamaConfig(**SMALL, num_labels=3), 0, 1,
                                checkpoint=path)
    assert missing == ["score.weight"]


def test_a_bin_checkpoint_loads_with_a_warning(tmp_path):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # as older checkpoints ship
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stage, _, missing = build_stage(LlamaForCausalLM, model.config, 1, 2, checkpoint=tmp_path)
    assert missing == [] and any("read whole" in str(w.message) for w in caught)
    assert torch.equal(stage.lm_head.weight, model.lm_head.weight)


def test_an_architecture_the_pipeline_cannot_split_is_refused_from_its_config():
    with pytest.raises(ValueError, match=r"^cannot partition GPTNeoXForCausalLM: supported model classes are "
                                         r"BertForSequenceClassification, .*LlamaForCausalLM, .*Qwen3ForCausalLM"):
        model_class("causal_lm", GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    assert model_class("classification", GPT2Config()).__name__ == "GPT2ForSequenceClassification"
    assert model_class("causal_lm", LlamaConfig(**SMALL)) is LlamaForCausalLM


def test_a_base_models_checkpoint_loads_by_transformers_own_key_renamings(tmp_path):
    """GPT2 as the hub has it: saved from GPT2Model, keys without the head model's `transformer.` prefix; and a
    legacy BERT checkpoint's LayerNorm gamma/beta."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertForSequenceClassification, GPT2LMHeadModel, GPT2Model

    torch.manual_seed(2)
    base = GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(tmp_path / "model.safetensors"))
    stage, _, missing = build_stage(GPT2LMHeadModel, base.config, 0, 1, checkpoint=tmp_path)
    assert missing == [] and torch.equal(stage.transformer.wte.weight, base.wte.weight)
    assert torch.equal(stage.lm_head.weight, base.wte.weight)  # the head, tied, from the embedding
    bert = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, vocab_size=64))
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in bert.state_dict().items() if not k.startswith("classifier")}
    (tmp_path / "bert").mkdir()
    save_file({k: v.contiguous() for k, v in legacy.items()}, str(tmp_path / "bert" / "model.safetensors"))
    stage, _, missing = build_stage(BertForSequenceClassification, bert.config, 0, 2, checkpoint=tmp_path / "bert")
    assert missing == [] and torch.equal(stage.bert.embeddings.LayerNorm.weight, bert.bert.embeddings.LayerNorm.weight)
    _, _, missing = build_stage(BertForSequenceClassification, bert.config, 1, 2, checkpoint=tmp_path / "bert")
    assert missing == ["classifier.weight", "classifier.bias"]  # a new head: initialized


def test_a_checkpoint_lacking_weights_outside_the_head_is_refused(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    kept = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}
    save_file(kept, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"9 of stage 0's weights outside its head are not in it \(first: "
                                         r"'model.layers.1.self_attn.q_proj.weight'\)"):
        build_stage(LlamaForCausalLM, model.config, 0, 2, checkpoint=tmp_path)


def test_a_tie_stored_under_the_heads_name_gives_the_embedding_too(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    state = {k: v for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    stage, _, missing = build_stage(LlamaForCausalLM, model.config, 0, 2, checkpoint=tmp_path)
    assert missing == [] and torch.equal(stage.model.embed_tokens.weight, model.lm_head.weight)


def test_float32_stages_of_a_bf16_checkpoint_compute_as_transformers_float32_model():
    """Gemma 3 scales its embeddings by a buffer: built in float32, not in the checkpoint's bf16 (34.0 for 33.94 at
    width 1152); Mistral ignores `layer_types` (a sliding window everywhere), as transformers does."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    ids = torch.randint(2, 80, (2, 12), generator=torch.Generator().manual_seed(0))
    for cls, config in ((Gemma3ForCausalLM, Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=4, dtype="bfloat16")),
                        (MistralForCausalLM, MistralConfig(**SMALL, sliding_window=4,
                                                           layer_types=["full_attention"] * 6))):
        torch.manual_seed(0)
        stage, _, _ = build_stage(cls, config, 0, 1, seed=1)
        reference = cls._from_config(config, dtype=torch.float32)
        reference.load_state_dict(stage.hf_state_dict())
        stage.eval(), reference.eval()
        with torch.no_grad():
            assert torch.equal(stage(None, {"input_ids": ids}).logits, reference(input_ids=ids).logits), cls.__name__
