"""`--model` in its three forms, resolved to what every rank builds its own stage from: the HF class, its config, and
where its weights are. An HF hub name or local model directory brings pretrained weights (read per stage); a path to
a config.json means a seeded random init of that shape; None a tiny built-in shape that trains in minutes on 2 CPU
cores. The class follows the task (causal LM or sequence classification) and the config's family; embeddings are
sized to the tokenizer."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (BertConfig, DebertaV2Config, GPT2Config, LlamaConfig, PretrainedConfig, PreTrainedModel)

from aqpipe.pipeline.loading import BIN, BIN_INDEX, INDEX, SINGLE, CheckpointReader, build_stage, has_weights
from aqpipe.pipeline.stages import family_for

TINY = {"width": 128, "layers": 4, "heads": 4}


def _tiny_config(shape: str, vocab: int, seq_len: int, num_labels: int | None, pad_id: int | None,
                 **labels: Any) -> PretrainedConfig:
    """A tiny model of `shape`: GPT2 and Llama tie their head to the embeddings (as GPT2 and Llama 3.2 ship)."""
    positions, width, layers, heads = max(seq_len, 128), TINY["width"], TINY["layers"], TINY["heads"]
    common = {"num_labels": num_labels or 2, **labels}
    if shape == "gpt2":
        return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                          pad_token_id=pad_id, bos_token_id=pad_id, eos_token_id=pad_id, **common)
    if shape == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=positions,
                           tie_word_embeddings=True, pad_token_id=pad_id, bos_token_id=pad_id, eos_token_id=pad_id,
                           **common)
    if shape == "bert":
        return BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                          intermediate_size=4 * width, max_position_embeddings=positions, pad_token_id=pad_id or 0,
                          **common)
    return DebertaV2Config(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=4 * width, max_position_embeddings=positions, relative_attention=True,
                           position_buckets=32, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                           share_att_key=True, pad_token_id=pad_id or 0, type_vocab_size=0, **common)


def _is_config_file(model: str | None) -> bool:
    return model is not None and os.path.isfile(model) and model.endswith(".json")


def read_config(model: str | None) -> PretrainedConfig | None:
    """The model's config without its weights (None for the built-in shape, sized later)."""
    if model is None:
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


def planned_model(model: str | None, shape: str, kind: str, seq_len: int, vocab: int = 4096) -> tuple[type, Any]:
    """The class and config a plan made before the run prices (`aqpipe plan`): `model`'s own, or the built-in shape
    at `vocab` tokens (its tokenizer is trained on the corpus at the run's start)."""
    config = read_config(model) if model is not None else _tiny_config(shape, vocab, seq_len, None, 0)
    return model_class(kind, config), config


def model_positions(model: str | None) -> int | None:
    """How many positions the model embeds (None: the built-in shape grows to fit, or rotary: no table)."""
    config = read_config(model)
    if config is None:
        return None
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def model_class(kind: str, config: PretrainedConfig) -> type:
    """The HF class the task gives this config (transformers' own auto mapping), checked against the families the
    pipeline splits: ValueError naming the class and the supported ones, from the config alone."""
    from transformers.models.auto import modeling_auto as auto

    mapping = auto.MODEL_FOR_CAUSAL_LM_MAPPING if kind == "causal_lm" else \
        auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    head = "causal LM" if kind == "causal_lm" else "sequence classification"
    try:
        cls = mapping[type(config)]
    except KeyError:
        name = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise ValueError(f"cannot partition {name}: transformers has no {head} model for model_type "
                         f"{config.model_type!r}") from None
    family_for(cls.__name__, config)
    return cls


def _dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype the checkpoint's tensors are stored in (float32 when the config does not say)."""
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


@dataclass(frozen=True)
class ModelSpec:
    """What every rank builds its stage from: the class, its config (sized to the tokenizer, labels and dropout set),
    where its weights come from (None: a seeded random init), and the dtype its checkpoint stores (the export's)."""

    model_class: type
    config: PretrainedConfig
    weights: Callable[[], CheckpointReader] | None
    dtype: torch.dtype

    def build_stage(self, stage_index: int, num_stages: int, **options: Any) -> tuple[Any, dict, list[str]]:
        """This rank's stage alone (pipeline.loading.build_stage): its tensors read, or initialized from the seed."""
        reader = self.weights() if self.weights is not None else None
        return build_stage(self.model_class, self.config, stage_index, num_stages, reader=reader, **options)

    def full_model(self, seed: int) -> PreTrainedModel:
        """The whole HF model, float32, with the values the stages start from (one stage holding everything): a
        reference, or a baseline engine's start (benchmarks/deepspeed_pipeline.py)."""
        stage, _, _ = self.build_stage(0, 1, seed=seed)
        model = self.model_class._from_config(self.config, dtype=torch.float32)
        model.load_state_dict(stage.hf_state_dict())
        return model


def _hub_reader(repo: str) -> Callable[[], CheckpointReader]:
    """A reader over a hub model's snapshot that downloads a shard only when a tensor of it is read: each rank
    fetches the shards its stage needs (and the index), not the model. Every file comes from the commit the first
    one resolved to, so ranks starting while the repository changes never mix two versions."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def reader() -> CheckpointReader:
        for first in (INDEX, SINGLE, BIN_INDEX, BIN):
            try:
                path = Path(hf_hub_download(repo, first))
            except LocalEntryNotFoundError as exc:  # the hub out of reach and the file not cached: say so
                raise FileNotFoundError(f"model={repo!r}: {first} is not in the local HuggingFace cache and the hub "
                                        f"cannot give it ({str(exc).splitlines()[0][:200]})") from None
            except EntryNotFoundError:
                continue
            commit = path.parent.name  # the snapshot directory is named by the commit it holds
            return CheckpointReader(path.parent, fetch=lambda file: Path(hf_hub_download(repo, file,
                                                                                           revision=commit)))
        raise FileNotFoundError(f"model={repo!r}: the hub repository has no weights ({INDEX}, {SINGLE}, "
                                f"{BIN_INDEX} or {BIN})")

    return reader


def set_dropout(module: torch.nn.Module | None, config: PretrainedConfig | None, p: float) -> None:
    """Every dropout at probability p: in `module`'s modules and in `config` (which the exported model keeps)."""
    for m in module.modules() if module is not None else ():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
    for key, value in (config.to_dict() if config is not None else {}).items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, p)


def label_maps(label_names: list[str] | None) -> dict[str, dict]:
    """A config's `id2label` / `label2id` for the data's label names (nothing for None)."""
    if not label_names:
        return {}
    return {"id2label": dict(enumerate(label_names)), "label2id": {name: i for i, name in enumerate(label_names)}}


def resolve_model(model: str | None, shape: str, kind: str, tokenizer: Any, seq_len: int, num_labels: int | None,
                  label_names: list[str] | None = None, dropout: float | None = None,
                  frozen: bool = False) -> ModelSpec:
    """The spec of `--model` for this task and tokenizer (identical on every rank).

    A classifier's config maps label ids to `label_names` (the data's, e.g. a CSV's string labels) where given;
    `dropout` sets every dropout probability (None: the model's own). A vocabulary smaller than the tokenizer's grows
    (the new rows start at the mean of the stored ones); a larger one (padded for speed, as Qwen's) is kept. A
    `frozen` model (LoRA's base) cannot grow: its new rows would never train."""
    labels = label_maps(label_names) if kind == "classification" else {}
    extra = {"num_labels": num_labels, **labels} if kind == "classification" and num_labels else labels
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    weights = None
    if model is None:
        config = _tiny_config(shape, len(tokenizer), seq_len, num_labels, pad_id, **labels)
    else:
        config = read_config(model)
        for key, value in extra.items():
            setattr(config, key, value)
        if not _is_config_file(model):
            local = Path(model).expanduser()
            if local.is_dir() and not has_weights(local):
                raise FileNotFoundError(f"model={model!r}: no weights in the directory (expected {INDEX} with its "
                                        f"shards, {SINGLE}, or pytorch_model.bin)")
            weights = (lambda: CheckpointReader(local)) if local.is_dir() else _hub_reader(model)
    vocab = len(tokenizer)
    if frozen and weights is not None and config.vocab_size < vocab:
        raise ValueError(f"lora_rank with a tokenizer of {vocab} tokens over model={model!r}'s {config.vocab_size}: "
                         "expected the model's own tokenizer (LoRA keeps the embeddings frozen, so rows for new "
                         "tokens would never train)")
    if config.vocab_size != vocab and (weights is None or config.vocab_size < vocab):
        config.vocab_size = vocab
        # a config written for another vocabulary (GPT2's 50256) names special tokens this tokenizer has elsewhere
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= vocab:
                setattr(config, name, getattr(tokenizer, name))
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_id
    if dropout is not None:
        set_dropout(None, config, float(dropout))
    return ModelSpec(model_class(kind, config), config, weights, _dtype(config) if weights is not None else
                     torch.float32)
