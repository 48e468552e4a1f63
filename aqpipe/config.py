"""Run configuration: defaults < a DeepSpeed-style JSON file < command-line flags, checked as made, then frozen.

Pure data, one section per component, each checking itself as it is made (`__post_init__`: a ValueError naming the
first bad value): the data (`DataSettings`), the optimizer (`OptimizationSettings`), checkpoints and results
(`CheckpointingSettings`; not "checkpoint", which is a block of DeepSpeed's own file), the processes
(`DistributedSettings`), and the sections the engine (`pipeline.CompressionConfig`), the data-parallel
algorithms (`data_parallel.DataParallelConfig`) and the adapters (`pipeline.adapters.LoraSettings`) take whole.
`RunConfig` holds the run's own settings, the sections, and the checks across them. Each setting is declared once,
as a field: its default, its help and its flag name live in the field, and the parser (flags.py) and the config
file (config_file.py) are built from the fields; the command line stays flat (`--seq_len`, not `--data.seq_len`).
A task's defaults (tasks.py) hold only where it differs from these. Nothing here touches a file: layering the
sources into a RunConfig (`settings.build`), resolving it for the launcher's world (`settings.validate`), the checks
that read files (`preflight.check`) and the command line live in settings.py, which imports this module and not the
other way round.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Iterator

from aqpipe.compression.fields import FREE, RESHAPES, THIS_RUN, check_choices, check_int, is_int, setting
from aqpipe.data_parallel import DataParallelConfig
from aqpipe.pipeline import LOSS_AVERAGES, CompressionConfig
from aqpipe.pipeline.adapters import LoraSettings
from aqpipe.pipeline.schedule import SCHEDULES

from .data.chat import OVERFLOWS
from .placement import BACKENDS
from .trainer_flags import HF_SCHEDULES

OPTIMIZERS = ("Adam", "AdamW", "SGD")
PARAM_DTYPES = ("float32", "bfloat16")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", *HF_SCHEDULES)  # DeepSpeed's, then transformers'


def _adamw() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}


def _warmup_decay() -> dict[str, Any]:
    return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}


def _aqsgd() -> CompressionConfig:
    """The trainer's boundaries: AQ-SGD at 2 bits forward, a sample's first visit whole where the run reads it back
    and as a 3-bit Hadamard change from the boundary's running mean per position where it never does (every sample
    of a one-epoch run: benchmarks/RESULTS.md, "Compressed from the first step"), DirectQ at 4 backward (the
    library's own default is none: an engine built without a section sends full precision)."""
    return CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4,
                             first_visit="auto", first_visit_bits=3, first_visit_base="position")


def _count_or_none(name: str, value: Any, low: int) -> None:
    if value is not None:
        check_int(name, value, low)


@dataclass(frozen=True)
class DataSettings:
    """What the run reads and how it cuts it into samples (aqpipe/data)."""

    dataset: str | None = setting(None, "HF dataset name, local text/json/csv/parquet file, or a built-in name; "
                                      "default: built-in", hf=("dataset_name",))
    dataset_config: str | None = setting(None, "configuration of an HF hub dataset, e.g. wikitext-103-raw-v1")
    eval_dataset: str | None = setting(None, "a held-out evaluation set, read like --dataset (a local file whole, "
                                             "a hub dataset's validation or test split); without it the last "
                                             "--eval_fraction of --dataset", older=None)
    text_column: str | None = setting(None, "a local table's text column; default: GLUE's layouts (sentence, "
                                          "sentence1+sentence2, question+sentence, ..., text), for causal LM 'text' "
                                          "or the one string column", hf=("dataset_text_field",))
    text_pair_column: str | None = setting(None, "a local table's second text column (sentence pairs); default: "
                                               "from the layout")
    label_column: str | None = setting(None, "a local table's label column (integers 0..K-1 or strings); default: "
                                           "label, else labels")
    seq_len: int = setting(128, "tokens per sample", hf=("max_length", "max_seq_length"))  # TRL's, its older
    packing: bool = setting(False, "chat data: place whole conversations (or prompt/completion pairs) into samples "
                                   "of seq_len tokens by best-fit decreasing, each attending within itself alone "
                                   "(position ids restart with each), instead of one per sample padded to seq_len",
                            older=False)
    packing_overflow: str = setting("truncate", "chat data: a conversation longer than seq_len is cut "
                                                "(truncate; counted in the data line) or refused (error)",
                                   choices=OVERFLOWS, older="truncate")
    assistant_only_loss: bool = setting(True, "chat data: the loss on a conversation's assistant turns alone "
                                              "(TRL's flag; off: on every token; TRL's default is off)",
                                       older=True)
    completion_only_loss: bool = setting(True, "prompt/completion data: the loss on the completion alone (TRL's "
                                               "flag and default; off: on the prompt too)",
                                        older=True)
    chat_template: str | None = setting(None, "chat data: the chat template, for a tokenizer without one or instead "
                                              "of its own: chatml, llama3 or a Jinja file; exported with the "
                                              "tokenizer", older=None, hf=("chat_template_path",))
    max_train_samples: int | None = setting(None, "use at most the first N training samples (none or 0: all of "
                                                  "them; a cap that cuts is said at the start)")
    max_eval_samples: int | None = setting(None, "use at most the first N evaluation samples (none or 0: all)",
                                           resume=FREE)
    eval_fraction: float = setting(0.05, "the share of --dataset held out for evaluation without --eval_dataset",
                                  older=0.05)

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, 1)
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len}: expected at least 2 tokens")
        if isinstance(self.eval_fraction, bool) or not isinstance(self.eval_fraction, (int, float)) or \
                not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction!r}: expected a fraction in (0, 1)")
        _count_or_none("max_train_samples", self.max_train_samples, 0)
        _count_or_none("max_eval_samples", self.max_eval_samples, 0)
        check_choices(self)
        for name in ("text_column", "text_pair_column", "label_column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}={value!r}: expected a column name")


@dataclass(frozen=True)
class OptimizationSettings:
    """How the weights step: the optimizer and its schedule (DeepSpeed's blocks), the clipping, the weights' dtype
    and the loss the gradients are taken of."""

    lr: float = setting(1e-3, "peak learning rate", ds="optimizer.params.lr", hf=("learning_rate",))
    optimizer: dict[str, Any] = field(default_factory=_adamw, metadata={"ds": "optimizer"})  # its lr is `lr`
    scheduler: dict[str, Any] | None = field(default_factory=_warmup_decay, metadata={"ds": "scheduler"})  # None:
    # a constant lr
    loss_average: str = setting("tokens", "a causal LM's loss over a step: tokens (HF Trainer's: summed over every "
                                        "target token of the step's micro-batches and replicas, divided by their "
                                        "count) or micro_batches (the mean of each micro-batch's mean, which weighs "
                                        "a chat micro-batch of 5 assistant tokens as one of 500); the same for LM "
                                        "blocks", choices=LOSS_AVERAGES, older="micro_batches")
    gradient_clipping: float = setting(1.0, "clip the global gradient norm to this (0: off)", ds="gradient_clipping",
                                       hf=("max_grad_norm",))
    param_dtype: str = setting("float32", "the weights' dtype: float32 (master weights, whatever the checkpoint's "
                                        "dtype) or bfloat16 (bf16 weights and gradients, float32 Adam moments, "
                                        "stochastic rounding: 12 bytes a parameter instead of 16; Adam or AdamW)",
                              older="float32")

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise ValueError(f"lr={self.lr!r}: expected a positive learning rate")
        kind = self.optimizer.get("type")
        if self.param_dtype not in PARAM_DTYPES:
            expected = "float32 or bfloat16" + (" (float16 weights need a loss scaler, which aqpipe does not have)"
                                                if self.param_dtype == "float16" else "")
            raise ValueError(f"param_dtype={self.param_dtype!r}: expected {expected}")
        if self.param_dtype == "bfloat16" and kind not in ("Adam", "AdamW"):
            raise ValueError(f"param_dtype=bfloat16 with optimizer {kind!r}: expected Adam or AdamW (their moments "
                             "are kept in float32 beside bf16 weights)")
        others = sorted(set(self.optimizer.get("params", {})) - {"betas", "eps", "weight_decay"})
        if self.param_dtype == "bfloat16" and others:
            raise ValueError(f"param_dtype=bfloat16 with optimizer params {', '.join(others)}: expected only betas, "
                             "eps and weight_decay (bf16 weights step through aqpipe's own Adam)")
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer type {kind!r}: expected one of {', '.join(OPTIMIZERS)}")
        if self.scheduler is not None and self.scheduler.get("type") not in SCHEDULERS:
            raise ValueError(f"scheduler type {self.scheduler.get('type')!r}: expected one of "
                             f"{', '.join(SCHEDULERS)}")
        check_choices(self)
        if not self.gradient_clipping >= 0:
            raise ValueError(f"gradient_clipping={self.gradient_clipping}: expected >= 0")


@dataclass(frozen=True)
class CheckpointingSettings:
    """Where the run's results go, how often it saves a resumable checkpoint, and where it resumes from."""

    output_dir: str = setting("runs/latest", "where metrics, summary and the fine-tuned model go", resume=FREE)
    save_every: int = setting(0, "write a resumable checkpoint every N steps and at the end (0: never)",
                              resume=FREE, hf=("save_steps",))
    save_total_limit: int = setting(2, "keep only the N newest checkpoints (0: all)", resume=FREE)
    copy_checkpoints: bool = setting(True, "where ranks save to different machines' disks (no shared filesystem), "
                                           "also copy each rank's checkpoint files to the next machine at every "
                                           "save, so a machine that comes back empty resumes from there (each "
                                           "rank's checkpoint crosses the link once a save); --no_copy_checkpoints "
                                           "keeps each machine's files on it alone", resume=FREE)
    overwrite_output_dir: bool = setting(False, "replace another run's results (summary, metrics, model, "
                                              "checkpoints) in --output_dir", resume=FREE)
    save_on_signal: bool = setting(True, "on SIGTERM (a cloud's spot warning, SLURM's or a launcher's stop) or "
                                         "SIGUSR1 (SLURM's --signal): finish the step in flight, save it on every rank "
                                         "and stop (status 143 after SIGTERM, 0 after SIGUSR1); off: SIGTERM stops at "
                                         "once, as Ctrl-C does", resume=FREE)
    signal_grace: float = setting(25.0, "seconds the save on a signal may take before the run stops without it "
                                        "(clouds warn 30-120 s ahead; torchrun and deepspeed kill their workers 30 s "
                                        "after passing a SIGTERM on)", resume=FREE)
    resume: str | None = setting(None, "continue from a checkpoint: latest (under --output_dir; the default with no "
                                     "value), auto (latest if there is one, else start fresh), or a checkpoint "
                                     "directory", const="latest", resume=FREE, hf=("resume_from_checkpoint",))

    def __post_init__(self) -> None:
        check_int("save_every", self.save_every, 0)
        check_int("save_total_limit", self.save_total_limit, 0)
        if isinstance(self.signal_grace, bool) or not isinstance(self.signal_grace, (int, float)) or \
                not 0 < self.signal_grace < float("inf"):
            raise ValueError(f"signal_grace={self.signal_grace!r}: expected a positive number of seconds")
        if self.overwrite_output_dir and self.resume is not None:
            raise ValueError(f"--overwrite_output_dir with --resume {self.resume}: expected one of them (replace "
                             "the results in output_dir, or continue the run that wrote them)")


@dataclass(frozen=True)
class DistributedSettings:
    """The processes: how many stages a pipeline has, how its schedule and blocks are laid out, and how the
    processes reach each other."""

    pipeline_stages: int | str = setting("auto", "stages per pipeline, or auto = world size / replicas (world = "
                                               "stages x replicas); a resume may change it (the checkpoint is "
                                               "resharded)", ds="pipeline.stages", resume=RESHAPES)
    schedule: str = setting("1f1b", f"one of {', '.join(SCHEDULES)}", ds="pipeline.schedule", choices=SCHEDULES)
    partition: list[int] | str = setting("auto", "blocks per stage: auto (the plan's, in proportion to each stage's "
                                                "speed, under --placement auto or a plan file; else parameters), "
                                                "parameters (balanced by parameter count), uniform, or "
                                                "comma-separated block counts", ds="pipeline.partition",
                                         resume=RESHAPES)
    placement: str = setting("rank", "which rank holds which stage of which replica: rank (stage s of replica r on "
                                     "rank r x stages + s, the launcher's numbering), auto (measure every machine's "
                                     "speed and link, or read --cluster, and place by the predicted step), or a plan "
                                     "file `aqpipe plan` wrote", resume=FREE)
    cluster: str | None = setting(None, "--placement auto: the machines' speeds and links from this file (YAML or "
                                        "JSON: aqpipe/plan/cluster.py) instead of measuring them", resume=FREE)
    placement_trials: int = setting(3, "--placement auto: of the placements the model prices within its error (15%%) "
                                       "of its best, this many are each played for two steps at start and the "
                                       "fastest measured is taken (1: the model's best alone)", resume=FREE)
    backend: str = setting("auto", "torch.distributed backend: nccl (one GPU per process), gloo (CPUs, or GPUs "
                                 "shared by several stages with tensors staged through host memory; TCP, the robust "
                                 "choice over a WAN) or auto (nccl where each process has a GPU of its own, else gloo)",
                           choices=BACKENDS, resume=FREE)
    dist_timeout: float = setting(45.0, "seconds a collective or receive may wait for a peer before the run stops "
                                      "(then ~6 s to exit)", resume=FREE)
    peer_timeout: float = setting(30.0, "seconds without a peer's heartbeat before it is taken for dead and the run "
                                      "stops", resume=FREE)

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_stages, str) and self.pipeline_stages != "auto":
            raise ValueError(f"pipeline_stages={self.pipeline_stages!r}: expected a positive integer or auto")
        if self.pipeline_stages != "auto":
            check_int("pipeline_stages", self.pipeline_stages, 1)
        check_choices(self)
        if self.partition not in ("auto", "parameters", "uniform") and not (
                isinstance(self.partition, list) and all(is_int(v) and v > 0 for v in self.partition)):
            raise ValueError(f"partition={self.partition!r}: expected auto, parameters, uniform, or block counts like "
                             "2,2")
        if not isinstance(self.placement, str) or not self.placement:
            raise ValueError(f"placement={self.placement!r}: expected rank, auto or a plan file")
        check_int("placement_trials", self.placement_trials, 1)
        if self.cluster is not None and self.placement != "auto":
            raise ValueError(f"cluster={self.cluster!r} with placement={self.placement!r}: expected --placement auto "
                             "(the cluster file is what it plans from)")
        for name in ("dist_timeout", "peer_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected a positive number of seconds")


@dataclass(frozen=True)
class RunConfig:
    """The run's own settings (its task and model, its batches and length, precision, evaluation), and its
    sections."""

    task: str  # "causal_lm" or "classification"
    model: str | None = setting(None, "HF hub name, local model directory, or a config.json (random init); "
                                    "default: a tiny shape", hf=("model_name_or_path",))
    dropout: float | None = setting(None, "every dropout probability of the model (embeddings, attention, residual, "
                                        "classifier); default: the model's own, 0.1 for HF GPT2 and DeBERTa",
                                  older=THIS_RUN)
    seed: int = setting(42, "seed of model init, data order and codecs")
    micro_batch_size: int = setting(4, "samples per micro-batch", ds="train_micro_batch_size_per_gpu",
                                    hf=("per_device_train_batch_size",))
    num_micro_batches: int = setting(4, "micro-batches per optimizer step (gradient accumulation)",
                                     ds="gradient_accumulation_steps", hf=("gradient_accumulation_steps",))
    epochs: int = setting(3, "passes over the training samples", resume=FREE,  # a resume stretches its LR plan
                          hf=("num_train_epochs",))
    max_steps: int | None = setting(None, "stop after this many optimizer steps", resume=FREE)
    eval_every: int = setting(0, "evaluate every N steps (0: at the end only)", resume=FREE, hf=("eval_steps",))
    report_to: str = setting("none", "where each step's figures go besides metrics.jsonl: none, tensorboard "
                                   "(<output_dir>/tensorboard), wandb or trackio, or several comma-separated",
                             resume=FREE)
    activation_checkpointing: bool = setting(False, "recompute blocks in backward",
                                             ds="pipeline.activation_checkpoint_interval", resume=FREE,
                                             hf=("gradient_checkpointing",))
    compile: bool = setting(False, "torch.compile each stage's forward whole, its head and loss included, and "
                                   "--param_dtype bfloat16's update (the first steps pay the compilation; dropout then "
                                   "seeded once a micro-batch and stage)",
                            resume=FREE)
    use_liger_kernel: bool = setting(False, "train a causal LM's loss with Liger Kernel's fused linear "
                                          "cross-entropy (pip install liger-kernel; a CUDA GPU): the logits never "
                                          "exist; training rows then log no token accuracy, as TRL's do",
                                     resume=FREE, older=False)
    bf16: bool = setting(False, "bfloat16 autocast and bf16 boundary activations", ds="bf16.enabled")
    compression_preset: str | None = setting(None, "a measured setting of every wire, under what is given "
                                                 "explicitly: wan (a link of about 100 Mbit/s: every wire about "
                                                 "37x below bf16 within 1%% of its loss, README)",
                                                 resume=FREE)  # the settings it stands for are each checked
    skip_nonfinite: bool = setting(False, "skip a step whose loss, activations or gradients hold NaN/inf (on every "
                                        "rank) instead of stopping", resume=FREE)
    data: DataSettings = field(default_factory=DataSettings)
    optimization: OptimizationSettings = field(default_factory=OptimizationSettings)
    checkpointing: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    compression: CompressionConfig = field(default_factory=_aqsgd)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self) -> None:
        """The run's own values, and the checks that span sections."""
        for name in ("micro_batch_size", "num_micro_batches", "epochs"):
            check_int(name, getattr(self, name), 1)
        check_int("eval_every", self.eval_every, 0)
        _count_or_none("max_steps", self.max_steps, 1)
        if self.dropout is not None and not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"dropout={self.dropout!r}: expected a probability in [0, 1)")
        if self.data.packing and self.task != "causal_lm":
            raise ValueError(f"packing with task {self.task}: expected causal-lm (chat or prompt/completion data)")
        if self.use_liger_kernel and self.task != "causal_lm":
            raise ValueError(f"use_liger_kernel with task {self.task}: expected causal-lm (it fuses an LM head's "
                             "loss)")
        if self.compile and self.distributed.schedule == "zb1":
            raise ValueError("compile=True with schedule='zb1': a compiled stage's backward is one step, which zb1's "
                             "split would run twice; expected schedule 1f1b or gpipe with --compile")

    @property
    def replicas(self) -> int:
        return self.data_parallel.replicas

    def to_dict(self) -> dict[str, Any]:
        """JSON values, the sections nested (a dtype by its name)."""
        out = asdict(self)
        out["compression"]["buffer_dtype"] = str(self.compression.buffer_dtype).removeprefix("torch.")
        return out

    def for_run(self, total_steps: int) -> "RunConfig":
        """The settings a run of `total_steps` records: with replicas an "auto" data-parallel warm-up resolved to its
        number (a checkpoint keeps it, so a resume with more epochs keeps it)."""
        if self.replicas < 2:
            return self
        steps = self.data_parallel.warmup_for(total_steps)
        return replace(self, data_parallel=replace(self.data_parallel, warmup_steps=steps))



SECTIONS: dict[str, type] = {"data": DataSettings, "optimization": OptimizationSettings,
                             "checkpointing": CheckpointingSettings, "distributed": DistributedSettings,
                             "compression": CompressionConfig, "data_parallel": DataParallelConfig,
                             "lora": LoraSettings}

def destinations() -> Iterator[tuple[str, Any]]:
    """("field" or "section.field", the field) for every setting of a run, in order: the run's own, then each
    section's."""
    for f in fields(RunConfig):
        if f.name in SECTIONS:
            yield from ((f"{f.name}.{g.name}", g) for g in fields(SECTIONS[f.name]))
        elif f.name != "task":
            yield f.name, f
