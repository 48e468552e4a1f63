"""The training loop, read top to bottom in `train`: data -> stages -> engine -> steps -> outputs.

`run` wraps it for any launcher (world.py: the process group, the watchdog, the failure path);
`--save_every N` checkpoints and `--resume` continues exactly (checkpoint.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from aqpipe import data_parallel
from aqpipe.pipeline import PipelineEngine, EngineSettings, build_groups, owned_parameters
from aqpipe.pipeline.lora import add_lora, lora_config
from aqpipe.pipeline.quantized_base import FourBit

from aqpipe.compression import derive_seed, row_nbytes

from . import buffer_plan, checkpoint, preflight
from . import data as datalib
from . import faults, interrupts, reshape
from .config import RunConfig
from .dealing import dealing
from .environment import check_liger, launch
from .export import save_adapter, save_model
from .lr_plan import PlannedLR
from .metrics import MetricsWriter, evaluate, step_record
from .optim import LowPrecisionAdamW
from .plan.seat import fixed_blocks, rank_order, seat
from .progress import Progress
from .checkpoint_copies import fetch_slots, storage_groups
from .host_memory import release_freed_memory
from .storage import Storage
from .storage import detect as detect_storage
from .models import ModelSpec, model_positions, resolve_model, set_dropout
from .tasks import Task
from .trainer_flags import HF_SCHEDULES, warmup_steps
from .world import World, barrier, init_world, stop_after_failure, watched


def build_datasets(cfg: RunConfig, task: Task, world: World, data: Any = None) -> tuple[Any, Any, Any]:
    """Tokenizer, train and eval datasets (from `data`, a user's `datasets.Dataset`, where given); local rank 0
    builds the caches first, the others read them."""
    def build() -> tuple[Any, Any, Any]:
        source = data if data is not None else cfg.data.dataset or task.default_dataset
        # a model directory or hub name brings its own tokenizer; a config.json or the built-in shape does not
        own = cfg.model if cfg.model is not None and not os.path.isfile(cfg.model) else None
        corpus = None if own is not None and os.path.isdir(own) else datalib.fetch_shakespeare()
        tokenizer = datalib.apply_chat_template_setting(
            datalib.load_tokenizer(own, corpus, cls_sep=task.kind == "classification"), cfg.data.chat_template)
        # without --eval_dataset the last eval_fraction of the source is held out; with one, each is used whole
        held = {"eval_fraction": 0.0 if cfg.data.eval_dataset else cfg.data.eval_fraction}
        held_out = (cfg.data.eval_dataset, {"eval_fraction": 1.0}) if cfg.data.eval_dataset else (source, held)
        if task.kind == "causal_lm":
            kw = {"dataset_config": cfg.data.dataset_config, "text_column": cfg.data.text_column,
                  "packing": cfg.data.packing, "packing_overflow": cfg.data.packing_overflow,
                  "assistant_only_loss": cfg.data.assistant_only_loss,
                  "completion_only_loss": cfg.data.completion_only_loss}
            make = datalib.lm_dataset
        else:
            kw = {"seed": cfg.seed, "text_column": cfg.data.text_column, "text_pair_column": cfg.data.text_pair_column,
                  "label_column": cfg.data.label_column}
            make = datalib.classification_dataset
        train = make(source, tokenizer, cfg.data.seq_len, split="train", **held, **kw)
        evaluation = make(held_out[0], tokenizer, cfg.data.seq_len, split="eval", **held_out[1], **kw)
        limited = datalib.limit(train, cfg.data.max_train_samples or None), \
            datalib.limit(evaluation, cfg.data.max_eval_samples or None)  # 0: all
        if world.rank == 0:
            replicas = max(1, world.size // cfg.distributed.pipeline_stages)
            print(data_line(cfg, len(train), len(evaluation), *map(len, limited), getattr(train, "cut", 0),
                            len(limited[0]) % replicas), file=sys.stderr)
        return (tokenizer, *limited)

    if world.local_rank != 0:
        barrier(world)
    result = build()
    if world.local_rank == 0:
        barrier(world)
    return result


def data_line(cfg: RunConfig, train: int, evaluation: int, kept_train: int, kept_eval: int, cut: int = 0,
              left_out: int = 0) -> str:
    """The split a run trains and evaluates on, any cap that cut it, chat rows cut to seq_len, and the samples no
    replica trains on (`left_out`: replicas hold equal shards, so that every one takes as many steps), in one
    line. An epoch's last, partial batch is trained on."""
    def part(kept: int, total: int, flag: str) -> str:
        return f"{kept} of {total} samples (--{flag} {kept})" if kept < total else f"{total} samples"

    held = f"--eval_dataset {cfg.data.eval_dataset}" if cfg.data.eval_dataset else \
        f"the last {cfg.data.eval_fraction:g} of it"
    packed = " (packed)" if cfg.data.packing else ""
    cuts = f"; {cut} rows longer than seq_len={cfg.data.seq_len} cut to fit (--packing_overflow error refuses them)" \
        if cut else ""
    left = f"; {left_out} training samples left out (replicas train on equal shards)" if left_out else ""
    return (f"data: train {part(kept_train, train, 'max_train_samples')}, eval "
            f"{part(kept_eval, evaluation, 'max_eval_samples')}{packed} from {held}{cuts}{left}")


FUSED = ("Adam", "AdamW", "SGD")  # torch's optimizers with a fused CUDA kernel


def build_optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    """The run's optimizer over `params`: torch's by name (fused on a GPU unless the config says fused/foreach),
    or bf16 weights' own."""
    kind = cfg.optimization.optimizer["type"]
    kwargs = {k: v for k, v in cfg.optimization.optimizer.get("params", {}).items() if k != "lr"}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if cfg.optimization.param_dtype == "bfloat16":  # bf16 weights: float32 moments, stochastic rounding (optim.py)
        kwargs.setdefault("weight_decay", 1e-2 if kind == "AdamW" else 0.0)
        return LowPrecisionAdamW(params, lr=cfg.optimization.lr, decoupled=kind == "AdamW", seed=cfg.seed,
                                 compile_backend="inductor" if cfg.compile else None, **kwargs)
    params = list(params)
    if kind in FUSED and not {"fused", "foreach"} & set(kwargs) and params and \
            all(p.device.type == "cuda" for p in params):
        kwargs["fused"] = True  # one kernel for every parameter's update: torch's fastest, on a GPU
    return getattr(torch.optim, kind)(params, lr=cfg.optimization.lr, **kwargs)


def build_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> PlannedLR | None:
    """The run's LR plan (lr_plan.py) from DeepSpeed's schedulers, "auto" filled from the run (total steps, peak lr),
    or transformers' by their --lr_scheduler_type names (optimizer step k runs at the schedule's step k - 1, as in
    HF's Trainer)."""
    if cfg.optimization.scheduler is None:
        return None
    kind, params = cfg.optimization.scheduler["type"], dict(cfg.optimization.scheduler.get("params", {}))
    if kind in HF_SCHEDULES:
        from transformers import get_scheduler  # deferred: transformers' import is seconds; only this path needs it

        def schedule(opt: torch.optim.Optimizer, total: int) -> Any:
            return get_scheduler(kind, opt, num_training_steps=total, num_warmup_steps=warmup_steps(params, total))
        return PlannedLR(optimizer, schedule, total_steps, cfg.optimization.lr)
    if not torch.cuda.is_available():  # tell DeepSpeed what we know, or it probes and warns that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules

    def deepspeed_schedule(opt: torch.optim.Optimizer, total: int) -> Any:
        filled = dict(params)
        fills = {"total_num_steps": total + 1, "warmup_max_lr": cfg.optimization.lr,
                 "warmup_num_steps": max(1, total // 10)}
        for key, value in fills.items():
            if filled.get(key) == "auto" or (key == "total_num_steps" and key not in filled and kind != "WarmupLR"):
                filled[key] = value
        # DeepSpeed's schedules give warmup_min_lr at iterations -1 and 0, and read the lr before the first step (a
        # warning): starting at iteration 0 and stepping once makes step k run at iteration k, so step 1 learns
        scheduler = getattr(lr_schedules, kind)(opt, last_batch_iteration=0, **filled)
        scheduler.step()
        return scheduler
    return PlannedLR(optimizer, deepspeed_schedule, total_steps, cfg.optimization.lr)


def run(task: Task, cfg: RunConfig, prog: str | None = None, data: Any = None) -> dict[str, Any]:
    """One run; in a multi-process run any failure ends this process with a line naming rank and stage. `data`: a
    `datasets.Dataset` / `DatasetDict` given in place of `cfg.data.dataset`."""
    prog = prog or Path(sys.argv[0]).name or "aqpipe"  # the name failure lines start with
    try:
        world = init_world(cfg)
    except RuntimeError as exc:  # a peer that never came (it stopped on bad input of its own, or never started)
        raise SystemExit(f"{prog}: error: rank {launch().rank} could not join the process group within "
                         f"dist_timeout={cfg.distributed.dist_timeout:g} s: "
                         f"{(str(exc).strip().splitlines() or [''])[0][:200]}")
    watchdog = None
    who = f"{prog}: rank {world.rank}" if world.distributed else prog
    # Ctrl-C (and a launcher's SIGTERM with --no_save_on_signal): one line a rank, status 130; a spot warning's
    # SIGTERM or SIGUSR1: the step in flight saved, status 143 or 0
    with interrupts.caught(cfg.checkpointing.save_on_signal, cfg.checkpointing.signal_grace, who):
        try:
            world = watched(world, cfg, prog)
            watchdog = world.watchdog
            summary = train(task, cfg, world, data)
            barrier(world)  # rank 0 may still be writing the merged model
        except interrupts.SavedOnSignal as stopped:
            interrupts.say(f"{who}: stopped: {stopped}; --resume continues the run from it")
            if watchdog is not None:
                watchdog.stop()
            if world.distributed:
                dist.destroy_process_group()
            raise SystemExit(stopped.status) from None
        except (Exception, KeyboardInterrupt) as exc:
            if world.distributed:
                stop_after_failure(exc, world, cfg, watchdog, prog)
            if interrupts.received(settle_s=0) is not None:  # one process: its line (cli), whatever the signal broke
                raise KeyboardInterrupt from None
            raise
    if watchdog is not None:
        watchdog.stop()
    if world.distributed:
        dist.destroy_process_group()
    return summary


def clear_previous_results(cfg: RunConfig, storage: Storage) -> None:
    """--overwrite_output_dir: one rank of each storage removes another run's results there, before anything is
    written (no rank wrote yet)."""
    if cfg.checkpointing.overwrite_output_dir and storage.finalizer:
        for name in preflight.previous_results(cfg.checkpointing.output_dir):
            path = Path(cfg.checkpointing.output_dir) / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def model_spec(cfg: RunConfig, task: Task, tokenizer: Any, train_set: Any) -> ModelSpec:
    """What every rank builds its stage from, sized to the tokenizer and labelled as the data is."""
    positions = model_positions(cfg.model)
    if positions is not None and cfg.data.seq_len > positions:  # a hub model not cached when the config was checked
        raise ValueError(f"seq_len={cfg.data.seq_len}: the model has {positions} positions")
    return resolve_model(cfg.model, task.shape, task.kind, tokenizer, cfg.data.seq_len,
                         getattr(train_set, "num_labels", None), getattr(train_set, "label_names", None), cfg.dropout,
                         frozen=cfg.lora.enabled)


def idle_codecs(cfg: RunConfig) -> str:
    """The boundary codecs a run asked for, as flags (empty where none): what a single stage cannot use."""
    c = cfg.compression
    return ", ".join(f"--{flag} {mode}" for flag, mode in (("forward_compress", c.forward),
                                                           ("backward_compress", c.backward)) if mode != "none")


def plan_buffers(cfg: RunConfig, world: World, train_set: Any, total_steps: int, spec: ModelSpec, rows: int,
                 keep_saved: bool = True) -> buffer_plan.BufferPlan | None:
    """Which samples keep AQ-SGD rows, and where this rank's live (buffer_plan.py), as the resumed checkpoint's run
    planned where it can (`keep_saved`: it had this run's shards); None without AQ-SGD boundaries. `rows`: the ids
    the buffers index, past the shard's a regrouped epoch's, each visited once (dealing.py). Rank 0 says it in one
    line."""
    c, grid = cfg.compression, world.grid
    if c.forward != "aqsgd" or grid.stages == 1:
        return None
    stage, replica = grid.coords(world.rank)
    shares = cfg.data_parallel.unequal_shares()

    def visits(r: int) -> np.ndarray:  # regrouped: as if the run had these shards throughout
        return datalib.visit_counts(train_set, cfg.micro_batch_size, cfg.num_micro_batches, cfg.seed, grid.replicas,
                                    total_steps, last="keep", shares=shares, index=r)
    every = [visits(r) for r in range(grid.replicas)] if shares else None  # equal shares: each replica's alike
    counts = every[replica] if every else visits(replica)
    counts = np.concatenate([counts, np.ones(rows - len(counts), dtype=counts.dtype)])
    everyone = np.concatenate(every) if every else None
    row = row_nbytes((cfg.data.seq_len, spec.config.hidden_size), c.buffer_dtype, c.buffer_bits)
    form = f"{c.buffer_bits}-bit" if c.buffer_bits else str(c.buffer_dtype).removeprefix("torch.")
    resumed = Path(cfg.checkpointing.resume) if cfg.checkpointing.resume else None
    plan = buffer_plan.plan(cfg, world, counts, int(stage > 0) + int(stage < grid.stages - 1), row, form,
                            checkpoint.saved_buffer_plan(resumed) if keep_saved else None, replica, everyone)
    if plan.line:
        print(plan.line, file=sys.stderr)
    return plan


def build_engine(cfg: RunConfig, spec: ModelSpec, world: World, num_samples: int, total_steps: int,
                 adapters: Any = None, buffers: buffer_plan.BufferPlan | None = None) -> PipelineEngine:
    """This rank's stage alone (built on the meta device, its own tensors read: aqpipe/pipeline/loading.py), with LoRA
    `adapters` (a PEFT LoraConfig: aqpipe/pipeline/lora.py) over a base frozen in its checkpoint's dtype; its optimizer
    and LR schedule, its replicas' algorithm, and the engine that trains it, its AQ-SGD buffers as `buffers` plans
    (None: a row for every sample, where the settings put them)."""
    if world.grid is None:  # a caller that did not seat the run (tests): rank order
        world.grid, cfg = rank_order(cfg, world.size)
    grid = world.grid
    groups = build_groups(grid, world.rank, world.transport)
    pace = world.link_matrix.pace if world.link_matrix is not None else None
    groups.pace = pace
    trained = getattr(torch, cfg.optimization.param_dtype)
    # the frozen base in its checkpoint's dtype, but float16's (which computes only with a loss scaler) in float32
    frozen = torch.float32 if spec.dtype == torch.float16 else spec.dtype
    try:
        four_bit = FourBit(cfg.lora.bnb_4bit_quant_type, cfg.lora.use_bnb_nested_quant, frozen) \
            if cfg.lora.load_in_4bit else None
        stage, ties, _ = spec.build_stage(groups.stage, grid.stages, partition_method=cfg.distributed.partition,
                                          seed=cfg.seed,
                                          dtype=frozen if adapters is not None else trained, device=world.device,
                                          activation_checkpointing=cfg.activation_checkpointing, four_bit=four_bit)
    except ValueError as exc:  # the library names its argument; a user typed the flag (a hub model preflight
        # could not read before it was fetched)
        raise ValueError(str(exc).replace("num_stages=", "pipeline_stages=")) from None
    if cfg.dropout is not None:
        set_dropout(stage, None, float(cfg.dropout))
    if adapters is not None:  # after the dropout: the adapters' own is --lora_dropout
        add_lora(stage, adapters, cfg.seed, trained)
    release_freed_memory()  # what reading (and quantizing) the stage freed, not held for the run
    if cfg.use_liger_kernel:  # before compiling: the compiled forward takes the loss it will run
        check_liger(world.device)
        stage.use_fused_loss("liger")
    if cfg.compile:
        stage.compile()  # in place: the stage's names, state_dict and attributes stay its own
    barrier(world)  # every stage built (a model download takes what it takes) before the first message
    # a tied weight is stepped by its owner alone; the other copies take its rows each step (aqpipe/pipeline/ties.py)
    optimizer, algorithm = build_optimizer(cfg, owned_parameters(stage, ties)), None
    if grid.replicas > 1:
        comm = data_parallel.Comm(groups.data_parallel, grid.data_parallel_ranks(groups.stage), world.transport, pace)
        # each stage's algorithm draws its own streams (flat.worker_seed adds the replica to this one)
        seed = derive_seed(cfg.seed, "data_parallel", "stage", groups.stage)
        algorithm = cfg.data_parallel.create(owned_parameters(stage, ties), comm, seed, total_steps)
        if world.rank == 0 and (plan := cfg.data_parallel.plan(total_steps)):
            print(plan, file=sys.stderr)
        optimizer = algorithm.wrap_optimizer(optimizer)  # QAdam steps with its own
    if world.rank == 0 and grid.stages == 1 and (idle := idle_codecs(cfg)):
        print(f"{idle}: one stage has no boundary to compress, so they send nothing in this run "
              "(--pipeline_stages 2 or more to use them)", file=sys.stderr)
    return PipelineEngine(stage, groups, optimizer,
                          EngineSettings(num_samples=num_samples, seq_len=cfg.data.seq_len,
                                         gradient_clipping=cfg.optimization.gradient_clipping,
                                         schedule=cfg.distributed.schedule,
                                         device=world.device, bf16=cfg.bf16, seed=cfg.seed,
                                         skip_nonfinite=cfg.skip_nonfinite, link_latency_s=world.link_latency_s,
                                         link_mbit=world.link_mbit, link_matrix=world.link_matrix,
                                         compute_slowdown=world.compute_slowdown,
                                         stop_asked=lambda: interrupts.save_asked() is not None,
                                         loss_average=cfg.optimization.loss_average,
                                         buffer_keep=None if buffers is None else buffers.keep),
                          compression=cfg.compression if buffers is None else
                          dataclasses.replace(cfg.compression, buffer_dir=buffers.directory),
                          lr_scheduler=build_scheduler(cfg, optimizer, total_steps),
                          ties=ties, data_parallel=algorithm)


def missing_dirs(directory: str | os.PathLike) -> list[Path]:
    """`directory` and those of its parents that do not exist yet, deepest first: what a run creates."""
    out = []
    for path in (Path(directory).absolute(), *Path(directory).absolute().parents):
        if path.exists():
            break
        out.append(path)
    return out


def train(task: Task, cfg: RunConfig, world: World, data: Any = None) -> dict[str, Any]:
    """One run; its scratch (AQ-SGD buffer files) goes when it ends, however it ends, and one refused (bad data, a
    model that does not fit, ...) removes the folders it created while they are still empty."""
    created, scratch = missing_dirs(cfg.checkpointing.output_dir), []
    try:
        try:
            return _train(task, cfg, world, data, scratch)
        finally:
            for drop in scratch:
                drop()
    except BaseException:
        for path in created:
            with contextlib.suppress(OSError):  # not empty (results were written), or another rank's already
                path.rmdir()
        raise


def _train(task: Task, cfg: RunConfig, world: World, data: Any = None,
           scratch: list[Callable[[], None]] | None = None) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    storage = detect_storage(cfg.checkpointing.output_dir, world)  # which ranks write where this one writes
    clear_previous_results(cfg, storage)
    checkpoints = Path(cfg.checkpointing.output_dir) / "checkpoints"
    resumed = checkpoint.agree(Path(cfg.checkpointing.resume) if cfg.checkpointing.resume else None, checkpoints, world,
                               storage)
    if resumed is not None:  # a machine given its files by a peer (checkpoint_copies.py) resolves its settings now
        cfg = checkpoint.check_compatible(resumed, cfg)
    cfg = dataclasses.replace(cfg, checkpointing=dataclasses.replace(
        cfg.checkpointing, resume=str(resumed) if resumed is not None else None))
    keepers = storage_groups(storage, world) if cfg.checkpointing.copy_checkpoints else None
    tokenizer, train_set, eval_set = build_datasets(cfg, task, world, data)
    spec = model_spec(cfg, task, tokenizer, train_set)
    cfg, reading = place_ranks(cfg, world, spec, resumed, storage)
    stages, replicas = world.grid.stages, world.grid.replicas
    manifest = checkpoint.read_manifest(resumed) if resumed is not None else {}  # where it stopped, how it dealt
    deals = dealing(cfg, train_set, (world.grid.coords(world.rank)[1], replicas), manifest,
                    reading is not None and reading.regroups, world.rank == 0)
    total_steps = deals.total_steps(cfg.epochs, cfg.max_steps, manifest.get("position"), manifest.get("step", 0))
    cfg = cfg.for_run(total_steps)
    adapters = None if not cfg.lora.enabled else lora_config(
        spec.model_class, spec.config, cfg.lora, task.kind == "classification", stages, cfg.distributed.partition)
    buffers = plan_buffers(cfg, world, train_set, total_steps, spec, deals.rows,
                           keep_saved=reading is None or not reading.regroups)
    engine = build_engine(cfg, spec, world, deals.rows, total_steps, adapters, buffers)
    if scratch is not None:
        made = None if cfg.compression.buffer_dir else buffer_plan.buffer_directory(cfg)  # a --buffer_dir stays
        scratch.append(lambda: drop_buffer_files(engine, made))
    eval_batches = [list(step) for step in datalib.sequential_batches(eval_set, cfg.micro_batch_size,
                                                                      cfg.num_micro_batches)]
    progress = Progress()
    if cfg.checkpointing.resume:  # last: the RNG states it restores are those of the saved run at that step
        progress.load_state_dict(checkpoint.load(Path(cfg.checkpointing.resume), engine, None, reading))
    injector = faults.Injector(faults.from_env(), world.rank, engine.stage)
    writer = MetricsWriter(cfg, world, total_steps, progress.step if cfg.checkpointing.resume else None,
                           progress.elapsed)
    samples_per_step = cfg.micro_batch_size * cfg.num_micro_batches * replicas
    started, saved = time.perf_counter() - progress.elapsed, progress.step

    def save(last: bool = False) -> None:
        nonlocal saved
        checkpoint.save(checkpoints, progress.step, engine, progress.state_dict(), cfg, world, storage,
                        cfg.checkpointing.save_total_limit or None, last, buffers.note if buffers else None, keepers)
        saved = progress.step

    for epoch in range(progress.epoch, cfg.epochs):
        done, progress.dealing = progress.done_in(epoch), deals.note(epoch)
        for index, mbs in enumerate(deals.batches(epoch, done), start=done):
            if progress.step >= total_steps:
                break
            injector.before_step(progress.step + 1)
            m = engine.train_batch(mbs, epoch)  # host batches: the step stages them (micro_batch.py)
            samples = deals.step_samples(epoch, index + 1)
            progress.add(m, epoch, index + 1, time.perf_counter() - started, samples)
            record = step_record(m, samples, progress.num_tokens)
            if cfg.eval_every and progress.step % cfg.eval_every == 0 and eval_batches:
                progress.evals, progress.eval_step = evaluate(engine, eval_batches, task, progress), progress.step
                record.update(progress.evals)
            writer.write(record)
            # the last step's checkpoint waits for its evaluation, below
            every = cfg.checkpointing.save_every
            if (every and progress.step % every == 0 and progress.step < total_steps) or m.stop:
                save()
            if m.stop:  # a spot warning reached some rank: every rank saved this step, and stops
                writer.close()
                interrupts.stop_after_save(progress.step, checkpoints)
    if eval_batches and progress.eval_step != progress.step:  # the last step's evaluation, unless it had one
        progress.evals, progress.eval_step = evaluate(engine, eval_batches, task, progress), progress.step
        writer.write({"step": progress.step, **progress.evals})
    if cfg.checkpointing.save_every and saved != progress.step:
        save(last=True)  # the end of the run is a checkpoint too (its evaluation in it): a resume with more epochs
        # goes on from it
    writer.close()
    elapsed = time.perf_counter() - started
    return summarize(cfg, world, progress, engine, elapsed, samples_per_step,
                     export(cfg, world, engine, spec, tokenizer, adapters, storage), (len(train_set), len(eval_set)))


def export(cfg: RunConfig, world: World, engine: PipelineEngine, spec: ModelSpec, tokenizer: Any, adapters: Any,
           storage: Storage) -> str | None:
    """The fine-tuned model (each stage its shard) where the run merges one, and LoRA's adapter; the model's
    directory (None: the adapter alone)."""
    model_dir = save_model(engine, spec, tokenizer, cfg, world, engine.groups, storage) \
        if adapters is None or cfg.lora.merges else None
    if adapters is not None:
        save_adapter(engine, adapters, cfg, world)
    return model_dir


def place_ranks(cfg: RunConfig, world: World, spec: ModelSpec, resumed: Path | None,
                storage: Storage) -> tuple[RunConfig, reshape.Reading | None]:
    """Who holds which (stage, replica), set as `world.grid`, and the settings with the blocks each stage takes
    (aqpipe/plan/seat.py); resuming, the files each rank's place reads brought to its machine (under another placement
    than the checkpoint's run had, its place's; on another shape, those of the old stages it is resharded from:
    reshape.py)."""
    world.grid, cfg, _ = seat(cfg, world, spec.model_class, spec.config)
    if resumed is None:
        return cfg, None
    stage, replica = world.grid.coords(world.rank)
    counts = fixed_blocks(cfg, spec.model_class, spec.config, world.grid.stages)
    reading = reshape.reading(checkpoint.read_manifest(resumed), counts, stage,
                              lambda: reshape.holds_tie(spec.model_class, spec.config, counts, stage),
                              world.grid.replicas)
    if reading is not None and world.rank == 0:
        print(reshape.describe(reading, world.grid.replicas), file=sys.stderr, flush=True)
    wanted = [(stage, replica)] if reading is None else \
        [(s, r) for s in reading.sources for r in range(reading.replicas)]
    fetch_slots(resumed, [checkpoint.rank_file(s, r) for s, r in wanted], world, storage)
    return cfg, reading


def drop_buffer_files(engine: PipelineEngine, made: Path | None) -> None:
    """The run's AQ-SGD buffer files once it ends: scratch as large as the rows, which no later run reads (a resume
    reads its checkpoint's copy); and the directory the run made for them (`made`) where nothing else is in it."""
    for buffer in engine.file_buffers().values():
        buffer.release()  # its blocks go with the last mapping of the file
        buffer.path.unlink(missing_ok=True)
    if made is not None:
        with contextlib.suppress(OSError):
            made.rmdir()


def summarize(cfg: RunConfig, world: World, progress: Progress, engine: PipelineEngine, elapsed: float,
              samples_per_step: int, model_dir: str | None, samples: tuple[int, int]) -> dict[str, Any]:
    """The run's summary: summary.json and, on rank 0, the one JSON line the run ends with."""
    losses, evals, step = progress.losses, progress.evals, progress.step
    summary = {
        "steps": step, "epochs": cfg.epochs, "train_samples": samples[0], "eval_samples": samples[1],
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        **evals, **progress.totals, "seconds": elapsed,
        "samples_per_s": (samples_per_step * step if progress.samples is None else progress.samples) / elapsed
        if elapsed else None, "world_size": world.size,
        "model_dir": model_dir, "skipped_steps": engine.skipped_steps, "resumed_from": cfg.checkpointing.resume,
        "config": cfg.to_dict(),
    }
    if world.rank == 0:
        with open(Path(cfg.checkpointing.output_dir) / "summary.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
        print(json.dumps({k: summary[k] for k in ("steps", "final_loss", *evals, "fwd_bytes", "bwd_bytes", "seconds")}))
    return summary
