"""Adam(W) for bfloat16 weights with float32 moments: `--param_dtype bfloat16`, for memory.

torch's Adam keeps its moments in the parameter's dtype, and bfloat16 moments (8 bits of mantissa) lose the small
second moments; float32 master weights would cost more than they save. Here the weights and their gradients stay
bfloat16 (2 + 2 bytes a parameter), the two moments float32 (8 bytes): 12 bytes a parameter against 16 for float32
training. Each step computes the update in float32 and writes the weight back with stochastic rounding, so an update
smaller than bfloat16's step is kept in expectation instead of lost (round-to-nearest would drop it every time).
The rounding's random bits come from (seed, step, parameter index): a resumed run draws what the uninterrupted one
drew, with nothing but the step in the state. Eager, a parameter's update is about fifteen passes over it (some
125 bytes a parameter read and written); with `--compile` it is one kernel (the bits drawn as before, then about 26
bytes read and written).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from aqpipe.pipeline.seeding import derive_seed


def rounding_bits(shape: torch.Size, device: torch.device, seed: int) -> torch.Tensor:
    """Stochastic rounding's random bits for one parameter, one step: 16 a value, from their own generator."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 1 << 16, shape, dtype=torch.int32, device=device, generator=generator)


def round_with(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 `x` cut to bfloat16's mantissa after `bits` are added below it: rounded up or down with the
    probabilities that keep its expectation (still float32, exact in bfloat16)."""
    return ((x.contiguous().view(torch.int32) + bits) & -65536).view(torch.float32)


SMALLEST_STEP = 1e-30  # a step size below it moves no float32 weight (and its divisor would not fit in float32)


def adamw_update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, bits: torch.Tensor | None,
                 beta1: float, beta2: float, shrink: float | None, l2: float | None, scale: float | None,
                 offset: float) -> None:
    """One parameter's step in float32, moments `m` and `v` updated in place, the weight written back to `p` through
    `bits` (stochastic rounding) or, without them, as its dtype rounds: the weight times `shrink` (decoupled decay),
    `l2` times it added to the gradient (Adam's L2), then x -= m / (sqrt(v) * scale + offset), which is AdamW's
    step with its size folded into the divisor (`scale` None: no step). A function of its arguments alone, so that
    torch.compile fuses it into one kernel (eager, it is about fifteen passes over the parameter). What changes
    from step to step enters as a tensor's factor, never as an op's `value=` (which would fix it in the graph and
    compile again every step), and the arithmetic on it is done before, in Python."""
    x, grad = p.float(), grad.float()
    if shrink is not None:
        x.mul_(shrink)
    if l2 is not None:
        grad = grad.add(x, alpha=l2)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    if scale is not None:
        x.addcdiv_(m, (v.sqrt() * scale).add_(offset), value=-1.0)
    p.copy_(x if bits is None else round_with(x, bits))


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay; `decoupled=False`: Adam's L2 in the gradient) over low-precision weights,
    moments in float32; the `torch.optim.AdamW` arguments. `compile_backend` (`--compile`: "inductor") compiles each
    parameter's update into fused kernels; the rounding's bits are drawn as the eager update draws them."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, decoupled: bool = True, seed: int = 0,
                 compile_backend: str | None = None) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.decoupled, self.seed, self.compile_backend = decoupled, seed, compile_backend
        self._update = adamw_update if compile_backend is None else \
            torch.compile(adamw_update, backend=compile_backend, dynamic=True)

    def __getstate__(self) -> dict[str, Any]:
        """torch's keeps its groups and state alone: the rounding's seed and the decay's kind go too. A compiled
        function neither pickles nor deep-copies: a copy updates eagerly (the same bits drawn)."""
        return {**super().__getstate__(), "decoupled": self.decoupled, "seed": self.seed, "compile_backend": None,
                "_update": adamw_update}

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
                bits = rounding_bits(p.shape, p.device, derive_seed(self.seed, t, index)) \
                    if p.dtype == torch.bfloat16 else None
                step_size = lr / (1 - beta1 ** t)  # x -= step_size * m / (sqrt(v / (1 - beta2^t)) + eps)
                moves = step_size > SMALLEST_STEP
                # a Parameter's own sizes would be fixed in the graph (torch.compile's rule): a graph a shape
                self._update(p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"], bits, beta1, beta2,
                             1 - lr * decay if decay and self.decoupled else None,
                             decay if decay and not self.decoupled else None,
                             1 / (math.sqrt(1 - beta2 ** t) * step_size) if moves else None,
                             eps / step_size if moves else 0.0)
        return loss
