"""One training run, whichever launcher started it: config -> data -> stages -> engine -> outputs.

`deepspeed --num_gpus N`, `torchrun --nproc_per_node N` and plain `python` all end here:
the launchers set RANK / WORLD_SIZE / MASTER_ADDR (deepspeed also passes --local_rank),
plain python runs one process holding the whole model as a single stage.

Reliability: `--save_every N` checkpoints and `--resume` continue a run exactly (checkpoint.py);
in a multi-process run a watchdog (watchdog.py) and the failure path here make every rank stop
within a bounded time, naming the rank that failed, when one dies or raises.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

import data_parallel
from pipeline import Grid, PipelineEngine, build_groups, owned_parameters
from pipeline.partitioning import merge_into, partition, tie_groups

from . import checkpoint
from . import data as datalib
from . import faults
from .config import RunConfig
from .models import build_model, model_positions
from .tasks import Task
from .watchdog import Watchdog

SETUP_SECONDS = 1800  # barriers around work one rank does for all (data caches, the merged model)


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(cfg: RunConfig) -> World:
    """Join the process group the launcher described (gloo on CPU, NCCL on GPU), or run alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))  # config.resolve checked it is stages x replicas
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores among this machine's stages, not oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    if size > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.dist_timeout))
    return World(rank, size, local_rank, device)


def _barrier(world: World, timeout: float | None = None) -> None:
    """A barrier; `timeout` (gloo) outlasts the collective timeout while one rank works for all."""
    if not world.distributed:
        return
    if timeout is not None and dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout))
    else:
        dist.barrier()


def _datasets(cfg: RunConfig, task: Task, world: World) -> tuple[Any, Any, Any]:
    """Tokenizer, train and eval datasets; local rank 0 builds the caches first, the others read them."""
    def build() -> tuple[Any, Any, Any]:
        source = cfg.dataset or task.default_dataset
        # a model directory or hub name brings its own tokenizer; a config.json or the built-in shape does not
        own = cfg.model if cfg.model is not None and not os.path.isfile(cfg.model) else None
        corpus = None if own is not None and os.path.isdir(own) else datalib.fetch_shakespeare()
        tokenizer = datalib.load_tokenizer(own, corpus, cls_sep=task.kind == "classification")
        if task.kind == "causal_lm":
            kw = {"dataset_config": cfg.dataset_config}
            train = datalib.lm_dataset(source, tokenizer, cfg.seq_len, split="train", **kw)
            evaluation = datalib.lm_dataset(source, tokenizer, cfg.seq_len, split="eval", **kw)
        else:
            train = datalib.classification_dataset(source, tokenizer, cfg.seq_len, split="train", seed=cfg.seed)
            evaluation = datalib.classification_dataset(source, tokenizer, cfg.seq_len, split="eval", seed=cfg.seed)
        return tokenizer, datalib.limit(train, cfg.max_train_samples or None), \
            datalib.limit(evaluation, cfg.max_eval_samples or None)  # 0: all

    if world.local_rank != 0:
        _barrier(world, SETUP_SECONDS)
    result = build()
    if world.local_rank == 0:
        _barrier(world, SETUP_SECONDS)
    return result


def _optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    kind = cfg.optimizer["type"]
    kwargs = {k: v for k, v in cfg.optimizer.get("params", {}).items() if k != "lr"}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return getattr(torch.optim, kind)(params, lr=cfg.lr, **kwargs)


def _scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """DeepSpeed's own LR schedulers, with "auto" filled from the run (total steps, peak lr)."""
    if cfg.scheduler is None:
        return None
    from deepspeed.runtime import lr_schedules

    params = dict(cfg.scheduler.get("params", {}))
    fills = {"total_num_steps": total_steps, "warmup_max_lr": cfg.lr, "warmup_num_steps": max(1, total_steps // 10)}
    for key, value in fills.items():
        if params.get(key) == "auto" or (key == "total_num_steps" and key not in params
                                         and cfg.scheduler["type"] != "WarmupLR"):
            params[key] = value
    return getattr(lr_schedules, cfg.scheduler["type"])(optimizer, **params)


class MetricsWriter:
    """metrics.jsonl (one object per step) and a progress bar, on rank 0 only."""

    def __init__(self, cfg: RunConfig, world: World, total_steps: int, resumed_step: int | None = None,
                 elapsed: float = 0.0) -> None:
        """`resumed_step`: keep the records up to that step (a resumed run appends from there)."""
        self.active = world.rank == 0
        self.start = time.perf_counter() - elapsed  # times continue across a resume
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        if self.active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._records_until(resumed_step) if resumed_step is not None else []
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
            self.bar = tqdm(total=total_steps, initial=resumed_step or 0, desc="train", unit="step",
                            dynamic_ncols=True)

    def _records_until(self, step: int) -> list[str]:
        """The training records of steps <= step: no duplicates once the resumed run writes its own."""
        if not self.path.is_file():
            return []
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash
                continue
            if record.get("step", 0) < step or (record.get("step") == step and "lr" in record):
                kept.append(line)
        return kept

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        record = {**record, "time": round(time.perf_counter() - self.start, 3)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if "lr" in record:  # a training step (eval-only records have no lr)
            self.bar.update(1)
            if "loss" in record:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", fwd_MB=f"{record['fwd_bytes'] / 1e6:.2f}")

    def close(self) -> None:
        if self.active:
            self.bar.close()


def _evaluate(engine: PipelineEngine, batches: list[list[dict]], task: Task) -> dict[str, float]:
    results = [engine.eval_batch(mbs) for mbs in batches]
    loss = sum(r["loss"] for r in results) / len(results)
    out = {"eval_loss": loss}
    if task.kind == "causal_lm":
        out["eval_perplexity"] = math.exp(min(loss, 50.0))
    else:
        out["eval_accuracy"] = sum(r.get("accuracy", 0.0) for r in results) / len(results)
    return out


def _save(model_factory: Callable[[], Any], engine: PipelineEngine, tokenizer: Any, cfg: RunConfig, world: World,
          groups: Any) -> str | None:
    """Merge every stage's weights (replica 0) into one HF model on rank 0 and save_pretrained it.

    Each stage writes its part into the output directory (shared by every rank, as checkpoints need) and
    rank 0 reads them after a barrier: the weights never cross the pipeline's links, where a slow one would
    take minutes (GPT2's 51 MB tied head at 5 Mbit/s: 85 s, past the collective timeout). A tied weight
    comes from its owner's copy."""
    out = Path(cfg.output_dir)
    parts = out / "model.parts"
    if groups.replica == 0:
        parts.mkdir(parents=True, exist_ok=True)
        checkpoint.write_state(parts / f"stage{groups.stage}.pt",
                               {k: v.detach().cpu() for k, v in engine.hf_state_dict().items()})
    _barrier(world, SETUP_SECONDS)
    if world.rank != 0:
        return None
    pieces = [checkpoint.read_state(parts / f"stage{s}.pt") for s in range(groups.grid.stages)]
    target, tmp = out / "model", out / "model.partial"
    model = merge_into(model_factory(), pieces)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)  # never leave a half-written model where a loader looks
    shutil.rmtree(parts)
    return str(target)


def run(task: Task, cfg: RunConfig) -> dict[str, Any]:
    """One run; in a multi-process run any failure ends this process with a line naming rank and stage."""
    world = init_world(cfg)
    prog = Path(sys.argv[0]).name or "aqpipe"
    watchdog = None
    try:
        if world.distributed:
            watchdog = Watchdog(world.rank, world.size, _describer(cfg), prog, peer_timeout=cfg.peer_timeout).start()
        summary = _train(task, cfg, world)
    except (Exception, KeyboardInterrupt) as exc:
        if world.distributed:
            _stop_after_failure(exc, world, cfg, watchdog, prog)
        raise
    if watchdog is not None:
        watchdog.stop()
    if world.distributed:
        _barrier(world, SETUP_SECONDS)  # rank 0 may still be writing the merged model
        dist.destroy_process_group()
    return summary


def _describer(cfg: RunConfig) -> Callable[[int], str]:
    stages = int(cfg.pipeline_stages)
    return lambda rank: f"stage {rank % stages}, replica {rank // stages}"


def _is_comm_error(exc: BaseException) -> bool:
    """A failed send, receive or collective: usually the consequence of another rank's failure."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                            "timed out", "gloo/transport", "NCCL"))


def _stop_after_failure(exc: BaseException, world: World, cfg: RunConfig, watchdog: Watchdog | None,
                        prog: str) -> None:
    """Tell the other ranks, say what failed where in one line, and end this process (status 2 for bad input
    found late, 1 otherwise) without waiting on peers that may never answer."""
    me = f"rank {world.rank} ({_describer(cfg)(world.rank)})"
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    code = 1
    if _is_comm_error(exc) and watchdog is not None:
        watchdog.wait_for_verdict()  # exits this process once it names the rank that failed
        line = f"{me} stopping: communication with its peers failed and no peer reported a failure: {first_line}"
        watchdog.report(f"stopped after a communication error: {first_line}")
    else:
        if watchdog is not None:
            watchdog.report(f"{type(exc).__name__}: {first_line}")
        expected = isinstance(exc, (ValueError, FileNotFoundError, FloatingPointError, KeyboardInterrupt))
        if not expected or os.environ.get("AQPIPE_TRACEBACK"):
            traceback.print_exception(exc)
        code = 2 if isinstance(exc, (ValueError, FileNotFoundError)) else 1
        line = f"{me} failed: {type(exc).__name__}: {first_line}"
    print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _train(task: Task, cfg: RunConfig, world: World) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    tokenizer, train_set, eval_set = _datasets(cfg, task, world)
    num_labels = getattr(train_set, "num_labels", None)
    positions = model_positions(cfg.model, task.family)
    if positions is not None and cfg.seq_len > positions:  # a hub model not cached when the config was checked
        raise ValueError(f"seq_len={cfg.seq_len}: the model has {positions} positions")

    def model_factory() -> Any:
        return build_model(cfg.model, task.family, task.kind, tokenizer, cfg.seq_len, num_labels, cfg.seed)

    stages = partition(model_factory(), cfg.pipeline_stages, cfg.partition, cfg.activation_checkpointing)
    grid = Grid.for_world(world.size, cfg.pipeline_stages)
    ties = tie_groups(stages)
    groups = build_groups(grid, world.rank)
    stage = stages[groups.stage].to(world.device)
    del stages

    shard = (groups.replica, grid.replicas)
    per_epoch = datalib.steps_per_epoch(train_set, cfg.micro_batch_size, cfg.num_micro_batches, grid.replicas)
    total_steps = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    # a tied weight is stepped by its owner alone; the other copies take its rows each step (pipeline/ties.py)
    optimizer = _optimizer(cfg, owned_parameters(stage, ties))
    algorithm = None
    if grid.replicas > 1:
        comm = data_parallel.Comm(groups.data_parallel, grid.data_parallel_ranks(groups.stage))
        algorithm = cfg.data_parallel.create(owned_parameters(stage, ties), comm, cfg.seed)
    engine = PipelineEngine(
        stage, groups, optimizer, compression=cfg.compression,
        num_samples=datalib.shard_size(len(train_set), grid.replicas), seq_len=cfg.seq_len,
        lr_scheduler=None, gradient_clipping=cfg.gradient_clipping, schedule=cfg.schedule, ties=ties,
        device=world.device, bf16=cfg.bf16, seed=cfg.seed, data_parallel=algorithm,
        skip_nonfinite=cfg.skip_nonfinite,
    )
    engine.lr_scheduler = _scheduler(cfg, engine.optimizer, total_steps)  # on the optimizer actually stepped
    to_device = _mover(world.device)
    eval_batches = [[to_device(mb) for mb in step]
                    for step in datalib.sequential_batches(eval_set, cfg.micro_batch_size, cfg.num_micro_batches)]

    progress: dict[str, Any] = {
        "epoch": 0, "index": 0, "step": 0, "elapsed": 0.0, "losses": [], "evals": {},
        "totals": {"fwd_bytes": 0, "bwd_bytes": 0, "tie_bytes": 0, "dp_bytes": 0},
    }
    if cfg.resume:  # last: the RNG states it restores are those of the saved run at that step
        progress = checkpoint.load(Path(cfg.resume), engine, cfg)
    injector = faults.Injector(faults.from_env(), world.rank, stage)
    writer = MetricsWriter(cfg, world, total_steps, progress["step"] if cfg.resume else None, progress["elapsed"])
    samples_per_step = cfg.micro_batch_size * cfg.num_micro_batches * grid.replicas
    totals, losses, evals = dict(progress["totals"]), list(progress["losses"]), dict(progress["evals"])
    started = time.perf_counter() - progress["elapsed"]
    step, saved = progress["step"], progress["step"]
    position = (progress["epoch"], progress["index"])

    def save() -> None:
        state = {"epoch": position[0], "index": position[1], "step": step, "losses": losses[-10:], "evals": evals,
                 "totals": totals, "elapsed": time.perf_counter() - started}
        checkpoint.save(Path(cfg.output_dir) / "checkpoints", step, engine, state, cfg, world.rank, world.size,
                        lambda: _barrier(world, SETUP_SECONDS), cfg.save_total_limit)

    for epoch in range(progress["epoch"], cfg.epochs):
        done = progress["index"] if epoch == progress["epoch"] else 0  # steps of this epoch before the resume
        batches = datalib.micro_batches(train_set, cfg.micro_batch_size, cfg.num_micro_batches, epoch=epoch,
                                        seed=cfg.seed, shard=shard)
        for index, mbs in enumerate(itertools.islice(batches, done, None), start=done):
            if step >= total_steps:
                break
            injector.before_step(step + 1)
            loss = engine.train_batch([to_device(mb) for mb in mbs], epoch)
            step, position = step + 1, (epoch, index + 1)
            m = engine.last_metrics
            for key in totals:
                totals[key] += m[key]
            record = {k: m[k] for k in ("step", "epoch", "lr", "phase", *totals)}
            if "skipped" in m:
                record["skipped"] = m["skipped"]
            else:
                losses.append(loss)
                record.update(loss=loss, grad_norm=m["grad_norm"])
            record["samples_per_s"] = samples_per_step / m["seconds"]
            if cfg.eval_every and step % cfg.eval_every == 0 and eval_batches:
                evals = _evaluate(engine, eval_batches, task)
                record.update(evals)
            writer.write(record)
            if cfg.save_every and step % cfg.save_every == 0:
                save()
                saved = step
    if cfg.save_every and saved != step:
        save()  # the end of the run is a checkpoint too: a later resume with more epochs continues from it
    if eval_batches and not (cfg.eval_every and step % cfg.eval_every == 0):
        evals = _evaluate(engine, eval_batches, task)
        writer.write({"step": step, **evals})
    writer.close()
    elapsed = time.perf_counter() - started
    saved_model = _save(model_factory, engine, tokenizer, cfg, world, groups)
    summary = {
        "steps": step, "epochs": cfg.epochs, "train_samples": len(train_set), "eval_samples": len(eval_set),
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        **evals, **totals, "seconds": elapsed, "samples_per_s": samples_per_step * step / elapsed if elapsed else None,
        "world_size": world.size, "model_dir": saved_model, "skipped_steps": engine.skipped_steps,
        "resumed_from": cfg.resume, "config": cfg.to_dict(),
    }
    if world.rank == 0:
        with open(Path(cfg.output_dir) / "summary.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
        print(json.dumps({k: summary[k] for k in ("steps", "final_loss", *evals, "fwd_bytes", "bwd_bytes", "seconds")}))
    return summary


def _mover(device: torch.device) -> Callable[[dict], dict]:
    if device.type == "cpu":
        return lambda mb: mb
    return lambda mb: {k: v.to(device, non_blocking=True) for k, v in mb.items()}
