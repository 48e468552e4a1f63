"""`aqpipe causal-lm` on a current model as it ships (a tied Llama in bf16 safetensors shards), and an architecture
the pipeline cannot split refused from its config alone (ranks forked as torchrun starts them: launch_aqpipe)."""
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig

from tests.helpers.files import tiny_llama_dir
from tests.helpers.processes import launch_aqpipe

QUICK = ["--seq_len", "32", "--max_train_samples", "16", "--max_eval_samples", "4", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--max_steps", "2"]


def test_a_bf16_tied_llama_fine_tunes_on_two_stages_without_bf16_flags_and_exports_as_it_came(tmp_path):
    source = tiny_llama_dir(tmp_path / "llama")
    out = tmp_path / "out"
    proc = launch_aqpipe(["causal-lm", "--model", str(source), *QUICK, "--output_dir", str(out)], 2, tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # fp32 master weights from bf16: no NaN
    assert steps[0]["tie_bytes"] > 0  # the head on stage 1 follows the embedding on stage 0
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sorted(p.name for p in (out / "model").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    tok = AutoTokenizer.from_pretrained(out / "model")
    ids = torch.tensor([tok("To be, or not to be").input_ids])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_an_architecture_it_cannot_split_stops_before_any_data_is_read(tmp_path):
    model = tmp_path / "neox"
    GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=100).save_pretrained(model)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to tokenize\n" * 200)
    cache = tmp_path / "cache"
    proc = launch_aqpipe(["causal-lm", "--model", str(model), "--dataset", str(corpus), "--output_dir",
                          str(tmp_path / "never")], 1, tmp_path / "logs", AQPIPE_CACHE=str(cache))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("aqpipe causal-lm: error: cannot partition GPTNeoXForCausalLM: supported model "
                                  "classes are BertForSequenceClassification, ")
    assert not cache.exists() and not (tmp_path / "never").exists()  # nothing tokenized, nothing written
