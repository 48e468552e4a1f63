"""The DeepSpeed baseline: our GPT2 recipe's model and data, trained by DeepSpeed's own pipeline engine.

    deepspeed --num_gpus 2 --module benchmarks.deepspeed_pipeline [recipe flags]
    torchrun --nproc_per_node 2 -m benchmarks.deepspeed_pipeline [recipe flags]
    # one process per node (e.g. one network namespace per stage), on node I of 2, with a hostfile H
    # of two lines "<name> slots=1" and the master's address A (add GLOO_SOCKET_IFNAME=<if> to pick a link):
    deepspeed --hostfile H --no_ssh --node_rank I --master_addr A --master_port P \
        --module benchmarks.deepspeed_pipeline [recipe flags]
    torchrun --nnodes 2 --nproc_per_node 1 --node_rank I --master_addr A --master_port P \
        -m benchmarks.deepspeed_pipeline [recipe flags]
    # FP32 at the recipe's default shape, next to ours:
    torchrun --nproc_per_node 2 recipes/finetune_gpt2.py --forward_compress none --backward_compress none

The flags are the recipe's (recipes/finetune_gpt2.py --help), parsed by the same code with the same
default settings (aqpipe gpt2 --print_config): --model, --seq_len, --micro_batch_size, --num_micro_batches,
--max_train_samples, --epochs, --max_steps, --lr, --seed, --output_dir, --pipeline_stages, --partition
mean what they mean there. Same model (aqpipe.models.build_model, same seed, weights copied into the
layers), same split of blocks across stages (pipeline.partition), same micro-batches in the same order
(aqpipe.data.micro_batches), same AdamW, LR schedule and clipping; with dropout off, step 1's loss
equals our engine's. DeepSpeed sends FP32 activations: the recipe's compression settings are ignored.

Runs on CPU over gloo: DS_ACCELERATOR defaults to cpu here (DeepSpeed's CPU accelerator picks gloo when
oneCCL is not installed) and the process group is gloo, whichever launcher started us. Output as the
recipe's: OUTPUT_DIR/metrics.jsonl (one line per step: step, epoch, loss, lr, seconds, samples_per_s,
fwd_bytes, bwd_bytes, tie_bytes, grad_norm (the global norm DeepSpeed's FP32 clipping computes), time) and
OUTPUT_DIR/summary.json, written by rank 0 (DeepSpeed broadcasts the loss from the last stage to every
stage). fwd_bytes / bwd_bytes / tie_bytes are the FP32 payload of the boundary
tensors and of the tied wte gradient, computed from their shapes, not counted on the wire.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its accelerator once
# DeepSpeed broadcasts tied weights in place at start-up; the gradients are right, torch just warns in backward
warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.ds_gpt2_layers import gpt2_layer_specs, is_tied  # noqa: E402
from aqpipe.pipeline.partitioning import stage_block_counts  # noqa: E402
from aqpipe import data as datalib  # noqa: E402
from aqpipe.config import RunConfig  # noqa: E402
from aqpipe.settings import resolve  # noqa: E402
from aqpipe.tasks import TASKS  # noqa: E402
from aqpipe.models import model_positions, resolve_model  # noqa: E402
from aqpipe.train import build_datasets, build_optimizer, build_scheduler  # noqa: E402
from aqpipe.world import World  # noqa: E402

TASK = TASKS["gpt2"]


def init_world(cfg: RunConfig) -> World:
    """Join the launcher's group over gloo (a lone `python` run becomes a world of one), then hand the
    group to DeepSpeed, which wraps an existing torch.distributed group instead of making its own."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    if "OMP_NUM_THREADS" not in os.environ:  # as the recipe: share this machine's cores among its stages
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.distributed.dist_timeout))
    deepspeed.init_distributed(dist_backend="gloo")
    return World(rank, size, local_rank, torch.device("cpu"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_supported(cfg: RunConfig) -> None:
    """What this baseline does not reproduce is refused up front rather than silently differing."""
    if cfg.replicas != 1:
        raise ValueError(f"replicas={cfg.replicas}: the DeepSpeed baseline runs one pipeline (replicas=1)")
    if cfg.bf16:
        raise ValueError("bf16: the DeepSpeed baseline is FP32 only")
    if cfg.activation_checkpointing:
        raise ValueError("activation_checkpointing: not reproduced by the DeepSpeed baseline")
    if cfg.distributed.schedule != "1f1b":
        raise ValueError(f"schedule={cfg.distributed.schedule!r}: DeepSpeed's pipeline engine runs its own 1F1B "
                         "schedule")


def count_every_stage_in_clip_norm(module: Any) -> None:
    """Make DeepSpeed clip by the whole pipeline's gradient norm, as our engine does.

    DeepSpeed's FP32 path (runtime.utils.clip_grad_norm_) sums squared norms over the pipeline's ranks
    but counts a parameter only on pipeline rank 0 or when it carries Megatron's `model_parallel` flag:
    unmarked, every stage would clip by stage 0's norm alone. Marking each stage's parameters, except
    the tied copies DeepSpeed itself counts once (`ds_pipe_replicated`), gives the global norm with a
    tied weight counted once. It changes no traffic: the same one-float all-reduce runs either way.
    """
    for p in module.parameters():
        if not getattr(p, "ds_pipe_replicated", False):
            p.model_parallel = True


def keep_clip_norms(engine: Any) -> list[float]:
    """DeepSpeed's FP32 clipping computes the global gradient norm and drops it: make the same call
    (`runtime.utils.clip_grad_norm_`, same arguments) and keep what it returns, one norm per step."""
    from deepspeed.runtime.utils import clip_grad_norm_

    norms: list[float] = []

    def clip_fp32_gradients() -> None:
        norms.append(float(clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                                           mpu=engine.mpu)))

    engine.clip_fp32_gradients = clip_fp32_gradients
    return norms


def ds_config(cfg: RunConfig) -> dict[str, Any]:
    """DeepSpeed's config for the same batch and clipping; the optimizer and scheduler come as objects
    (a torch AdamW, not FusedAdam, which compiles for 40 s and is not what our engine steps)."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.num_micro_batches,
        "train_batch_size": cfg.micro_batch_size * cfg.num_micro_batches,
        "gradient_clipping": cfg.optimization.gradient_clipping,
        "steps_per_print": 10 ** 9,  # our metrics.jsonl is the log
        "wall_clock_breakdown": False,
    }


def feed(micro_batches: list[dict[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One step's micro-batches as DeepSpeed reads them: (first stage's input, last stage's labels)."""
    return iter([(mb["input_ids"], mb["labels"]) for mb in micro_batches])


def run(cfg: RunConfig) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    check_supported(cfg)
    world = init_world(cfg)
    torch.manual_seed(cfg.seed)
    tokenizer, train_set, _ = build_datasets(cfg, TASK, world)
    positions = model_positions(cfg.model)
    if positions is not None and cfg.data.seq_len > positions:
        raise ValueError(f"seq_len={cfg.data.seq_len}: the model has {positions} positions")
    # the values our stages start from (per-stage loading or the seeded init), as one HF model
    model = resolve_model(cfg.model, TASK.shape, TASK.kind, tokenizer, cfg.data.seq_len, None, dropout=cfg.dropout
                          ).full_model(cfg.seed)
    counts = stage_block_counts(model, cfg.distributed.pipeline_stages, cfg.distributed.partition)
    specs, loss_fn, method = gpt2_layer_specs(model, counts)
    module = PipelineModule(specs, num_stages=cfg.distributed.pipeline_stages, loss_fn=loss_fn, partition_method=method)
    count_every_stage_in_clip_norm(module)
    hidden_size, seq_len = model.config.n_embd, cfg.data.seq_len
    # each holder of the tied wte sends its gradient into DeepSpeed's all-reduce, as ours counts it
    tied = is_tied(model) and cfg.distributed.pipeline_stages > 1
    tie_bytes = 2 * 4 * model.transformer.wte.weight.numel() if tied else 0
    del model, specs

    per_epoch = datalib.steps_per_epoch(train_set, cfg.micro_batch_size, cfg.num_micro_batches)
    total_steps = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    optimizer = build_optimizer(cfg, module.parameters())
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config(cfg))
    norms = keep_clip_norms(engine)
    if world.rank == 0 and (cfg.compression.forward != "none" or cfg.compression.backward != "none"):
        print("deepspeed_pipeline: DeepSpeed sends FP32 activations; compression settings ignored", flush=True)

    samples_per_step = cfg.micro_batch_size * cfg.num_micro_batches
    boundary_bytes = samples_per_step * seq_len * hidden_size * 4 * (cfg.distributed.pipeline_stages - 1)
    writer = Metrics(Path(cfg.checkpointing.output_dir), active=world.rank == 0)
    losses: list[float] = []
    started = time.perf_counter()
    step = 0
    for epoch in range(cfg.epochs):
        for mbs in datalib.micro_batches(train_set, cfg.micro_batch_size, cfg.num_micro_batches, epoch=epoch,
                                         seed=cfg.seed):
            if step >= total_steps:
                break
            lr = optimizer.param_groups[0]["lr"]  # before this step's update, as the recipe logs it
            begin = time.perf_counter()
            loss = float(engine.train_batch(feed(mbs)))
            seconds = time.perf_counter() - begin
            step += 1
            losses.append(loss)
            writer.write({"step": step, "epoch": epoch, "loss": loss, "lr": lr,
                          "grad_norm": norms[-1] if cfg.optimization.gradient_clipping > 0 else None, "phase": "train",
                          "fwd_bytes": boundary_bytes, "bwd_bytes": boundary_bytes, "tie_bytes": tie_bytes,
                          "seconds": seconds,
                          "samples_per_s": samples_per_step / seconds})
    elapsed = time.perf_counter() - started
    summary = {
        "engine": "deepspeed", "steps": step, "epochs": cfg.epochs, "train_samples": len(train_set),
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "fwd_bytes": boundary_bytes * step, "bwd_bytes": boundary_bytes * step, "tie_bytes": tie_bytes * step,
        "seconds": elapsed,
        "samples_per_s": samples_per_step * step / elapsed if elapsed else None, "world_size": world.size,
        "block_counts": counts, "deepspeed_parts": [int(v) for v in engine.module.parts], "config": cfg.to_dict(),
    }
    if world.rank == 0:
        (Path(cfg.checkpointing.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print(json.dumps({k: summary[k] for k in ("steps", "final_loss", "seconds", "samples_per_s")}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return summary


class Metrics:
    """metrics.jsonl, one object per step, with the recipe's field names ("time": seconds since start)."""

    def __init__(self, output_dir: Path, active: bool) -> None:
        self.active, self.start, self.path = active, time.perf_counter(), output_dir / "metrics.jsonl"
        if active:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.active:
            record = {**record, "time": round(time.perf_counter() - self.start, 3)}
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the recipe's flags (over the gpt2 task's defaults, which its config states), run, and report late bad
    input as one line with status 2, as the recipe does."""
    cfg = resolve(TASK.kind, sys.argv[1:] if argv is None else argv, __doc__, defaults=TASK.defaults)
    try:
        return run(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
