"""Adam(W) for bfloat16 weights with float32 moments: `--param_dtype bfloat16`, for memory.

torch's Adam keeps its moments in the parameter's dtype, and bfloat16 moments (8 bits of mantissa) lose the small
second moments; float32 master weights would cost more than they save. Here the weights and their gradients stay
bfloat16 (2 + 2 bytes a parameter), the two moments float32 (8 bytes): 12 bytes a parameter against 16 for float32
training. Each step computes the update in float32 and writes the weight back with stochastic rounding, so an update
smaller than bfloat16's step is kept in expectation instead of lost (round-to-nearest would drop it every time).
The rounding's random bits come from (seed, step, parameter index): a resumed run draws what the uninterrupted one
drew, with nothing but the step in the state.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from aqpipe.pipeline.seeding import derive_seed


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """float32 `x` as bfloat16, rounded up or down with the probabilities that keep its expectation: random bits
    added below bfloat16's mantissa, then cut off (exact in bfloat16)."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(dtype)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay; `decoupled=False`: Adam's L2 in the gradient) over low-precision weights,
    moments in float32; the `torch.optim.AdamW` arguments."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, decoupled: bool = True, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.decoupled, self.seed = decoupled, seed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts every floating state to its parameter's dtype: the moments are put back as saved,
        float32 (a bf16 round trip would lose what they are kept in float32 for)."""
        moments = {i: {k: v for k, v in s.items() if k != "step"} for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for i, saved in moments.items():
            for key, value in saved.items():
                self.state[params[i]][key] = value.to(params[i].device, torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        index = 0
        for group in self.param_groups:
            (beta1, beta2), lr, eps, decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = int(state["step"])
                x, grad = p.float(), p.grad.float()
                if decay and self.decoupled:
                    x.mul_(1 - lr * decay)
                elif decay:
                    grad = grad.add(x, alpha=decay)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
                x.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
                generator = torch.Generator(device=p.device).manual_seed(derive_seed(self.seed, t, index))
                p.copy_(round_stochastic(x, p.dtype, generator))
        return loss
