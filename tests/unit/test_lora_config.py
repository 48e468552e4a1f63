"""LoRA's targets resolved on the whole model (on the meta device, nothing read): PEFT's defaults per architecture,
all-linear kept to the blocks, and every target a user could get wrong refused in one line naming it."""
import pytest
import transformers

from aqpipe.pipeline.lora import LoraSettings, lora_config

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "pad_token_id": 0}


def llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, num_key_value_heads=2,
                                                                     tie_word_embeddings=True)


def test_peft_defaults_per_architecture():
    assert lora_config(*llama(), LoraSettings(8)).target_modules == {"q_proj", "v_proj"}
    gpt2 = lora_config(transformers.GPT2LMHeadModel, transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4,
                                                                              vocab_size=64), LoraSettings(8))
    assert gpt2.target_modules == {"c_attn"} and gpt2.fan_in_fan_out  # GPT2's Conv1D stores its weight transposed
    config = lora_config(*llama(), LoraSettings(4, alpha=16, dropout=0.1))
    assert (config.r, config.lora_alpha, config.lora_dropout, config.modules_to_save) == (4, 16, 0.1, None)


def test_all_linear_on_a_classifier_adapts_the_blocks_and_trains_the_head_whole():
    config = lora_config(transformers.BertForSequenceClassification, transformers.BertConfig(**SMALL, num_labels=3),
                         LoraSettings(4, target_modules=("all-linear",)), train_head=True)
    targets = set(config.target_modules)
    assert all(t.startswith("bert.encoder.layer.") for t in targets) and len(targets) == 4 * 6  # q k v 3 x dense
    assert config.modules_to_save == ["bert.pooler", "classifier"] and config.task_type == "SEQ_CLS"


@pytest.mark.parametrize("model, settings, stages, line", [
    (llama, ("q_proj", "v_prj"), 1, "lora_target_modules=q_proj,v_prj: no module of LlamaForCausalLM is named v_prj "
                                    "(its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, "
                                    "up_proj, v_proj)"),
    (llama, ("lm_head",), 1, "lora_target_modules=lm_head: lm_head only outside the blocks (lm_head); expected "
                             "modules inside the blocks, which every stage holds"),
    (llama, ("input_layernorm",), 1, "lora_target_modules=input_layernorm: Target module LlamaRMSNorm"),
    (llama, ("model.layers.0.self_attn.q_proj",), 2, "lora_target_modules=model.layers.0.self_attn.q_proj: stage 1 "
                                                     "of 2 (blocks 2-3) holds none of them"),
    (lambda: (transformers.DebertaV2ForSequenceClassification,
              transformers.DebertaV2Config(**SMALL, relative_attention=True, pos_att_type=["p2c", "c2p"])),
     ("rel_embeddings",), 1, "lora_target_modules=rel_embeddings: rel_embeddings only outside the blocks "
                             "(deberta.encoder.rel_embeddings)"),
    (lambda: (transformers.Phi3ForCausalLM, transformers.Phi3Config(**SMALL, num_key_value_heads=2)), None, 1,
     "lora_target_modules: PEFT has no default for model type 'phi3'; expected module names of its linear layers "
     "(down_proj, gate_up_proj, lm_head, o_proj, qkv_proj) or all-linear"),
])
def test_a_target_that_cannot_be_adapted_is_refused_naming_it(model, settings, stages, line):
    cls, config = model()
    with pytest.raises(ValueError) as caught:
        lora_config(cls, config, LoraSettings(4, target_modules=settings), stages=stages, partition="uniform")
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)
