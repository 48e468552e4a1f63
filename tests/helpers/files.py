"""Files a user brings: a table in each supported format, a tiny model config."""
from __future__ import annotations

import csv
import json
from pathlib import Path


def write_table(path: Path, rows: list[dict]) -> Path:
    """`rows` as the file a user brings, by its suffix: csv, json (one list), jsonl or parquet."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def tiny_gpt2_config(tmp_path: Path) -> str:
    """A 2-block, width-64 GPT2 config.json without dropout (runs compare losses exactly), for --model."""
    from transformers import GPT2Config  # here: spawned workers import this module and need no transformers

    path = tmp_path / "gpt2-tiny" / "config.json"
    path.parent.mkdir(parents=True)
    GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0).to_json_file(path)
    return str(path)


def tiny_llama_dir(path: Path, blocks: int = 2) -> Path:
    """A tiny tied Llama as one is downloaded: bf16 safetensors in several shards, with the built-in tokenizer
    (width 64, `blocks` blocks, grouped-query attention), seeded random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe import data

    tokenizer = data.load_tokenizer(None)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=blocks,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB")
    tokenizer.save_pretrained(path)
    return path


def stored_dtypes(directory: Path) -> dict[str, str]:
    """Each tensor of a sharded safetensors model by name, with the dtype its file stores ("BF16", "F32"), read from
    the files' headers (`from_pretrained` casts on load, so loading cannot tell); checks that the index names every
    stored tensor once and that no tensor is stored twice."""
    from safetensors import safe_open

    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    stored: dict[str, str] = {}
    for file in sorted(p.name for p in directory.glob("*.safetensors")):
        with safe_open(str(directory / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                assert name not in stored, f"{name} stored twice"
                assert weight_map.get(name) == file, f"{name} is in {file}, the index says {weight_map.get(name)}"
                stored[name] = f.get_slice(name).get_dtype()
    assert set(stored) == set(weight_map), set(stored) ^ set(weight_map)
    return stored
