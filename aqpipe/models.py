"""`--model` in its three forms: an HF hub name or local model directory (pretrained weights),
a path to a config.json (seeded random init of that shape), or None (a tiny built-in shape
that trains in minutes on 2 CPU cores). Embeddings are sized to the tokenizer."""
from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, DebertaV2Config,
                          GPT2Config, PretrainedConfig, PreTrainedModel)

TINY = {"width": 128, "layers": 4, "heads": 4}


def _tiny_config(family: str, vocab: int, seq_len: int, num_labels: int | None, pad_id: int | None,
                 **labels: Any) -> PretrainedConfig:
    positions = max(seq_len, 128)
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=TINY["width"], n_layer=TINY["layers"],
                          n_head=TINY["heads"], num_labels=num_labels or 2, pad_token_id=pad_id,
                          bos_token_id=pad_id, eos_token_id=pad_id, **labels)
    return DebertaV2Config(vocab_size=vocab, hidden_size=TINY["width"], num_hidden_layers=TINY["layers"],
                           num_attention_heads=TINY["heads"], intermediate_size=4 * TINY["width"],
                           max_position_embeddings=positions, relative_attention=True, position_buckets=32,
                           pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
                           num_labels=num_labels or 2, pad_token_id=pad_id or 0, type_vocab_size=0, **labels)


def _is_config_file(model: str | None) -> bool:
    return model is not None and os.path.isfile(model) and model.endswith(".json")


def load_config(model: str | None, family: str) -> PretrainedConfig | None:
    """The model's config without its weights (None for the built-in shape, sized later)."""
    if model is None:
        return None
    return AutoConfig.from_pretrained(model)


def model_positions(model: str | None, family: str) -> int | None:
    """How many positions the model embeds (None: the built-in shape grows to fit)."""
    config = load_config(model, family)
    if config is None:
        return None
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def label_maps(label_names: list[str] | None) -> dict[str, dict]:
    """A config's `id2label` / `label2id` for the data's label names (nothing for None)."""
    if not label_names:
        return {}
    return {"id2label": dict(enumerate(label_names)), "label2id": {name: i for i, name in enumerate(label_names)}}


def set_dropout(net: PreTrainedModel, p: float) -> None:
    """Every dropout of `net` at probability p, in its modules and in its config (which the exported model keeps)."""
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
    for key, value in net.config.to_dict().items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(net.config, key, p)


def build_model(model: str | None, family: str, kind: str, tokenizer: Any, seq_len: int,
                num_labels: int | None, seed: int, label_names: list[str] | None = None,
                dropout: float | None = None) -> PreTrainedModel:
    """The full HF model every rank partitions; identical on every rank (same seed or same weights).
    A classifier's config maps label ids to `label_names` (the data's, e.g. a CSV's string labels) where given;
    `dropout` sets every dropout probability (None: the model's own)."""
    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
    labels = label_maps(label_names) if kind == "classification" else {}
    extra = {"num_labels": num_labels, **labels} if kind == "classification" and num_labels else labels
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    if model is None:
        config = _tiny_config(family, len(tokenizer), seq_len, num_labels, pad_id, **labels)
        net = auto.from_config(config, attn_implementation="sdpa" if family == "gpt2" else None)
    elif _is_config_file(model):
        config = AutoConfig.from_pretrained(model, **extra)
        net = auto.from_config(config)
    else:
        net = auto.from_pretrained(model, **extra)
    if net.get_input_embeddings().num_embeddings != len(tokenizer):
        net.resize_token_embeddings(len(tokenizer))
        # a config written for another vocabulary (GPT2's 50256) names special tokens this tokenizer has elsewhere
        for name in ("bos_token_id", "eos_token_id"):
            for config in (net.config, getattr(net, "generation_config", None)):
                value = getattr(config, name, None)
                if isinstance(value, int) and value >= len(tokenizer):
                    setattr(config, name, getattr(tokenizer, name))
    if getattr(net.config, "pad_token_id", None) is None:
        net.config.pad_token_id = pad_id
    if dropout is not None:
        set_dropout(net, float(dropout))
    return net
