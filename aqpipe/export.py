"""The fine-tuned model in HF's sharded layout, written by the stages themselves: no rank holds the whole model.

Each stage of replica 0 writes its own weights as one shard, `model-0000s-of-0000S.safetensors` (a tied weight once,
by its owner, under its first name, so `from_pretrained` ties it again), in the checkpoint's dtype; rank 0 writes
`model.safetensors.index.json`, the config, the generation config and the tokenizer. Everything goes into
`<output_dir>/model.partial`, renamed to `<output_dir>/model` once complete: a loader never sees half a model.
A stage whose rank does not share rank 0's storage (another machine, no shared filesystem) streams its tensors to
rank 0 instead, which writes its shard: the model arrives complete on rank 0's machine.

With LoRA the model is the merged one (each adapter folded into its base weight), and `<output_dir>/adapter` holds
the adapters in PEFT's layout (`adapter_config.json`, `adapter_model.safetensors`), which
`PeftModel.from_pretrained(base, adapter)` loads: they are small, so rank 0 gathers them over the process group.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aqpipe.pipeline import PipelineEngine
from aqpipe.pipeline.adapters import adapter_state_dict

from .config import RunConfig
from .models import ModelSpec
from .storage import Storage
from .stream import recv_tensors, send_tensors
from .world import World, barrier

INDEX = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names for an adapter's files


def stage_tensors(engine: PipelineEngine, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What this stage contributes, by HF name: its weights less the tied copies it follows (their owner writes
    them), a weight tied inside the model once, under its first name; floating tensors in `dtype`."""
    origin = engine.stage.hf_parameter_names()  # local -> HF name, one entry per parameter
    aliases = {name for name, _ in engine.stage.named_parameters(remove_duplicate=False)} - set(origin)
    out = {}
    for local, value in engine.hf_state_dict().items():
        if local in aliases:
            continue
        value = value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype)
        out[origin.get(local, local)] = value.contiguous()
    return out


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fresh(partial: Path) -> None:
    """An empty `partial` directory (one left by a run stopped while exporting is removed)."""
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)


def _publish(partial: Path, target: Path) -> None:
    """`partial`, complete, renamed to `target`: a loader never sees half of it."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)


def _gathered(entry: dict[str, Any], world: World) -> list[dict[str, Any]]:
    """Every rank's entry, on rank 0 (the others get an empty list)."""
    if not world.distributed:
        return [entry]
    out: list[Any] = [None] * world.size if world.rank == 0 else []
    dist.gather_object(entry, out if world.rank == 0 else None, dst=0)
    return out


def _shard(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def save_model(engine: PipelineEngine, spec: ModelSpec, tokenizer: Any, cfg: RunConfig, world: World,
               groups: Any, storage: Storage | None = None) -> str | None:
    """Write the fine-tuned model under `<output_dir>/model` on rank 0's storage; its path on rank 0, None elsewhere.

    A stage whose rank shares rank 0's storage (`storage`: storage.py; default: every rank does) writes its shard
    there itself; another streams its tensors to rank 0 (stream.py), which writes the shard."""
    out = Path(cfg.checkpointing.output_dir)
    partial, target = out / "model.partial", out / "model"
    stages = groups.grid.stages
    storage = storage or Storage(world.rank, tuple(range(world.size)))
    entry: dict[str, Any] = {"files": {}, "bytes": 0}
    if world.rank == 0:
        _fresh(partial)
    barrier(world)
    if groups.replica == 0:
        tensors = stage_tensors(engine, spec.dtype)
        shard = _shard(groups.stage, stages)
        if storage.with_rank_zero:
            _write_shard(tensors, partial / shard)
        else:
            send_tensors(tensors, 0, world.transport)
        entry = {"files": dict.fromkeys(tensors, shard), "bytes": sum(t.numel() * t.element_size()
                                                                      for t in tensors.values())}
    if world.rank == 0:  # the stages whose ranks write elsewhere, received one at a time
        for stage in range(stages):
            src = groups.grid.rank(stage, 0)  # replica 0 exports, wherever the placement put it
            if src not in storage.peers:
                tensors = recv_tensors(src, world.transport)
                _write_shard(tensors, partial / _shard(stage, stages))
                print(f"model: stage {stage}'s {sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6:.1f} "
                      f"MB received from rank {src}", file=sys.stderr, flush=True)
    barrier(world)  # every shard complete
    entries = _gathered(entry, world)
    if world.rank != 0:
        return None
    weight_map = {name: file for e in entries for name, file in sorted(e["files"].items())}
    index = {"metadata": {"total_size": sum(e["bytes"] for e in entries)}, "weight_map": weight_map}
    (partial / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = spec.config
    config.dtype = spec.dtype
    config.architectures = [spec.model_class.__name__]
    config.save_pretrained(partial)
    if spec.model_class.can_generate():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _publish(partial, target)
    return str(target)


def save_adapter(engine: PipelineEngine, config: Any, cfg: RunConfig, world: World) -> str | None:
    """Write the trained LoRA adapters (and a head trained in full) as PEFT does, under `<output_dir>/adapter`,
    `config` (PEFT's LoraConfig) naming the base model; the directory on rank 0, None elsewhere."""
    tensors = adapter_state_dict(engine.stage) if engine.groups.replica == 0 else {}
    entries = _gathered({k: v.to("cpu").contiguous() for k, v in tensors.items()}, world)
    if world.rank != 0:
        return None
    out = Path(cfg.checkpointing.output_dir)
    partial, target = out / "adapter.partial", out / "adapter"
    _fresh(partial)
    _write_shard({k: v for entry in entries for k, v in sorted(entry.items())}, partial / ADAPTER_WEIGHTS)
    saved = copy.copy(config)
    saved.base_model_name_or_path, saved.inference_mode = cfg.model, True
    saved.save_pretrained(str(partial))
    _publish(partial, target)
    return str(target)
