"""Run configuration: DeepSpeed's JSON plus aqpipe's blocks, overridden by flags, validated up front.

Precedence: built-in defaults < `--deepspeed_config` file < command-line flags. The file
uses DeepSpeed's keys (train_micro_batch_size_per_gpu, gradient_accumulation_steps,
optimizer, scheduler, gradient_clipping, bf16, pipeline) and aqpipe's own blocks:
"compression", "data_parallel" and "run" (model, dataset, seq_len, epochs, ...).
Every value is checked before any process group starts; a bad one exits with status 2
and one line naming it. That includes what needs a look at the model's config (stages
against blocks, seq_len against positions), the data file, and a checkpoint to resume from
(its manifest must match this run's settings).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from compression import BACKWARD_MODES, FORWARD_MODES
from pipeline.schedule import SCHEDULES
from pipeline.ties import TIE_MODES

OPTIMIZERS = ("Adam", "AdamW", "SGD")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
BUFFER_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class RunConfig:
    task: str  # "causal_lm" or "classification"
    model: str | None = None  # None: the built-in tiny shape
    dataset: str | None = None  # None: the built-in corpus / task
    dataset_config: str | None = None  # an HF dataset's configuration (wikitext: wikitext-2-raw-v1)
    seq_len: int = 128
    pipeline_stages: int | str = "auto"  # "auto": world size / replicas
    schedule: str = "1f1b"
    partition: str | list[int] = "parameters"
    activation_checkpointing: bool = False
    replicas: int = 1
    micro_batch_size: int = 4
    num_micro_batches: int = 4
    epochs: int = 3
    max_steps: int | None = None
    max_train_samples: int | None = 2048
    max_eval_samples: int | None = 256
    eval_every: int = 0
    lr: float = 5e-4
    seed: int = 42
    output_dir: str = "runs/latest"
    optimizer: dict[str, Any] = field(default_factory=lambda: {"type": "AdamW", "params": {"weight_decay": 0.01}})
    scheduler: dict[str, Any] | None = None
    gradient_clipping: float = 1.0
    bf16: bool = False
    forward_compress: str = "aqsgd"
    forward_bits: int = 2
    backward_compress: str = "direct"
    backward_bits: int = 4
    warmup_epochs: int = 0
    tie_compress: str = "auto"  # tied weights' rows and gradients: auto (none iff both boundaries are), none, aqsgd
    tie_bits: int = 8
    buffer_dtype: str = "float16"
    buffer_dir: str | None = None
    dist_timeout: float = 45.0  # a blocked collective or receive gives up after this (then ~6 s to exit)
    peer_timeout: float = 30.0  # a rank without heartbeat for this long is taken for dead
    save_every: int = 0  # checkpoint every N steps (0: never)
    save_total_limit: int | None = None  # keep the N newest checkpoints (None: all)
    resume: str | None = None  # latest | auto | a checkpoint path; resolved to the checkpoint directory
    skip_nonfinite: bool = False  # skip a step with NaN/inf (on every rank) instead of stopping
    dp_algorithm: str = "allreduce"
    dp_bits: int = 8
    dp_warmup_steps: int = 100
    dp_local_steps: int = 4
    dp_topk_ratio: float = 0.01
    dp_peer_selection: str = "shift_one"
    dp_interval: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# flag name -> (type, help); every flag defaults to None so the file's value survives unless given
FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "HF hub name, local model directory, or a config.json (random init); default: a tiny shape"),
    "dataset": (str, "HF dataset name, local text/json/csv/parquet file, or a built-in name; default: built-in"),
    "dataset_config": (str, "configuration of an HF hub dataset, e.g. wikitext-103-raw-v1"),
    "seq_len": (int, "tokens per sample"),
    "pipeline_stages": (str, "stages per pipeline, or auto = world size / replicas (world = stages x replicas)"),
    "schedule": (str, f"one of {', '.join(SCHEDULES)}"),
    "partition": (str, "parameters, uniform, or comma-separated block counts per stage"),
    "replicas": (int, "data-parallel replicas of the pipeline"),
    "micro_batch_size": (int, "samples per micro-batch"),
    "num_micro_batches": (int, "micro-batches per optimizer step (gradient accumulation)"),
    "epochs": (int, "passes over the training samples"),
    "max_steps": (int, "stop after this many optimizer steps"),
    "max_train_samples": (int, "use the first N training samples (0: all)"),
    "max_eval_samples": (int, "use the first N evaluation samples (0: all)"),
    "eval_every": (int, "evaluate every N steps (0: at the end only)"),
    "lr": (float, "peak learning rate"),
    "seed": (int, "seed of model init, data order and codecs"),
    "output_dir": (str, "where metrics, summary and the fine-tuned model go"),
    "forward_compress": (str, f"activations: one of {', '.join(FORWARD_MODES)}"),
    "forward_bits": (int, "bits of forward compression (1-8)"),
    "backward_compress": (str, f"gradients: one of {', '.join(BACKWARD_MODES)}"),
    "backward_bits": (int, "bits of backward compression (1-8)"),
    "warmup_epochs": (int, "epochs at full precision before compression starts"),
    "tie_compress": (str, f"tied weights (GPT2's embedding / LM head): auto, {', '.join(TIE_MODES)} (auto: none "
                          "when both boundary codecs are none, else aqsgd)"),
    "tie_bits": (int, "bits of tied-weight rows (as changes) and their gradients with tie_compress aqsgd (1-8)"),
    "buffer_dtype": (str, f"AQ-SGD buffer dtype: one of {', '.join(BUFFER_DTYPES)}"),
    "buffer_dir": (str, "keep AQ-SGD buffers in files under this directory instead of RAM"),
    "gradient_clipping": (float, "clip the global gradient norm to this (0: off)"),
    "dist_timeout": (float, "seconds a collective or receive may wait for a peer before the run stops"),
    "peer_timeout": (float, "seconds without a peer's heartbeat before it is taken for dead and the run stops"),
    "save_every": (int, "write a resumable checkpoint every N steps and at the end (0: never)"),
    "save_total_limit": (int, "keep only the N newest checkpoints"),
    "dp_algorithm": (str, "replica sync: allreduce, decentralized, low_precision_decentralized, qadam, qsparse_local_sgd"),
    "dp_bits": (int, "bits of compressed data-parallel traffic (1-8)"),
    "dp_warmup_steps": (int, "qadam: full-precision Adam steps before compressed momentum"),
    "dp_local_steps": (int, "qsparse_local_sgd: local steps between synchronizations"),
    "dp_topk_ratio": (float, "qsparse_local_sgd: fraction of entries kept (0, 1]"),
    "dp_peer_selection": (str, "decentralized: shift_one or all"),
    "dp_interval": (int, "decentralized: communicate every N steps"),
}


def build_parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--config", dest="deepspeed_config", help="DeepSpeed-style JSON config")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    for name, (kind, text) in FLAGS.items():
        p.add_argument(f"--{name}", type=kind, default=None, help=text)
    p.add_argument("--bf16", action="store_true", default=None, help="bfloat16 autocast and bf16 boundary activations")
    p.add_argument("--activation_checkpointing", action="store_true", default=None, help="recompute blocks in backward")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from a checkpoint: latest (under --output_dir; the default with no value), "
                        "auto (latest if there is one, else start fresh), or a checkpoint directory")
    p.add_argument("--skip_nonfinite", action="store_true", default=None,
                   help="skip a step whose loss, activations or gradients hold NaN/inf instead of stopping")
    return p


def _from_file(path: str) -> dict[str, Any]:
    """Translate a DeepSpeed-style JSON file into RunConfig fields."""
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path}: no such file")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({exc})") from None
    out: dict[str, Any] = {}
    simple = {"train_micro_batch_size_per_gpu": "micro_batch_size", "gradient_accumulation_steps": "num_micro_batches",
              "gradient_clipping": "gradient_clipping"}
    out.update({ours: raw[theirs] for theirs, ours in simple.items() if theirs in raw})
    if "bf16" in raw:
        out["bf16"] = bool(raw["bf16"].get("enabled", False)) if isinstance(raw["bf16"], dict) else bool(raw["bf16"])
    if "optimizer" in raw:  # its lr is the run's `lr`, kept in one place
        params = dict(raw["optimizer"].get("params", {}))
        if "lr" in params:
            out["lr"] = params.pop("lr")
        out["optimizer"] = {**raw["optimizer"], "params": params}
    if "scheduler" in raw:
        out["scheduler"] = raw["scheduler"]
    pipe = raw.get("pipeline", {})
    for theirs, ours in (("stages", "pipeline_stages"), ("schedule", "schedule"), ("partition", "partition")):
        if theirs in pipe:
            out[ours] = pipe[theirs]
    if pipe.get("activation_checkpoint_interval", 0):
        out["activation_checkpointing"] = True
    comp = raw.get("compression", {})
    for key in ("forward", "backward"):
        if key in comp:
            out[f"{key}_compress"] = comp[key]
        if f"{key}_bits" in comp:
            out[f"{key}_bits"] = comp[f"{key}_bits"]
    for key in ("tie", "tie_bits"):
        if key in comp:
            out["tie_compress" if key == "tie" else key] = comp[key]
    for key in ("warmup_epochs", "buffer_dtype", "buffer_dir"):
        if key in comp:
            out[key] = comp[key]
    for key, value in raw.get("data_parallel", {}).items():
        out[key if key == "replicas" else f"dp_{key}"] = value
    out.update(raw.get("run", {}))
    if "train_batch_size" in raw:
        out["_train_batch_size"] = raw["train_batch_size"]
    return out


def _positive(cfg: RunConfig, name: str, allow_zero: bool = False) -> None:
    value = getattr(cfg, name)
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an integer >= {low}")


def _resolve_stages(cfg: RunConfig, world_size: int) -> None:
    """'auto' stages fill the launcher's world: every process is one stage of one of the replicas."""
    if cfg.pipeline_stages == "auto":
        if world_size % cfg.replicas:
            raise ValueError(f"replicas={cfg.replicas} does not divide the world size {world_size}")
        cfg.pipeline_stages = world_size // cfg.replicas
        return
    try:
        cfg.pipeline_stages = int(cfg.pipeline_stages)
    except (TypeError, ValueError):
        raise ValueError(f"pipeline_stages={cfg.pipeline_stages!r}: expected a positive integer or auto") from None


def validate(cfg: RunConfig, world_size: int = 1) -> RunConfig:
    """Check every value; raises ValueError naming the first bad one and what is expected."""
    _positive(cfg, "replicas")
    _resolve_stages(cfg, world_size)
    for name in ("seq_len", "pipeline_stages", "micro_batch_size", "num_micro_batches", "epochs"):
        _positive(cfg, name)
    for name in ("eval_every", "warmup_epochs"):
        _positive(cfg, name, allow_zero=True)
    for name in ("max_steps", "max_train_samples", "max_eval_samples"):
        if getattr(cfg, name) is not None:
            _positive(cfg, name, allow_zero=name != "max_steps")
    _check_data_parallel(cfg)
    if cfg.seq_len < 2:
        raise ValueError(f"seq_len={cfg.seq_len}: expected at least 2 tokens")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule={cfg.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if cfg.forward_compress not in FORWARD_MODES:
        raise ValueError(f"forward_compress={cfg.forward_compress!r}: expected one of {', '.join(FORWARD_MODES)}")
    if cfg.backward_compress not in BACKWARD_MODES:
        raise ValueError(f"backward_compress={cfg.backward_compress!r}: expected one of {', '.join(BACKWARD_MODES)}")
    if cfg.tie_compress not in ("auto", *TIE_MODES):
        raise ValueError(f"tie_compress={cfg.tie_compress!r}: expected auto or one of {', '.join(TIE_MODES)}")
    for name in ("forward_bits", "backward_bits", "tie_bits"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
            raise ValueError(f"{name}={value!r}: expected an integer from 1 to 8")
    if cfg.buffer_dtype not in BUFFER_DTYPES:
        raise ValueError(f"buffer_dtype={cfg.buffer_dtype!r}: expected one of {', '.join(BUFFER_DTYPES)}")
    if isinstance(cfg.partition, str) and cfg.partition not in ("parameters", "uniform"):
        try:
            cfg.partition = [int(v) for v in cfg.partition.split(",")]
        except ValueError:
            raise ValueError(f"partition={cfg.partition!r}: expected parameters, uniform, or block counts like 2,2") from None
    if isinstance(cfg.partition, list) and len(cfg.partition) != cfg.pipeline_stages:
        raise ValueError(f"partition={cfg.partition}: expected {cfg.pipeline_stages} block counts, one per stage")
    if not cfg.lr > 0:
        raise ValueError(f"lr={cfg.lr}: expected a positive learning rate")
    if cfg.gradient_clipping < 0:
        raise ValueError(f"gradient_clipping={cfg.gradient_clipping}: expected >= 0")
    for name in ("dist_timeout", "peer_timeout"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name}={getattr(cfg, name)}: expected a positive number of seconds")
    _positive(cfg, "save_every", allow_zero=True)
    if cfg.save_total_limit is not None:
        _positive(cfg, "save_total_limit")
    opt_type = cfg.optimizer.get("type")
    if opt_type not in OPTIMIZERS:
        raise ValueError(f"optimizer type {opt_type!r}: expected one of {', '.join(OPTIMIZERS)}")
    if cfg.scheduler is not None and cfg.scheduler.get("type") not in SCHEDULERS:
        raise ValueError(f"scheduler type {cfg.scheduler.get('type')!r}: expected one of {', '.join(SCHEDULERS)}")
    if cfg.model is not None and not _is_hub_name(cfg.model) and not os.path.exists(cfg.model):
        raise ValueError(f"model={cfg.model!r}: no such file or directory (expected an HF name, a model directory or a config.json)")
    if cfg.dataset is not None and not _is_hub_name(cfg.dataset) and not os.path.exists(cfg.dataset):
        raise ValueError(f"dataset={cfg.dataset!r}: no such file (expected an HF dataset name, a built-in name, "
                         "or a local text/json/csv/parquet file)")
    _check_model_shape(cfg)
    _check_resume(cfg)
    return cfg


def _check_model_shape(cfg: RunConfig) -> None:
    """Stages against the model's blocks and seq_len against its positions, from its config alone."""
    from .models import TINY

    blocks, positions, name = TINY["layers"], None, "the built-in shape"  # it grows its positions to seq_len
    if cfg.model is not None:
        from transformers import AutoConfig

        try:  # a local directory or config.json, or a hub name already in the local cache
            config = AutoConfig.from_pretrained(cfg.model, local_files_only=_is_hub_name(cfg.model))
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
        raise ValueError(f"seq_len={cfg.seq_len}: model {name} has {positions} positions; expected seq_len <= {positions}")


def _check_resume(cfg: RunConfig) -> None:
    """Resolve --resume to a checkpoint directory whose settings match this run's (None: auto, nothing saved)."""
    from . import checkpoint, faults

    faults.from_env()  # a malformed AQPIPE_FAULT is bad input too
    if cfg.resume is None:
        return
    found = checkpoint.find(cfg.resume, cfg.output_dir)
    if found is not None:
        checkpoint.check_compatible(found, cfg)
    cfg.resume = None if found is None else str(found)


def _check_data_parallel(cfg: RunConfig) -> None:
    """The data-parallel options, checked before any process starts (the algorithms check them again)."""
    import data_parallel

    if cfg.dp_algorithm not in data_parallel.REGISTRY:
        raise ValueError(f"dp_algorithm={cfg.dp_algorithm!r}: expected one of {', '.join(sorted(data_parallel.REGISTRY))}")
    if isinstance(cfg.dp_bits, bool) or not isinstance(cfg.dp_bits, int) or not 1 <= cfg.dp_bits <= 8:
        raise ValueError(f"dp_bits={cfg.dp_bits!r}: expected an integer from 1 to 8")
    for name in ("dp_local_steps", "dp_interval"):
        _positive(cfg, name)
    _positive(cfg, "dp_warmup_steps", allow_zero=True)
    if not 0 < cfg.dp_topk_ratio <= 1:
        raise ValueError(f"dp_topk_ratio={cfg.dp_topk_ratio}: expected a fraction in (0, 1]")
    if cfg.dp_peer_selection not in ("shift_one", "all"):
        raise ValueError(f"dp_peer_selection={cfg.dp_peer_selection!r}: expected shift_one or all")
    uses_pairs = cfg.dp_algorithm == "decentralized" and cfg.dp_peer_selection == "shift_one"
    if uses_pairs and cfg.replicas > 1 and cfg.replicas % 2:
        raise ValueError(f"replicas={cfg.replicas}: decentralized with shift_one pairs replicas, expected an even count")


def dp_options(cfg: RunConfig) -> dict[str, Any]:
    """The chosen algorithm's own options, from the dp_* settings."""
    return {
        "allreduce": {},
        "decentralized": {"peer_selection": cfg.dp_peer_selection, "interval": cfg.dp_interval},
        "low_precision_decentralized": {"bits": cfg.dp_bits, "seed": cfg.seed},
        "qadam": {"warmup_steps": cfg.dp_warmup_steps, "bits": cfg.dp_bits, "seed": cfg.seed},
        "qsparse_local_sgd": {"local_steps": cfg.dp_local_steps, "topk_ratio": cfg.dp_topk_ratio,
                              "bits": cfg.dp_bits, "seed": cfg.seed},
    }[cfg.dp_algorithm]


def _is_hub_name(name: str) -> bool:
    """'gpt2', 'microsoft/deberta-v2-xxlarge': no path separators beyond one org/name slash, nothing local."""
    return not os.path.exists(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1 \
        and not name.endswith((".json", ".txt", ".csv", ".parquet", ".jsonl"))


def resolve(task: str, argv: list[str] | None, description: str, defaults: dict[str, Any] | None = None,
            prog: str | None = None) -> RunConfig:
    """Defaults < config file < flags, validated. Exits with status 2 and one line on bad input."""
    parser = build_parser(description, prog)
    args = parser.parse_args(argv)
    try:
        values: dict[str, Any] = dict(defaults or {})
        if args.deepspeed_config:
            values.update(_from_file(args.deepspeed_config))
        values.update({k: v for k, v in vars(args).items() if v is not None and k in RunConfig.__dataclass_fields__})
        batch = values.pop("_train_batch_size", None)
        unknown = sorted(set(values) - set(RunConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)} in the config's run block")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = validate(RunConfig(task=task, **values), world)
        if world % cfg.pipeline_stages:
            raise ValueError(f"pipeline_stages={cfg.pipeline_stages} does not divide the launcher's {world} processes: "
                             "expected world size = pipeline_stages x replicas")
        if cfg.pipeline_stages * cfg.replicas != world:
            raise ValueError(
                f"pipeline_stages={cfg.pipeline_stages} x replicas={cfg.replicas} needs "
                f"{cfg.pipeline_stages * cfg.replicas} processes; the launcher started {world}"
            )
        if batch is not None and batch != cfg.micro_batch_size * cfg.num_micro_batches * cfg.replicas:
            raise ValueError(
                f"train_batch_size={batch}: expected micro_batch_size x num_micro_batches x replicas = "
                f"{cfg.micro_batch_size} x {cfg.num_micro_batches} x {cfg.replicas}"
            )
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return cfg
