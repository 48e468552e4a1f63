"""Run configuration: DeepSpeed's JSON plus aqpipe's sections, overridden by flags, validated up front.

Precedence: the task's defaults < `--deepspeed_config` file < command-line flags. The file uses
DeepSpeed's keys (train_micro_batch_size_per_gpu, gradient_accumulation_steps, optimizer, scheduler,
gradient_clipping, bf16, pipeline) and aqpipe's own blocks: "compression" (the engine's
`CompressionConfig`, its field names as keys), "data_parallel" (`DataParallelConfig`, likewise) and
"run" (model, dataset, seq_len, epochs, ...). The two sections go whole to the objects that use them.
`validate` checks every value and touches no file; the checks that read files (the model's config,
the data file, a checkpoint to resume from) are `preflight.check`, run once by `resolve` before any
process group starts. A bad value exits with status 2 and one line naming it.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from compression import BACKWARD_MODES, FORWARD_MODES
from data_parallel import DataParallelConfig
from pipeline import BUFFER_DTYPES, CompressionConfig
from pipeline.schedule import SCHEDULES
from pipeline.ties import TIE_MODES

from . import let_rank_0_speak, preflight, speaks

OPTIMIZERS = ("Adam", "AdamW", "SGD")
PARAM_DTYPES = ("float32", "bfloat16")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


@dataclass
class RunConfig:
    task: str  # "causal_lm" or "classification"
    model: str | None = None  # None: the built-in tiny shape
    dataset: str | None = None  # None: the built-in corpus / task
    dataset_config: str | None = None  # an HF dataset's configuration (wikitext: wikitext-2-raw-v1)
    text_column: str | None = None  # a local table's columns; None: inferred (GLUE's layouts, 'label')
    text_pair_column: str | None = None
    label_column: str | None = None
    seq_len: int = 128
    pipeline_stages: int | str = "auto"  # "auto": world size / replicas
    schedule: str = "1f1b"
    partition: str | list[int] = "parameters"
    activation_checkpointing: bool = False
    dropout: float | None = None  # every dropout probability of the model; None: the model's own (HF: 0.1)
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
    param_dtype: str = "float32"  # the weights' dtype; bfloat16: float32 Adam moments, stochastic rounding
    dist_timeout: float = 45.0  # a blocked collective or receive gives up after this (then ~6 s to exit)
    peer_timeout: float = 30.0  # a rank without heartbeat for this long is taken for dead
    save_every: int = 0  # checkpoint every N steps (0: never)
    save_total_limit: int = 2  # keep the N newest checkpoints (0: all)
    overwrite_output_dir: bool = False  # replace another run's results in output_dir instead of refusing
    resume: str | None = None  # latest | auto | a checkpoint path; resolved to the checkpoint directory
    skip_nonfinite: bool = False  # skip a step with NaN/inf (on every rank) instead of stopping
    # the sections the engine and the data-parallel algorithms take whole
    compression: CompressionConfig = field(default_factory=lambda: CompressionConfig(
        forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4))
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)

    @property
    def replicas(self) -> int:
        return self.data_parallel.replicas

    def to_dict(self) -> dict[str, Any]:
        """JSON values, the sections nested (a dtype by its name)."""
        out = asdict(self)
        out["compression"]["buffer_dtype"] = str(self.compression.buffer_dtype).removeprefix("torch.")
        return out


def _group(text: str) -> int | str | None:
    """A group size flag: a number, auto, or none (whole rows; kept as the word until the config is built, since
    None means "not given" to argparse)."""
    word = text.strip().lower()
    return word if word in ("none", "auto") else int(text)


def _count_or_auto(text: str) -> int | str:
    """An integer or the word auto; argparse says which was expected when it is neither."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer or auto") from None


def _rates(text: str) -> list[float]:
    """Comma-separated link rates in Mbit/s, one per boundary."""
    return [float(v) for v in text.split(",")]


# flag -> (type, help, where it lands: a RunConfig field, or "section.field"); every flag defaults to None so
# the file's value survives unless the flag is given
FLAGS: dict[str, tuple[Any, str, str]] = {
    "model": (str, "HF hub name, local model directory, or a config.json (random init); default: a tiny shape",
              "model"),
    "dataset": (str, "HF dataset name, local text/json/csv/parquet file, or a built-in name; default: built-in",
                "dataset"),
    "dataset_config": (str, "configuration of an HF hub dataset, e.g. wikitext-103-raw-v1", "dataset_config"),
    "text_column": (str, "a local table's text column; default: GLUE's layouts (sentence, sentence1+sentence2, "
                         "question+sentence, ..., text), for causal LM 'text' or the one string column",
                    "text_column"),
    "text_pair_column": (str, "a local table's second text column (sentence pairs); default: from the layout",
                         "text_pair_column"),
    "label_column": (str, "a local table's label column (integers 0..K-1 or strings); default: label, else labels",
                     "label_column"),
    "seq_len": (int, "tokens per sample", "seq_len"),
    "dropout": (float, "every dropout probability of the model (embeddings, attention, residual, classifier); "
                       "default: the model's own, 0.1 for HF GPT2 and DeBERTa", "dropout"),
    "pipeline_stages": (str, "stages per pipeline, or auto = world size / replicas (world = stages x replicas)",
                        "pipeline_stages"),
    "schedule": (str, f"one of {', '.join(SCHEDULES)}", "schedule"),
    "partition": (str, "parameters, uniform, or comma-separated block counts per stage", "partition"),
    "micro_batch_size": (int, "samples per micro-batch", "micro_batch_size"),
    "num_micro_batches": (int, "micro-batches per optimizer step (gradient accumulation)", "num_micro_batches"),
    "epochs": (int, "passes over the training samples", "epochs"),
    "max_steps": (int, "stop after this many optimizer steps", "max_steps"),
    "max_train_samples": (int, "use the first N training samples (0: all)", "max_train_samples"),
    "max_eval_samples": (int, "use the first N evaluation samples (0: all)", "max_eval_samples"),
    "eval_every": (int, "evaluate every N steps (0: at the end only)", "eval_every"),
    "lr": (float, "peak learning rate", "lr"),
    "seed": (int, "seed of model init, data order and codecs", "seed"),
    "output_dir": (str, "where metrics, summary and the fine-tuned model go", "output_dir"),
    "gradient_clipping": (float, "clip the global gradient norm to this (0: off)", "gradient_clipping"),
    "param_dtype": (str, "the weights' dtype: float32 (master weights, whatever the checkpoint's dtype) or bfloat16 "
                         "(bf16 weights and gradients, float32 Adam moments, stochastic rounding: 12 bytes a "
                         "parameter instead of 16; Adam or AdamW)", "param_dtype"),
    "dist_timeout": (float, "seconds a collective or receive may wait for a peer before the run stops",
                     "dist_timeout"),
    "peer_timeout": (float, "seconds without a peer's heartbeat before it is taken for dead and the run stops",
                     "peer_timeout"),
    "save_every": (int, "write a resumable checkpoint every N steps and at the end (0: never)", "save_every"),
    "save_total_limit": (int, "keep only the N newest checkpoints (default 2; 0: all)", "save_total_limit"),
    # the compression section (the engine's CompressionConfig)
    "forward_compress": (str, f"activations: one of {', '.join(FORWARD_MODES)}", "compression.forward"),
    "forward_bits": (_count_or_auto, "bits of forward compression (1-8), or auto: per boundary, the most its link "
                                     "and the stages' compute make cheap", "compression.forward_bits"),
    "backward_compress": (str, f"gradients: one of {', '.join(BACKWARD_MODES)}", "compression.backward"),
    "backward_bits": (_count_or_auto, "bits of backward compression (1-8), or auto",
                      "compression.backward_bits"),
    "auto_bits_min": (int, "the fewest bits auto may choose (default 2)", "compression.auto_bits_min"),
    "auto_bits_max": (int, "the most bits auto may choose (default 8)", "compression.auto_bits_max"),
    "auto_bits_every": (int, "steps between auto's decisions, each after probing the links (default 20)",
                        "compression.auto_bits_every"),
    "auto_bits_slack": (float, "how much longer than at the fewest bits auto may make a step to send more bits, "
                               "a fraction (default 0.02)", "compression.auto_bits_slack"),
    "link_mbit": (_rates, "known link rates, Mbit/s, one per boundary (comma-separated): auto decides from them "
                          "instead of probing", "compression.link_mbit"),
    "group_size": (_group, "elements per quantization group on both boundaries (each group's min and step: 8 "
                           "bytes), auto, or none for whole rows; sets --forward_group_size and --backward_group_size",
                   "compression.group_size"),
    "forward_group_size": (_group, "the forward quantizer's group: N, auto (64 at 2 bits or fewer, else rows) or "
                                   "none (whole rows)", "compression.forward_group_size"),
    "backward_group_size": (_group, "the backward quantizer's group: N, auto or none",
                            "compression.backward_group_size"),
    "warmup_epochs": (int, "epochs at full precision before compression starts", "compression.warmup_epochs"),
    "tie_compress": (str, f"tied weights (GPT2's embedding / LM head): auto, {', '.join(TIE_MODES)} (auto: none "
                          "when both boundary codecs are none, else aqsgd)", "compression.tie"),
    "tie_bits": (int, "bits of tied-weight rows (as changes) and their gradients with tie_compress aqsgd (1-8)",
                 "compression.tie_bits"),
    "buffer_dtype": (str, f"AQ-SGD buffer dtype: one of {', '.join(BUFFER_DTYPES)}", "compression.buffer_dtype"),
    "buffer_bits": (int, "hold AQ-SGD buffer rows quantized to 4 or 8 bits (8: about half of float16's memory; "
                         "default: rows in buffer_dtype)", "compression.buffer_bits"),
    "buffer_dir": (str, "keep AQ-SGD buffers in files under this directory instead of RAM", "compression.buffer_dir"),
    # the data-parallel section (data_parallel.DataParallelConfig)
    "replicas": (int, "data-parallel replicas of the pipeline", "data_parallel.replicas"),
    "dp_algorithm": (str, "replica sync: allreduce, decentralized, low_precision_decentralized, qadam, "
                          "qsparse_local_sgd, cocktail_sgd", "data_parallel.algorithm"),
    "dp_bits": (int, "bits of compressed data-parallel traffic (1-8)", "data_parallel.bits"),
    "dp_warmup_steps": (_count_or_auto, "qadam: full-precision Adam steps before compressed momentum (default "
                                        "auto: a tenth of the run's steps)",
                        "data_parallel.warmup_steps"),
    "dp_local_steps": (int, "qsparse_local_sgd: local steps between synchronizations", "data_parallel.local_steps"),
    "dp_topk_ratio": (float, "qsparse_local_sgd, cocktail_sgd: fraction of entries sent (0, 1]",
                      "data_parallel.topk_ratio"),
    "dp_random_ratio": (float, "cocktail_sgd: fraction of entries considered a step, top-k among them (0, 1]",
                        "data_parallel.random_ratio"),
    "dp_topology": (str, "low_precision_decentralized: directed_ring (one neighbour) or ring (two)",
                    "data_parallel.topology"),
    "dp_peer_selection": (str, "decentralized: shift_one or all", "data_parallel.peer_selection"),
    "dp_interval": (int, "decentralized: communicate every N steps", "data_parallel.interval"),
}
SECTIONS = {"compression": CompressionConfig, "data_parallel": DataParallelConfig}


class Parser(argparse.ArgumentParser):
    """argparse with a bad flag in one line (no usage block), said by rank 0; every rank exits alike."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if status and message and not speaks():
            let_rank_0_speak()
            message = f"{message.rstrip()} (rank {os.environ.get('RANK')})\n"
        super().exit(status, message)

    def print_help(self, file: Any = None) -> None:
        if speaks():
            super().print_help(file)


def build_parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    p = Parser(prog=prog, usage="%(prog)s [flags]", description=description,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--config", dest="deepspeed_config", help="DeepSpeed-style JSON config")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    for name, (kind, text, _) in FLAGS.items():
        p.add_argument(f"--{name}", type=kind, default=None, help=text)
    p.add_argument("--stochastic", dest="stochastic", action="store_const", const=True, default=None,
                   help="stochastic rounding in every quantizer (unbiased; the default)")
    p.add_argument("--no_stochastic", dest="stochastic", action="store_const", const=False,
                   help="round to nearest instead (biased; outside AQ-SGD's convergence theorem)")
    p.add_argument("--bf16", action="store_true", default=None, help="bfloat16 autocast and bf16 boundary activations")
    p.add_argument("--activation_checkpointing", action="store_true", default=None, help="recompute blocks in backward")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from a checkpoint: latest (under --output_dir; the default with no value), "
                        "auto (latest if there is one, else start fresh), or a checkpoint directory")
    p.add_argument("--overwrite_output_dir", action="store_true", default=None,
                   help="replace another run's results (summary, metrics, model, checkpoints) in --output_dir")
    p.add_argument("--skip_nonfinite", action="store_true", default=None,
                   help="skip a step whose loss, activations or gradients hold NaN/inf instead of stopping")
    return p


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as settings: top-level fields by name, section fields as {"section": {...}}."""
    out: dict[str, Any] = {}
    targets = {name: dest for name, (_, _, dest) in FLAGS.items()}
    targets.update(stochastic="compression.stochastic", bf16="bf16", resume="resume",
                   activation_checkpointing="activation_checkpointing", skip_nonfinite="skip_nonfinite",
                   overwrite_output_dir="overwrite_output_dir")
    for name, value in vars(args).items():
        if value is None or name not in targets:
            continue
        section, _, key = targets[name].rpartition(".")
        keys = ("forward_group_size", "backward_group_size") if key == "group_size" else (key,)
        for key in keys:  # --group_size sets both boundaries' groups; the one-sided flags (after it) win
            if key == name or vars(args).get(key) is None:
                (out.setdefault(section, {}) if section else out)[key] = value
    return out


def _from_file(path: str) -> dict[str, Any]:
    """Translate a DeepSpeed-style JSON file into settings (sections as nested dicts)."""
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
    for theirs, ours in (("stages", "pipeline_stages"), ("schedule", "schedule"), ("partition", "partition")):
        if theirs in pipe:
            out[ours] = pipe[theirs]
    if pipe.get("activation_checkpoint_interval", 0):
        out["activation_checkpointing"] = True
    for section in SECTIONS:
        if section in raw:
            out[section] = dict(raw[section])
    out.update(raw.get("run", {}))
    if "train_batch_size" in raw:
        out["_train_batch_size"] = raw["train_batch_size"]
    return out


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; the sections merge key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            out[key] = {**out.get(key, {}), **value} if key in SECTIONS else value
    return out


def _build(task: str, values: dict[str, Any]) -> RunConfig:
    """A RunConfig from merged settings; an unknown key is named with the block it came from."""
    top = {f.name for f in fields(RunConfig)} - set(SECTIONS)
    unknown = sorted(set(values) - top - set(SECTIONS))
    if unknown:
        moved = [f"{k} is {FLAGS[k][2].replace('.', ' block key ')}" for k in unknown
                 if k in FLAGS and "." in FLAGS[k][2]]  # a setting that lives in a section now
        hint = f" ({'; '.join(moved)})" if moved else ""
        raise ValueError(f"unknown setting(s) {', '.join(unknown)} in the config's run block{hint}")
    cfg = RunConfig(task=task, **{k: v for k, v in values.items() if k not in SECTIONS})
    for name, kind in SECTIONS.items():
        given = dict(values.get(name, {}))
        unknown = sorted(set(given) - {f.name for f in fields(kind)})
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)} in the config's {name} block; expected "
                             f"{', '.join(f.name for f in fields(kind))}")
        for key in ("forward_group_size", "backward_group_size"):
            if isinstance(given.get(key), str) and given[key].lower() == "none":
                given[key] = None  # whole rows
        if isinstance(given.get("buffer_dtype"), str):
            given["buffer_dtype"] = BUFFER_DTYPES.get(given["buffer_dtype"], given["buffer_dtype"])
        setattr(cfg, name, replace(getattr(cfg, name), **given))
    return cfg


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
    """Check every value against its range, reading no file; raises ValueError naming the first bad one."""
    cfg.data_parallel.validate()
    _resolve_stages(cfg, world_size)
    for name in ("seq_len", "pipeline_stages", "micro_batch_size", "num_micro_batches", "epochs"):
        _positive(cfg, name)
    _positive(cfg, "eval_every", allow_zero=True)
    for name in ("max_steps", "max_train_samples", "max_eval_samples"):
        if getattr(cfg, name) is not None:
            _positive(cfg, name, allow_zero=name != "max_steps")
    if cfg.seq_len < 2:
        raise ValueError(f"seq_len={cfg.seq_len}: expected at least 2 tokens")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule={cfg.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    cfg.compression.validate()
    rates = cfg.compression.link_mbit
    if rates is not None and len(rates) != cfg.pipeline_stages - 1:
        raise ValueError(f"link_mbit={rates}: expected {cfg.pipeline_stages - 1} rates, one per boundary of "
                         f"{cfg.pipeline_stages} stages")
    if isinstance(cfg.partition, str) and cfg.partition not in ("parameters", "uniform"):
        try:
            cfg.partition = [int(v) for v in cfg.partition.split(",")]
        except ValueError:
            raise ValueError(f"partition={cfg.partition!r}: expected parameters, uniform, "
                             "or block counts like 2,2") from None
    if isinstance(cfg.partition, list) and len(cfg.partition) != cfg.pipeline_stages:
        raise ValueError(f"partition={cfg.partition}: expected {cfg.pipeline_stages} block counts, one per stage")
    for name in ("text_column", "text_pair_column", "label_column"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{name}={value!r}: expected a column name")
    if not cfg.lr > 0:
        raise ValueError(f"lr={cfg.lr}: expected a positive learning rate")
    if cfg.dropout is not None and not (isinstance(cfg.dropout, (int, float)) and 0 <= cfg.dropout < 1):
        raise ValueError(f"dropout={cfg.dropout!r}: expected a probability in [0, 1)")
    if cfg.param_dtype not in PARAM_DTYPES:
        expected = "float32 or bfloat16" + (" (float16 weights need a loss scaler, which aqpipe does not have)"
                                            if cfg.param_dtype == "float16" else "")
        raise ValueError(f"param_dtype={cfg.param_dtype!r}: expected {expected}")
    if cfg.param_dtype == "bfloat16" and cfg.optimizer.get("type") not in ("Adam", "AdamW"):
        raise ValueError(f"param_dtype=bfloat16 with optimizer {cfg.optimizer.get('type')!r}: expected Adam or AdamW "
                         "(their moments are kept in float32 beside bf16 weights)")
    others = sorted(set(cfg.optimizer.get("params", {})) - {"betas", "eps", "weight_decay"})
    if cfg.param_dtype == "bfloat16" and others:
        raise ValueError(f"param_dtype=bfloat16 with optimizer params {', '.join(others)}: expected only betas, eps "
                         "and weight_decay (bf16 weights step through aqpipe's own Adam)")
    if cfg.gradient_clipping < 0:
        raise ValueError(f"gradient_clipping={cfg.gradient_clipping}: expected >= 0")
    for name in ("dist_timeout", "peer_timeout"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name}={getattr(cfg, name)}: expected a positive number of seconds")
    _positive(cfg, "save_every", allow_zero=True)
    _positive(cfg, "save_total_limit", allow_zero=True)
    if cfg.overwrite_output_dir and cfg.resume is not None:
        raise ValueError(f"--overwrite_output_dir with --resume {cfg.resume}: expected one of them (replace the "
                         "results in output_dir, or continue the run that wrote them)")
    opt_type = cfg.optimizer.get("type")
    if opt_type not in OPTIMIZERS:
        raise ValueError(f"optimizer type {opt_type!r}: expected one of {', '.join(OPTIMIZERS)}")
    if cfg.scheduler is not None and cfg.scheduler.get("type") not in SCHEDULERS:
        raise ValueError(f"scheduler type {cfg.scheduler.get('type')!r}: expected one of {', '.join(SCHEDULERS)}")
    return cfg


def resolve(task: str, argv: list[str] | None, description: str, defaults: dict[str, Any] | None = None,
            prog: str | None = None) -> RunConfig:
    """Defaults < config file < flags, validated, then the checks that read files (preflight).

    Exits with status 2 and one line on bad input."""
    parser = build_parser(description, prog)
    args = parser.parse_args(argv)
    try:
        values = _merge(defaults or {}, _from_file(args.deepspeed_config) if args.deepspeed_config else {},
                        _flag_values(args))
        batch = values.pop("_train_batch_size", None)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = validate(_build(task, values), world)
        if world % cfg.pipeline_stages:
            raise ValueError(f"pipeline_stages={cfg.pipeline_stages} does not divide the launcher's {world} "
                             "processes: expected world size = pipeline_stages x replicas")
        if cfg.pipeline_stages * cfg.replicas != world:
            raise ValueError(f"pipeline_stages={cfg.pipeline_stages} x replicas={cfg.replicas} needs "
                             f"{cfg.pipeline_stages * cfg.replicas} processes; the launcher started {world}")
        if batch is not None and batch != cfg.micro_batch_size * cfg.num_micro_batches * cfg.replicas:
            raise ValueError(
                f"train_batch_size={batch}: expected micro_batch_size x num_micro_batches x replicas = "
                f"{cfg.micro_batch_size} x {cfg.num_micro_batches} x {cfg.replicas}"
            )
        preflight.check(cfg)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return cfg
