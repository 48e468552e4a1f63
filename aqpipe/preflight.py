"""The checks that read files or the environment, run once before any process group starts.

`config.validate` checks values against ranges; what needs a look outside the settings lives here:
the model and data paths, the model's own config (stages against blocks, seq_len against positions),
a checkpoint to resume from (its manifest against this run's settings) and a fault drill's variable.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import checkpoint, faults

if TYPE_CHECKING:
    from .config import RunConfig


def check(cfg: "RunConfig") -> None:
    """Raise ValueError naming the first setting the files disagree with; resolves `cfg.resume`."""
    if cfg.model is not None and not is_hub_name(cfg.model) and not os.path.exists(cfg.model):
        raise ValueError(f"model={cfg.model!r}: no such file or directory (expected an HF name, a model directory "
                         "or a config.json)")
    if cfg.dataset is not None and not is_hub_name(cfg.dataset) and not os.path.exists(cfg.dataset):
        raise ValueError(f"dataset={cfg.dataset!r}: no such file (expected an HF dataset name, a built-in name, "
                         "or a local text/json/csv/parquet file)")
    _check_model_shape(cfg)
    faults.from_env()  # a malformed AQPIPE_FAULT is bad input too
    _check_resume(cfg)


def is_hub_name(name: str) -> bool:
    """'gpt2', 'microsoft/deberta-v2-xxlarge': no path separators beyond one org/name slash, nothing local."""
    return not os.path.exists(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1 \
        and not name.endswith((".json", ".txt", ".csv", ".parquet", ".jsonl"))


def _check_model_shape(cfg: "RunConfig") -> None:
    """Stages against the model's blocks and seq_len against its positions, from its config alone."""
    from .models import TINY  # imports transformers: only once a run is checked

    blocks, positions, name = TINY["layers"], None, "the built-in shape"  # it grows its positions to seq_len
    if cfg.model is not None:
        from transformers import AutoConfig

        try:  # a local directory or config.json, or a hub name already in the local cache
            config = AutoConfig.from_pretrained(cfg.model, local_files_only=is_hub_name(cfg.model))
        except Exception:  # noqa: BLE001 - a hub name not cached here: the run checks once it has the model
            return
        blocks = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None)
        positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        name = repr(cfg.model)
    if blocks is not None and cfg.pipeline_stages > blocks:
        raise ValueError(f"pipeline_stages={cfg.pipeline_stages}: model {name} has {blocks} blocks; expected at most "
                         f"{blocks} stages (each stage holds at least one block)")
    if blocks is not None and isinstance(cfg.partition, list) and sum(cfg.partition) != blocks:
        raise ValueError(f"partition={cfg.partition}: sums to {sum(cfg.partition)}; expected the {blocks} blocks of "
                         f"model {name}")
    if positions is not None and cfg.seq_len > positions:
        raise ValueError(f"seq_len={cfg.seq_len}: model {name} has {positions} positions; expected seq_len <= "
                         f"{positions}")


def _check_resume(cfg: "RunConfig") -> None:
    """Resolve --resume to a checkpoint directory whose settings match this run's (None: auto, nothing saved)."""
    if cfg.resume is None:
        return
    found = checkpoint.find(cfg.resume, cfg.output_dir)
    if found is not None:
        checkpoint.check_compatible(found, cfg)
    cfg.resume = None if found is None else str(found)
