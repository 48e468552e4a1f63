"""Tiny regression data and helpers shared by the data-parallel algorithm tests."""
import torch


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step + 17)
    x = torch.randn(16, 8, generator=g)
    return x, torch.randn(16, 4, generator=g) + rank  # replicas see different targets: their gradients differ


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
