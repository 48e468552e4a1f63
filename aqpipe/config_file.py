"""The config file: DeepSpeed's JSON keys plus a block per section of aqpipe's settings (`data`, `optimization`,
`checkpointing`, `distributed`, `compression`, `data_parallel`, `lora`) and a `run` block for the run's own, read into
settings and written back from a RunConfig (`--print_config`), so a printed file runs the same job.

Where a setting lives in DeepSpeed's file is its field's `ds` metadata (config.py): a top-level key, or
`pipeline.<key>`, copied as it is; the others with a `ds` place (lr inside the optimizer, bf16's "enabled",
activation checkpointing as an interval) are translated below; every other setting goes in its section's block, or
the "run" block. Files printed before the sections had blocks, with those settings flat in the run block, read the
same: settings.nest moves them into their sections as it layers the file."""
from __future__ import annotations

import json
import os
from typing import Any

from .config import SECTIONS, RunConfig, destinations
from .flags import value_at

# a DeepSpeed-placed setting's name -> its destination ("lr" -> "optimization.lr")
_DESTS = {dest.rpartition(".")[2]: dest for dest, f in destinations() if "ds" in f.metadata}
_PLACES = {dest.rpartition(".")[2]: f.metadata["ds"] for dest, f in destinations() if "ds" in f.metadata}
_SIMPLE = {place: name for name, place in _PLACES.items()
           if "." not in place and place not in ("optimizer", "scheduler")}  # copied as they are
_PIPELINE = {place.split(".", 1)[1]: name for name, place in _PLACES.items()
             if place.startswith("pipeline.") and name != "activation_checkpointing"}


def read(path: str) -> dict[str, Any]:
    """Translate a DeepSpeed-style JSON file into settings (sections as nested dicts)."""
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path}: no such file")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({exc})") from None
    out: dict[str, Any] = {ours: raw[theirs] for theirs, ours in _SIMPLE.items() if theirs in raw}
    if "bf16" in raw:
        out["bf16"] = bool(raw["bf16"].get("enabled", False)) if isinstance(raw["bf16"], dict) else bool(raw["bf16"])
    fp16 = raw.get("fp16", {})
    if fp16.get("enabled", False) if isinstance(fp16, dict) else bool(fp16):
        raise ValueError(f"--deepspeed_config {path}: fp16 enabled; expected bf16 (float16 compute needs a loss "
                         "scaler, which aqpipe does not have: bf16 keeps float32's range, and weights train in "
                         "float32 whatever the checkpoint's dtype)")
    if "optimizer" in raw:  # its lr is the run's `lr`, kept in one place
        params = dict(raw["optimizer"].get("params", {}))
        if "lr" in params:
            out["lr"] = params.pop("lr")
        out["optimizer"] = {**raw["optimizer"], "params": params}
    if "scheduler" in raw:
        out["scheduler"] = raw["scheduler"]
    pipe = raw.get("pipeline", {})
    out.update({ours: pipe[theirs] for theirs, ours in _PIPELINE.items() if theirs in pipe})
    if "activation_checkpoint_interval" in pipe:
        out["activation_checkpointing"] = bool(pipe["activation_checkpoint_interval"])
    out.update({section: dict(raw[section]) for section in SECTIONS if section in raw})
    out.update(raw.get("run", {}))
    if "train_batch_size" in raw:
        out["_train_batch_size"] = raw["train_batch_size"]
    return out


def write(cfg: RunConfig) -> dict[str, Any]:
    """The file that `read` turns back into `cfg`'s settings."""
    nested = cfg.to_dict()
    values = {name: value_at(cfg, dest) for name, dest in _DESTS.items()}  # the DeepSpeed-placed settings by name
    optimizer = {**values["optimizer"], "params": {"lr": values["lr"], **values["optimizer"].get("params", {})}}
    out: dict[str, Any] = {theirs: values[ours] for theirs, ours in _SIMPLE.items()}
    out.update(optimizer=optimizer, bf16={"enabled": values["bf16"]})
    out["scheduler"] = values["scheduler"]  # null: a constant rate (a file without the key takes the default's)
    out["pipeline"] = {theirs: values[ours] for theirs, ours in _PIPELINE.items()}
    out["pipeline"]["activation_checkpoint_interval"] = int(values["activation_checkpointing"])
    out.update({section: {k: v for k, v in nested[section].items() if k not in _PLACES} for section in SECTIONS})
    out["run"] = {k: v for k, v in nested.items() if k not in ("task", *SECTIONS, *_PLACES)}
    return out
