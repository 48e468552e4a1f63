"""The checks that read files or the environment, run once before any process group starts.

The sections (config.py) check values against ranges as they are made; what needs a look outside the settings
lives here: the model and data paths, the model's own config (stages against blocks, seq_len against positions),
a checkpoint to resume from (its manifest against this run's settings) and a fault drill's variable.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from . import checkpoint, faults, reporters
from .environment import configure_kernels, link_latency_s, link_mbit
from .placement import place_here

if TYPE_CHECKING:
    from .config import RunConfig


def check(cfg: "RunConfig") -> "RunConfig":
    """Raise ValueError naming the first setting the files disagree with; the config with `resume` resolved."""
    if cfg.model is not None and not is_hub_name(cfg.model) and not os.path.exists(cfg.model):
        raise ValueError(f"model={cfg.model!r}: no such file or directory (expected an HF name, a model directory "
                         "or a config.json)")
    if cfg.data.dataset is not None and not is_hub_name(cfg.data.dataset) and not os.path.exists(cfg.data.dataset):
        raise ValueError(f"dataset={cfg.data.dataset!r}: no such file (expected an HF dataset name, a built-in name, "
                         "or a local text/json/csv/parquet file)")
    reporters.check(cfg.report_to)
    _check_hub(cfg)
    _check_model_shape(cfg)
    faults.from_env()  # a malformed AQPIPE_FAULT is bad input too
    configure_kernels()  # and AQPIPE_KERNELS, set for the run here, once
    link_latency_s()
    link_mbit()
    _check_gpus(cfg.distributed.backend)
    cfg = _resumed(cfg)
    _check_output_dir(cfg)
    return cfg


def _check_gpus(backend: str) -> None:
    """The backend can run on this machine's GPUs (NCCL: one per process), said in one line, not as a CUDA error
    on some ranks while the others wait."""
    place_here(backend)


# what a run writes into its output_dir
RESULTS = ("summary.json", "metrics.jsonl", "model", "adapter", "checkpoints", "tensorboard")


def previous_results(output_dir: str) -> list[str]:
    """The entries of `output_dir` that another run wrote (nothing else there is ours to judge or remove)."""
    return [name for name in RESULTS if os.path.exists(os.path.join(output_dir, name))]


def _check_output_dir(cfg: "RunConfig") -> None:
    """Refuse to write over another run's results unless told to replace them or to continue that run."""
    found = previous_results(cfg.checkpointing.output_dir)
    if found and cfg.checkpointing.resume is None and not cfg.checkpointing.overwrite_output_dir:
        raise ValueError(f"output_dir={cfg.checkpointing.output_dir!r} holds another run's results "
                         f"({', '.join(found)}): expected "
                         "--overwrite_output_dir to replace them, --resume to continue that run, or another "
                         "--output_dir")


def is_hub_name(name: str) -> bool:
    """'gpt2', 'microsoft/deberta-v2-xxlarge': no path separators beyond one org/name slash, nothing local."""
    return not os.path.exists(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1 \
        and not name.endswith((".json", ".txt", ".csv", ".parquet", ".jsonl"))


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the HuggingFace hub cannot be reached (None when it answers): one request, a few seconds at most,
    where the hub's own clients retry for a minute before failing with a message about something else."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:  # it answered
        return None
    except (OSError, ValueError) as err:  # URLError, timeouts, refused connections, a malformed HF_ENDPOINT
        return f"{constants.ENDPOINT} did not answer within {timeout:g} s ({getattr(err, 'reason', err)})"
    return None


def _check_hub(cfg: "RunConfig") -> None:
    """A hub model that is not cached here needs the hub: say at once when it cannot be reached or has no such
    model (its own client retries for a minute, then the run would go on with a tokenizer trained in its place)."""
    if cfg.model is None or not is_hub_name(cfg.model):
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(cfg.model, "config.json"), str):
        return  # cached: the hub is not needed to start
    why = hub_unreachable() or _fetch_config(cfg.model)
    if why is not None:
        raise ValueError(f"model={cfg.model!r} is not in the local HuggingFace cache and the hub cannot give it: "
                         f"{why}; expected a reachable hub, the model in the cache, or a local model directory")


def _fetch_config(model: str) -> str | None:
    """Download the model's config.json (the first file the run needs anyway); why it failed, or None."""
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(model, "config.json", etag_timeout=5)
    except Exception as err:  # noqa: BLE001 - not found, gated, a proxy's answer: all mean no model
        return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    return None


def _check_model_shape(cfg: "RunConfig") -> None:
    """From the model's config alone, before any data is tokenized or weight read: a class the pipeline can split,
    stages against its blocks, seq_len against its positions."""
    from .models import TINY, model_class  # deferred: imports transformers, only once a run is checked

    blocks, positions, name = TINY["layers"], None, "the built-in shape"  # it grows its positions to seq_len
    if cfg.model is not None:
        from transformers import AutoConfig

        try:  # a local directory or config.json, or a hub name already in the local cache
            config = AutoConfig.from_pretrained(cfg.model, local_files_only=is_hub_name(cfg.model))
        except Exception:  # noqa: BLE001 - a hub name not cached here: the run checks once it has the model
            return
        cls = model_class(cfg.task, config)
        if cfg.lora.enabled:  # targets resolved on the model's own modules (no weight read)
            from aqpipe.pipeline.lora import lora_config  # deferred: imports transformers, as above

            partition = cfg.distributed.partition  # auto: a plan's, made at start; by parameters until then
            lora_config(cls, config, cfg.lora, cfg.task == "classification", cfg.distributed.pipeline_stages,
                        "parameters" if partition == "auto" else partition)
        blocks = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None)
        positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        name = repr(cfg.model)
    stages, partition = cfg.distributed.pipeline_stages, cfg.distributed.partition
    if blocks is not None and stages > blocks:
        raise ValueError(f"pipeline_stages={stages}: model {name} has {blocks} blocks; expected at most "
                         f"{blocks} stages (each stage holds at least one block)")
    if blocks is not None and isinstance(partition, list) and sum(partition) != blocks:
        raise ValueError(f"partition={partition}: sums to {sum(partition)}; expected the {blocks} blocks of "
                         f"model {name}")
    if positions is not None and cfg.data.seq_len > positions:
        raise ValueError(f"seq_len={cfg.data.seq_len}: model {name} has {positions} positions; expected seq_len <= "
                         f"{positions}")


def _resumed(cfg: "RunConfig") -> "RunConfig":
    """--resume resolved to a checkpoint directory whose settings match this run's (None: auto, nothing saved),
    with the values the run recorded when it started (an "auto" data-parallel warm-up's number)."""
    if cfg.checkpointing.resume is None:
        return cfg
    found = checkpoint.find(cfg.checkpointing.resume, cfg.checkpointing.output_dir)
    if found is None:
        return replace(cfg, checkpointing=replace(cfg.checkpointing, resume=None))
    cfg = checkpoint.check_compatible(found, cfg)
    return replace(cfg, checkpointing=replace(cfg.checkpointing, resume=str(found)))
