"""`aqpipe causal-lm --lora_rank` on a tied Llama as it ships (bf16 safetensors shards), on 2 stages under torchrun's
environment (its ranks forked: launch_aqpipe) with AQ-SGD on: the adapter PEFT loads, the merged model equal to base +
adapter, the base left as it came; and a classifier whose new head trains beside the adapters, through
`aqpipe.finetune`."""
import hashlib
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig,
                          BertForSequenceClassification, LlamaConfig, LlamaForCausalLM)

import aqpipe
from aqpipe import data
from tests.helpers.files import stored_dtypes, tiny_llama_dir
from tests.helpers.processes import launch_aqpipe

QUICK = ["--seq_len", "32", "--max_train_samples", "16", "--max_eval_samples", "4", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--max_steps", "3", "--lr", "1e-2"]


def digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_bf16_tied_llama_trains_adapters_on_two_stages_and_exports_adapter_and_merged_model(tmp_path):
    source = tiny_llama_dir(tmp_path / "llama")
    before = digests(source)
    out = tmp_path / "out"
    proc = launch_aqpipe(["causal-lm", "--model", str(source), "--lora_rank", "4", "--lora_alpha", "16", *QUICK,
                          "--output_dir", str(out)], 2, tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert digests(source) == before  # the base is read, never written
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    assert len(steps) == 3 and all(s["tie_bytes"] == 0 and s["fwd_bytes"] > 0 for s in steps)  # the tie is frozen

    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]  # PEFT's default for Llama
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 16)
    assert adapter_config["base_model_name_or_path"] == str(source)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), out / "adapter")
    assert any(float(v.abs().max()) > 0 for k, v in load_file(out / "adapter" / "adapter_model.safetensors").items()
               if "lora_B" in k)  # trained: B starts at zero

    assert set(stored_dtypes(out / "model").values()) == {"BF16"}  # the checkpoint's dtype on disk, each tensor once
    assert "lm_head.weight" not in stored_dtypes(out / "model")  # the tied head stored once, as the embedding
    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    assert merged.dtype == torch.bfloat16 and merged.lm_head.weight is merged.model.embed_tokens.weight
    base = AutoModelForCausalLM.from_pretrained(source).state_dict()
    folded = {name.removeprefix("base_model.model.").replace(".base_layer", ""): layer
              for name, layer in tuned.named_modules() if hasattr(layer, "get_delta_weight")}
    for name, value in merged.state_dict().items():
        module = name.rpartition(".")[0]
        expected = base[name] if module not in folded else \
            (base[name].float() + folded[module].get_delta_weight("default").float()).to(torch.bfloat16)
        assert torch.equal(value, expected), name  # W + B A alpha / r, rounded once to the checkpoint's dtype
    assert len(folded) == 2 * merged.config.num_hidden_layers
    ids = torch.tensor([data.load_tokenizer(None)("To be, or not to be").input_ids])
    torch.testing.assert_close(merged.float()(ids).logits, tuned.float()(ids).logits, atol=0.05, rtol=0.05)


def test_a_classifier_trains_its_new_head_beside_all_linear_adapters_through_the_api(tmp_path):
    """all-linear adapts the blocks' linear layers; the pooler and classifier train whole (PEFT's modules_to_save),
    so base + adapter is the merged model."""
    tokenizer = data.load_tokenizer(None, cls_sep=True)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, num_labels=2,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    source = tmp_path / "bert"
    BertForSequenceClassification(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    summary = aqpipe.finetune("classify", model=str(source), lora_rank=2, lora_target_modules="all-linear",
                              seq_len=32, max_train_samples=16, max_eval_samples=8, micro_batch_size=4,
                              num_micro_batches=2, max_steps=2,
                              output_dir=str(tmp_path / "out"))
    assert summary["steps"] == 2
    adapter = tmp_path / "out" / "adapter"
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "SEQ_CLS" and adapter_config["modules_to_save"] == ["bert.pooler",
                                                                                             "classifier"]
    weights = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.classifier.weight" in weights  # the head, whole
    base = AutoModelForSequenceClassification.from_pretrained(source)
    tuned = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(source), adapter)
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "model")
    assert not torch.equal(merged.classifier.weight, base.classifier.weight)
    ids = tokenizer(["a sentence to classify"], return_tensors="pt")
    tuned.eval(), merged.eval()
    torch.testing.assert_close(merged(**ids).logits, tuned(**ids).logits, rtol=1e-5, atol=1e-5)


def test_a_bad_lora_setting_stops_the_api_in_one_line_before_anything_is_written(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config.save_pretrained(tmp_path / "llama")
    for flags, line in (({"lora_alpha": 16}, "lora_alpha=16 without --lora_rank: expected a LoRA rank >= 1"),
                        ({"lora_rank": 4, "lora_target_modules": "lm_head"}, "lora_target_modules=lm_head: lm_head "
                                                                             "only outside the blocks")):
        with pytest.raises(ValueError) as caught:
            aqpipe.finetune("causal-lm", model=str(tmp_path / "llama"), output_dir=str(tmp_path / "out"), **flags)
        assert str(caught.value).startswith(line) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")  # 64 tokens; the built-in tokenizer has 4096
    with pytest.raises(ValueError, match=r"^lora_rank with a tokenizer of 4096 tokens over model=.*'s 64: expected "
                                         r"the model's own tokenizer"):
        aqpipe.finetune("causal-lm", model=str(tmp_path / "llama"), output_dir=str(tmp_path / "out"), lora_rank=4)
