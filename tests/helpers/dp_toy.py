"""A toy for the data-parallel tests: replicas on different targets, and their training steps around an algorithm's
hooks, in the engine's order."""
from __future__ import annotations

import io

import torch


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
