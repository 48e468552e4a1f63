"""Shared test helpers, by what they serve: processes on gloo, a toy pipeline, a toy for the data-parallel tests.

The tests are laid out by what they start: `unit/` (one process, seconds), `multiprocess/` (gloo process
groups spawned in-process), `e2e/` (the launchers, recipes, benchmarks and an installed wheel as users run
them). Each folder's tests carry its name as a marker: `pytest -m unit` runs the quick ones.
Worker functions run in spawned processes import these helpers by their module name, `tests.conftest`.
"""
from __future__ import annotations

import csv
import io
import json
import os
import socket
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipeline import Tie

ROOT = Path(__file__).resolve().parents[1]  # the checkout
LAYERS = ("unit", "multiprocess", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its folder's name (unit, multiprocess, e2e)."""
    for item in items:
        layer = item.path.parent.name
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))


# ---------------------------------------------------------------------------------------------- processes
def checkout_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: it imports this checkout (first on PYTHONPATH), not an installed
    copy or whatever else the caller's path holds; one thread per process; unbuffered output. `extra` overrides."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        buf = io.BytesIO()  # bytes, not shared-memory tensors: those vanish when this process exits
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, buf.getvalue(), None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, so the parent sees why, and exit non-zero
        queue.put((rank, None, traceback.format_exc()))
        raise


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns the results by rank.

    Raises naming the rank that failed: an error it reported (also one reported after its result, at the closing
    barrier), or a process that ended with a status other than 0 (one that `os._exit`s after returning, say)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world:
            rank, value, error = queue.get(timeout=timeout)
            if error:
                errors.setdefault(rank, error)
                break  # the others may wait for it forever
            results[rank] = value
        for p in procs:
            p.join(timeout=30 if not errors else 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    while True:  # late reports: an error at the closing barrier comes after the rank's result
        try:
            rank, _, error = queue.get(timeout=0.5)
        except Exception:  # noqa: BLE001 - queue.Empty: drained
            break
        if error:
            errors.setdefault(rank, error)
    if errors:  # every rank that reported one, the cause first: a peer's lost connection is a consequence
        echo = ("Connection reset by peer", "Connection closed by peer", "Timed out")
        ranks = sorted(errors, key=lambda r: any(e in errors[r] for e in echo))
        raise RuntimeError("\n".join(f"rank {r} failed:\n{errors[r]}" for r in ranks))
    for rank, p in enumerate(procs):
        if p.exitcode != 0:
            raise RuntimeError(f"rank {rank} failed: its process ended with status {p.exitcode}")
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world)]  # our own workers' results


def tiny_gpt2_config(tmp_path: Path) -> str:
    """A 2-block, width-64 GPT2 config.json without dropout (runs compare losses exactly), for --model."""
    from transformers import GPT2Config  # here: spawned workers import this module and need no transformers

    path = tmp_path / "gpt2-tiny" / "config.json"
    path.parent.mkdir(parents=True)
    GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0).to_json_file(path)
    return str(path)


# ---------------------------------------------------------------------------------------------- a toy pipeline
VOCAB, HIDDEN = 40, 16


class Output(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class ToyStage(nn.Module):
    def __init__(self, index: int, num_stages: int, blocks: list[nn.Linear], embed: torch.Tensor) -> None:
        super().__init__()
        self.stage_index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.hidden_size = embed.shape[1]
        self.blocks = nn.ModuleList(blocks)
        self.embed = nn.Parameter(embed.clone()) if (self.is_first or self.is_last) else None

    def forward(self, hidden, batch, seed=None):
        h = self.embed[batch["input_ids"]] if self.is_first else hidden
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        if not self.is_last:
            return h
        logits = h @ self.embed.t()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))
        return Output(loss, logits)

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        return {"embed": self.embed} if self.embed is not None else {}

    def tied_lookups(self) -> dict[str, tuple[str, ...]]:
        return {"embed": ("input_ids",)} if self.embed is not None and not self.is_last else {}


def toy_stages(num_stages: int, num_blocks: int = 4, seed: int = 0, hidden: int = HIDDEN) -> list[ToyStage]:
    """The same model (seeded) split into contiguous groups of blocks."""
    torch.manual_seed(seed)
    embed = torch.randn(VOCAB, hidden) * 0.5
    blocks = [nn.Linear(hidden, hidden) for _ in range(num_blocks)]
    bounds = [num_blocks * s // num_stages for s in range(num_stages + 1)]
    return [ToyStage(s, num_stages, blocks[bounds[s]:bounds[s + 1]], embed) for s in range(num_stages)]


def toy_ties(num_stages: int) -> dict[str, Tie]:
    """The embedding, looked up on stage 0 and used whole as the head on the last stage (its owner)."""
    return {"embed": Tie((0, num_stages - 1), {0: ("input_ids",)})} if num_stages > 1 else {}


def toy_tokens(num_samples: int, seq_len: int) -> torch.Tensor:
    """Deterministic token sequences with a learnable pattern."""
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (num_samples, 1), generator=g)
    return (starts + torch.arange(seq_len) * 3) % VOCAB


def toy_dataset(num_samples: int, seq_len: int):
    """The toy sequences as a dataset for the trainer's data layer (aqpipe.data.micro_batches and its shards)."""
    from aqpipe.data import TensorDictDataset

    data = toy_tokens(num_samples, seq_len)
    return TensorDictDataset({"input_ids": data, "labels": data, "sample_id": torch.arange(num_samples)},
                             seq_len=seq_len, split="train")


def toy_batches(num_samples: int, seq_len: int, micro_batch_size: int, num_micro_batches: int, epoch: int):
    """The toy sequences shuffled per epoch (one replica); sample_id = dataset index."""
    data = toy_tokens(num_samples, seq_len)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(epoch))
    per_step = micro_batch_size * num_micro_batches
    for step in range(num_samples // per_step):
        ids = order[step * per_step:(step + 1) * per_step]
        yield [{"input_ids": data[i], "labels": data[i], "sample_id": i}
               for i in ids.split(micro_batch_size)]


# ---------------------------------------------------------------------------------------------- a data-parallel toy
def dp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step + 17)
    x = torch.randn(16, 8, generator=g)
    return x, torch.randn(16, 4, generator=g) + rank  # replicas see different targets: their gradients differ


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = dp_batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train_steps(model: torch.nn.Module, algo, opt: torch.optim.Optimizer, rank: int, steps, on_step=None) -> None:
    """The engine's order around one step: backward, after_backward, optimizer step, after_step, on_step()."""
    for t in steps:
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        algo.after_backward()
        opt.step()
        algo.after_step()
        if on_step is not None:
            on_step()


def saved_states(model: torch.nn.Module, algo, opt: torch.optim.Optimizer) -> dict:
    """Model, algorithm and optimizer state through a torch.save/torch.load round trip, as a checkpoint."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "algo": algo.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def straight_and_saved(build, rank: int, total: int, cut: int) -> tuple[tuple, dict]:
    """An uninterrupted run of `total` steps from build(), and the checkpoint of a second run stopped at `cut`."""
    straight, first = build(), build()
    train_steps(*straight, rank, range(total))
    train_steps(*first, rank, range(cut))
    return straight, saved_states(*first)


def restored(build, saved: dict) -> tuple:
    """A fresh (model, algorithm, optimizer) from build() with a checkpoint's states loaded."""
    model, algo, opt = build()
    model.load_state_dict(saved["model"])
    algo.load_state_dict(saved["algo"])
    opt.load_state_dict(saved["opt"])
    return model, algo, opt


# ---------------------------------------------------------------------------------------------- data files
def write_table(path: Path, rows: list[dict]) -> Path:
    """`rows` as the file a user brings, by its suffix: csv, json (one list), jsonl or parquet."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path
