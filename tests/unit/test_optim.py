"""`--param_dtype bfloat16`: bf16 weights, float32 Adam moments, stochastic rounding that keeps small updates."""
import copy

import pytest
import torch

from aqpipe.optim import LowPrecisionAdamW, round_stochastic


def test_stochastic_rounding_is_unbiased_and_lands_on_the_two_neighbours():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # an eighth of the way from 1.0 to bf16's next value, 1.0078125
    rounded = round_stochastic(x, torch.bfloat16, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0078125}
    # the mean lands on x within 4 standard errors (the step is 2^-7; P(up) = 1/8)
    assert abs(rounded.mean().item() - x[0].item()) < 4 * 2 ** -7 * (1 / 8 * 7 / 8 / 200_000) ** 0.5
    nearest = x.to(torch.bfloat16).float()
    assert torch.equal(nearest, torch.ones_like(x))  # round to nearest loses the offset every time


def test_moments_are_float32_and_updates_below_bf16s_step_are_kept_on_average():
    torch.manual_seed(0)
    start = torch.ones(4096)
    p16 = torch.nn.Parameter(start.to(torch.bfloat16))
    p32 = torch.nn.Parameter(start.clone())
    o16 = LowPrecisionAdamW([p16], lr=1e-4, weight_decay=0.0)
    o32 = torch.optim.AdamW([p32], lr=1e-4, weight_decay=0.0)
    for _ in range(30):  # each update (1e-4) is an eightieth of bf16's step at 1.0
        p16.grad, p32.grad = torch.ones(4096, dtype=torch.bfloat16), torch.ones(4096)
        o16.step()
        o32.step()
    state = o16.state[p16]
    assert p16.dtype == torch.bfloat16 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    moved32, moved16 = (start - p32.detach()).mean().item(), (start - p16.detach().float()).mean().item()
    assert moved32 == pytest.approx(30e-4, rel=1e-3)
    assert moved16 == pytest.approx(moved32, rel=0.1)  # round to nearest would leave every weight at 1.0


def test_a_resumed_optimizer_steps_as_the_uninterrupted_one():
    torch.manual_seed(1)
    w = torch.randn(64, 8).to(torch.bfloat16)
    grads = [torch.randn(64, 8).to(torch.bfloat16) for _ in range(6)]

    def run(resume_at=None, seed=3):
        p = torch.nn.Parameter(w.clone())
        opt = LowPrecisionAdamW([p], lr=1e-2, seed=seed)
        for t, g in enumerate(grads):
            if t == resume_at:
                saved, value = copy.deepcopy(opt.state_dict()), p.detach().clone()
                p = torch.nn.Parameter(value)
                opt = LowPrecisionAdamW([p], lr=1e-2, seed=seed)
                opt.load_state_dict(saved)
            p.grad = g
            opt.step()
        return p.detach()

    assert torch.equal(run(), run(resume_at=3))
    assert not torch.equal(run(), run(seed=4))  # the rounding's draws follow the seed
