"""QAdam: Adam whose momenta, not gradients, cross the wire, quantized, once the variance is frozen.

Two stages, counted in optimizer steps t = 1, 2, ... (warmup_steps = T):

- warm-up (t <= T): gradients averaged in full precision over the replicas (a ring allreduce),
  then a plain Adam step with the averaged gradient; identical to torch.optim.Adam (AdamW when
  weight_decay > 0) on the mean gradient.
- compression (t > T): every replica updates the momentum with its LOCAL gradient,
  m_r = b1 m + (1 - b1) g_r (m: the averaged momentum of the previous step, the same on every
  replica), and the replicas average z_r = m_r + e_r with `Comm.quantized_mean`: each quantizes
  z_r shard by shard to `bits` bits (stochastic rounding, groups of `group_size` elements of the
  flattened momentum) and sends shard i to replica i; replica i averages the R decoded shards,
  adds its own error s_i, quantizes the result and sends it to everyone (s_i <- the part it could
  not say). So m = the decoded shards of that second quantization, bit-identical everywhere
  (everyone decodes the same bytes), and e_r = z_r - deQ(Q(z_r)) is kept for the next step: error
  feedback on both quantizations, as DeepSpeed's 1-bit Adam does on its worker and server sides.
  The variance v stays frozen at its value after step T.

The update, both stages (AdamW-style decoupled weight decay first when weight_decay > 0):

    x <- x (1 - lr wd)
    x <- x - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^min(t, T)) + eps)

i.e. torch's Adam bias correction; after warm-up the momentum correction keeps using the global
step t and the variance correction stays at its frozen value 1 - b2^T. After warm-up the frozen
v_hat = v / (1 - b2^T) is floored at m_hat^2 (m_hat = m / (1 - b1^t)): the denominator is
max(sqrt(v_hat), |m_hat|) + eps, so no coordinate steps further than lr, as Adam's own step does
for a gradient that keeps its sign (Adam's live v_hat >= m_hat^2 holds near enough: the mean of
squares bounds the square of the mean). Without the floor a coordinate whose gradient was tiny
during warm-up (an embedding row no sample of the warm-up touched, reached only through a tied
head's softmax) and large after divides by almost nothing: a 2-step warm-up took a tied Llama
from 9.05 to 89.9 in one step. m_hat is the same on every replica, so the floor keeps them in
step without a message. With T = 0 there is no variance (v = 0): each update is lr m_hat /
(|m_hat| + eps), momentum's sign (a warning says so).

With one member (comm None or of size 1) nothing is sent and nothing is quantized: the optimizer
is Adam during warm-up and Adam with a frozen variance after.

Bytes per step for N parameters on R replicas: warm-up 2 (R-1)/R * 4N (the allreduce of float32
gradients); compression 2 (R-1)/R * (N * bits/8 + 8 per group) (the reduce-scatter and allgather
of quantized shards). At 8 bits that is about 0.25x the warm-up at every R (an allgather of whole
quantized momenta, as before, sent R-1 copies: 0.5x at R = 4).

Everything a resume needs (per-parameter exp_avg, exp_avg_sq, error; the global step; the
dither generator's state; the shard's error) is in `QAdamOptimizer.state_dict()`; the `QAdam` algorithm itself
keeps only its step counter.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch
from aqpipe.compression.fields import check_int

from .base import Algorithm, register
from .comm import Comm
from .flat import flat_grads, set_flat_grads, worker_seed

DEFAULT_GROUP_SIZE = 1024  # elements per quantization group: 8 bytes of min/step per 1024 codes (<1% at 8 bits)


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with warm-up gradient averaging, then compressed momentum averaging and a frozen variance.

    Usable alone: with `comm` (a `Comm` over the replicas) it does its own communication in
    `step()`; with comm=None it is single-replica Adam that freezes its variance after warm-up.
    Weight decay is decoupled (AdamW). See the module docstring for the exact update.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int = 100, bits: int = 8,
        comm: Comm | None = None, seed: int = 0, group_size: int = DEFAULT_GROUP_SIZE,
    ) -> None:
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"qadam: lr={lr!r}: expected a number >= 0")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"qadam: betas={betas!r}: expected two numbers in [0, 1)")
        if not (isinstance(eps, (int, float)) and eps >= 0):
            raise ValueError(f"qadam: eps={eps!r}: expected a number >= 0")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
            raise ValueError(f"qadam: weight_decay={weight_decay!r}: expected a number >= 0")
        self.warmup_steps = check_int("qadam: warmup_steps", warmup_steps, 0)
        self.bits = check_int("qadam: bits", bits, 1, 8)
        self.seed = check_int("qadam: seed", seed, 0, 2**63 - 1)
        self.group_size = check_int("qadam: group_size", group_size, 1)
        if self.warmup_steps == 0:
            warnings.warn("qadam: warmup_steps=0 freezes the variance at zero, so every update is lr times "
                          "the momentum's sign; use a warm-up of some steps", stacklevel=2)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.comm = comm
        rank = comm.rank if comm is not None else 0
        self.generator = torch.Generator().manual_seed(worker_seed(self.seed, rank))
        self.step_id = 0  # optimizer steps taken
        self._grads_averaged = False
        self.server_error: torch.Tensor | None = None  # error feedback of this replica's shard

    # ------------------------------------------------------------------ helpers
    @property
    def distributed(self) -> bool:
        return self.comm is not None and self.comm.size > 1

    @property
    def in_warmup(self) -> bool:
        """Whether the next step is a warm-up step (full-precision gradient averaging, Adam)."""
        return self.step_id < self.warmup_steps

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def average_gradients(self) -> None:
        """Warm-up: replace every gradient by its mean over the replicas (missing ones count as zeros).

        `step()` does it itself when nobody did; the `QAdam` algorithm calls it from after_backward
        so that gradient clipping between the two sees the averaged gradient, as with allreduce.
        """
        if not self.in_warmup:
            raise RuntimeError(f"qadam: step {self.step_id + 1} is past the warm-up ({self.warmup_steps} steps); "
                               "gradients are no longer averaged")
        if self.distributed and not self._grads_averaged:
            params = self._params()
            if params:
                set_flat_grads(params, self.comm.allreduce_mean_(flat_grads(params).to(torch.float32)))
        self._grads_averaged = True

    def _state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["error"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _average_momenta(self, params: list[torch.nn.Parameter]) -> None:
        """m <- the compressed mean over replicas of z_r = m_r + e_r; e_r <- z_r - (z_r as sent)."""
        states = [self._state(p) for p in params]
        z = torch.cat([(s["exp_avg"].to(torch.float32) + s["error"].to(torch.float32)).reshape(-1) for s in states])
        start, end = self.comm.shards(z.numel(), self.group_size)[self.comm.rank]
        if self.server_error is None:
            self.server_error = z.new_zeros(end - start)
        if self.server_error.numel() != end - start:
            raise RuntimeError(f"qadam: the momentum has {z.numel()} elements, {self.server_error.numel()} in this "
                               f"replica's shard before and {end - start} now: the parameters with gradients changed")
        mean, sent = self.comm.quantized_mean(z, self.bits, group_size=self.group_size, generator=self.generator,
                                              server_error=self.server_error)
        error = z - sent
        start = 0
        for p, s in zip(params, states):
            n = p.numel()
            s["exp_avg"].copy_(mean[start:start + n].view_as(p))
            s["error"].copy_(error[start:start + n].view_as(p))
            start += n

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warm = self.in_warmup
        if self.distributed:
            for p in self._params():  # replicas must agree on what they send: no gradient = zero gradient
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if warm:
                self.average_gradients()
        self._grads_averaged = False
        t = self.step_id + 1
        frozen_t = min(t, self.warmup_steps)
        active = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("qadam: sparse gradients are not supported")
                state = self._state(p)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                if warm:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                active.append(p)
        if not warm and self.distributed and active:
            self._average_momenta(active)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            step_size = lr / (1 - beta1 ** t)
            bias2 = 1 - beta2 ** frozen_t
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if wd:
                    p.mul_(1 - lr * wd)
                if bias2 > 0:
                    denom = state["exp_avg_sq"].sqrt() / math.sqrt(bias2)
                else:  # no warm-up step was ever taken: v = 0
                    denom = torch.zeros_like(p)
                if not warm:  # the frozen variance floored at the momentum's square: no step longer than lr
                    denom = torch.maximum(denom, state["exp_avg"].abs() / (1 - beta1 ** t))
                p.addcdiv_(state["exp_avg"], denom.add_(eps), value=-step_size)
        self.step_id = t
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["qadam"] = {"step_id": self.step_id, "generator": self.generator.get_state(),
                          "warmup_steps": self.warmup_steps, "bits": self.bits, "group_size": self.group_size,
                          "rank": self.comm.rank if self.comm is not None else 0,
                          "server_error": None if self.server_error is None else self.server_error.clone()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("qadam", None)
        if extra is None:
            raise ValueError("qadam: the state dict has no 'qadam' entry: it was not saved by QAdamOptimizer")
        for key in ("warmup_steps", "bits", "group_size"):
            if extra[key] != getattr(self, key):
                raise ValueError(f"qadam: the checkpoint has {key}={extra[key]!r}, "
                                 f"this optimizer {getattr(self, key)!r}")
        rank = self.comm.rank if self.comm is not None else 0
        if extra.get("server_error") is not None and extra.get("rank", rank) != rank:
            raise ValueError(f"qadam: the checkpoint holds replica {extra['rank']}'s shard of the momentum, "
                             f"this is replica {rank}")
        super().load_state_dict(state_dict)
        self.step_id = int(extra["step_id"])
        self.generator.set_state(extra["generator"])
        error = extra.get("server_error")
        device = self._params()[0].device if self._params() else torch.device("cpu")
        self.server_error = None if error is None else error.to(device).clone()
        self._grads_averaged = False


@register
class QAdam(Algorithm):
    """The data-parallel face of QAdamOptimizer: wrap_optimizer turns the user's Adam/AdamW into one.

    Options: warmup_steps (int >= 0, default 100), bits (1..8, default 8), seed (int >= 0, default 0),
    group_size (elements per quantization group, default 1024). The optimizer's state_dict carries
    the whole QAdam state (momenta, frozen variances, error memories, step, generator); this
    algorithm's own state_dict is only its step counter.
    """

    name = "qadam"
    OPTIONS = ("warmup_steps", "bits", "seed")
    WEIGHTS = True  # gradients (warm-up) and momenta are means, linear in the gradients scaled to their shares

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, *, warmup_steps: int = 100, bits: int = 8,
                 seed: int = 0, group_size: int = DEFAULT_GROUP_SIZE, **options: Any) -> None:
        super().__init__(params, comm, **options)
        self.warmup_steps = check_int("qadam: warmup_steps", warmup_steps, 0)
        self.bits = check_int("qadam: bits", bits, 1, 8)
        self.seed = check_int("qadam: seed", seed, 0, 2**63 - 1)
        self.group_size = check_int("qadam: group_size", group_size, 1)
        self.optimizer: QAdamOptimizer | None = None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """A QAdamOptimizer over the same parameter groups, with their lr, betas, eps and weight decay.

        Build any LR scheduler on the returned optimizer: the given one is no longer stepped.
        """
        kind = type(optimizer).__name__
        groups = []
        for i, g in enumerate(optimizer.param_groups):
            if "betas" not in g or "eps" not in g:
                raise ValueError(f"qadam: optimizer {kind}: expected an Adam-like optimizer (torch.optim.Adam or "
                                 f"AdamW, with betas and eps), got one whose param group {i} has no betas/eps")
            for flag in ("amsgrad", "maximize"):
                if g.get(flag):
                    raise ValueError(f"qadam: optimizer {kind} has {flag}=True: QAdam supports neither amsgrad "
                                     "nor maximize")
            wd = g.get("weight_decay", 0.0) or 0.0
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
            if wd and isinstance(optimizer, torch.optim.Adam) and not decoupled:
                raise ValueError(f"qadam: optimizer {kind} has weight_decay={wd} as an L2 term in the gradient; "
                                 "QAdam decays weights decoupled, as AdamW: use torch.optim.AdamW or weight_decay=0")
            lr = g["lr"].item() if torch.is_tensor(g["lr"]) else g["lr"]
            groups.append({"params": list(g["params"]), "lr": lr, "betas": tuple(g["betas"]), "eps": g["eps"],
                           "weight_decay": wd})
        self.optimizer = QAdamOptimizer(groups, warmup_steps=self.warmup_steps, bits=self.bits, comm=self.comm,
                                        seed=self.seed, group_size=self.group_size)
        return self.optimizer

    def after_backward(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("qadam: call wrap_optimizer(optimizer) at setup and step the optimizer it returns")
        if self.optimizer.in_warmup:
            self.optimizer.average_gradients()
