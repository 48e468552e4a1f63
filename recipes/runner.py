"""One training run, whichever launcher started it: config -> data -> stages -> engine -> outputs.

`deepspeed --num_gpus N`, `torchrun --nproc_per_node N` and plain `python` all end here:
the launchers set RANK / WORLD_SIZE / MASTER_ADDR (deepspeed also passes --local_rank),
plain python runs one process holding the whole model as a single stage.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

import data_parallel
from pipeline import CompressionConfig, Grid, PipelineEngine, build_groups, owned_parameters
from pipeline.partition import merge_into, partition, tie_groups

from . import data as datalib
from .config import RunConfig, dp_options, resolve
from .models import build_model, model_positions


@dataclass
class Task:
    """What differs between the recipes: the model family, the data, the eval metric."""

    kind: str  # "causal_lm" or "classification"
    family: str  # "gpt2" or "deberta"
    default_dataset: str | None


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


def _barrier(world: World) -> None:
    if world.distributed:
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
        _barrier(world)
    result = build()
    if world.local_rank == 0:
        _barrier(world)
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

    def __init__(self, cfg: RunConfig, world: World, total_steps: int) -> None:
        self.active = world.rank == 0
        self.start = time.perf_counter()
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        if self.active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        record = {**record, "time": round(time.perf_counter() - self.start, 3)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if "loss" in record:
            self.bar.update(1)
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


def _save(model_factory: Callable[[], Any], stage: Any, tokenizer: Any, cfg: RunConfig, world: World,
          groups: Any) -> str | None:
    """Gather every stage's weights (replica 0) on rank 0, merge them into one HF model, save_pretrained."""
    state = {k: v.detach().cpu() for k, v in stage.hf_state_dict().items()}
    if world.distributed:
        pieces = [None] * world.size if world.rank == 0 else None
        dist.gather_object(state if groups.replica == 0 else {}, pieces, dst=0)
    else:
        pieces = [state]
    if world.rank != 0:
        return None
    target = Path(cfg.output_dir) / "model"
    tmp = target.with_name("model.partial")
    model = merge_into(model_factory(), [p for p in pieces if p])
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        import shutil
        shutil.rmtree(target)
    os.replace(tmp, target)  # never leave a half-written model where a loader looks
    return str(target)


def run(task: Task, cfg: RunConfig) -> dict[str, Any]:
    world = init_world(cfg)
    torch.manual_seed(cfg.seed)
    tokenizer, train_set, eval_set = _datasets(cfg, task, world)
    num_labels = getattr(train_set, "num_labels", None)
    positions = model_positions(cfg.model, task.family)
    if positions is not None and cfg.seq_len > positions:
        raise ValueError(f"seq_len={cfg.seq_len}: the model has {positions} positions")

    def model_factory() -> Any:
        return build_model(cfg.model, task.family, task.kind, tokenizer, cfg.seq_len, num_labels, cfg.seed)

    stages = partition(model_factory(), cfg.pipeline_stages, cfg.partition, cfg.activation_checkpointing)
    grid = Grid.for_world(world.size, cfg.pipeline_stages)
    ties = tie_groups(stages)
    groups = build_groups(grid, world.rank, ties)
    stage = stages[groups.stage].to(world.device)
    del stages

    shard = (groups.replica, grid.replicas)
    per_epoch = datalib.steps_per_epoch(train_set, cfg.micro_batch_size, cfg.num_micro_batches, grid.replicas)
    total_steps = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    # with replicas, tied copies that follow their owner take its values each step instead of an update
    optimizer = _optimizer(cfg, owned_parameters(stage, ties) if grid.replicas > 1 else stage.parameters())
    compression = CompressionConfig(
        forward=cfg.forward_compress, forward_bits=cfg.forward_bits, backward=cfg.backward_compress,
        backward_bits=cfg.backward_bits, warmup_epochs=cfg.warmup_epochs,
        buffer_dtype=getattr(torch, cfg.buffer_dtype), buffer_dir=cfg.buffer_dir,
    )
    algorithm = None
    if grid.replicas > 1:
        comm = data_parallel.Comm(groups.data_parallel, grid.data_parallel_ranks(groups.stage))
        algorithm = data_parallel.create(cfg.dp_algorithm, owned_parameters(stage, ties), comm, **dp_options(cfg))
    engine = PipelineEngine(
        stage, groups, optimizer, compression=compression, num_samples=len(train_set), seq_len=cfg.seq_len,
        lr_scheduler=None, gradient_clipping=cfg.gradient_clipping, schedule=cfg.schedule, ties=ties,
        device=world.device, bf16=cfg.bf16, seed=cfg.seed, data_parallel=algorithm,
    )
    engine.lr_scheduler = _scheduler(cfg, engine.optimizer, total_steps)  # on the optimizer actually stepped
    to_device = _mover(world.device)
    eval_batches = [[to_device(mb) for mb in step]
                    for step in datalib.sequential_batches(eval_set, cfg.micro_batch_size, cfg.num_micro_batches)]

    writer = MetricsWriter(cfg, world, total_steps)
    samples_per_step = cfg.micro_batch_size * cfg.num_micro_batches * grid.replicas
    totals = {"fwd_bytes": 0, "bwd_bytes": 0, "tie_bytes": 0, "dp_bytes": 0}
    losses, evals = [], {}
    started = time.perf_counter()
    step = 0
    for epoch in range(cfg.epochs):
        for mbs in datalib.micro_batches(train_set, cfg.micro_batch_size, cfg.num_micro_batches, epoch=epoch,
                                         seed=cfg.seed, shard=shard):
            if step >= total_steps:
                break
            loss = engine.train_batch([to_device(mb) for mb in mbs], epoch)
            step += 1
            m = engine.last_metrics
            losses.append(loss)
            for key in totals:
                totals[key] += m[key]
            record = {k: m[k] for k in ("step", "epoch", "loss", "lr", "grad_norm", "phase", *totals)}
            record["samples_per_s"] = samples_per_step / m["seconds"]
            if cfg.eval_every and step % cfg.eval_every == 0 and eval_batches:
                evals = _evaluate(engine, eval_batches, task)
                record.update(evals)
            writer.write(record)
    if eval_batches and not (cfg.eval_every and step % cfg.eval_every == 0):
        evals = _evaluate(engine, eval_batches, task)
        writer.write({"step": step, **evals})
    writer.close()
    elapsed = time.perf_counter() - started
    saved = _save(model_factory, stage, tokenizer, cfg, world, groups)
    summary = {
        "steps": step, "epochs": cfg.epochs, "train_samples": len(train_set), "eval_samples": len(eval_set),
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        **evals, **totals, "seconds": elapsed, "samples_per_s": samples_per_step * step / elapsed if elapsed else None,
        "world_size": world.size, "model_dir": saved, "config": cfg.to_dict(),
    }
    if world.rank == 0:
        with open(Path(cfg.output_dir) / "summary.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
        print(json.dumps({k: summary[k] for k in ("steps", "final_loss", *evals, "fwd_bytes", "bwd_bytes", "seconds")}))
    if world.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def _mover(device: torch.device) -> Callable[[dict], dict]:
    if device.type == "cpu":
        return lambda mb: mb
    return lambda mb: {k: v.to(device, non_blocking=True) for k, v in mb.items()}


def main(task: Task, default_config: Path, description: str, argv: list[str] | None = None) -> dict[str, Any]:
    """A recipe's entry point: its default config file unless the user names one, then run."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--deepspeed_config", "--config") for a in argv):
        argv = ["--deepspeed_config", str(default_config), *argv]
    cfg = resolve(task.kind, argv, description)
    try:
        return run(task, cfg)
    except (ValueError, FileNotFoundError) as exc:  # bad input found late (data, model): one line, status 2
        if os.environ.get("AQPIPE_TRACEBACK"):
            raise
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(2) from None
