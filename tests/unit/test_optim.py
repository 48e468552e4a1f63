"""`--param_dtype bfloat16`: bf16 weights, float32 Adam moments, stochastic rounding that keeps small updates; with
`--compile`, each parameter's update compiled."""
import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from aqpipe.optim import LowPrecisionAdamW, round_with, rounding_bits


def test_stochastic_rounding_is_unbiased_and_lands_on_the_two_neighbours():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # an eighth of the way from 1.0 to bf16's next value, 1.0078125
    rounded = round_with(x, rounding_bits(x.shape, x.device, seed=0))
    assert set(rounded.unique().tolist()) == {1.0, 1.0078125}
    # the mean lands on x within 4 standard errors (the step is 2^-7; P(up) = 1/8)
    assert abs(rounded.mean().item() - x[0].item()) < 4 * 2 ** -7 * (1 / 8 * 7 / 8 / 200_000) ** 0.5
    nearest = x.to(torch.bfloat16).float()
    assert torch.equal(nearest, torch.ones_like(x))  # round to nearest loses the offset every time


def test_moments_are_float32_and_updates_below_bf16s_step_are_kept_on_average():
    """Each step and each parameter draws its own rounding bits: with the same bits every step, the same 2% of the
    weights would move a whole bf16 step each time and the rest never (the mean alone cannot tell); with the same
    bits for two parameters of one shape, their weights would stay equal."""
    torch.manual_seed(0)
    start = torch.ones(4096)
    p16, twin = torch.nn.Parameter(start.to(torch.bfloat16)), torch.nn.Parameter(start.to(torch.bfloat16))
    p32 = torch.nn.Parameter(start.clone())
    o16 = LowPrecisionAdamW([p16, twin], lr=1e-4, weight_decay=0.0)
    o32 = torch.optim.AdamW([p32], lr=1e-4, weight_decay=0.0)
    for _ in range(30):  # each update (1e-4) is an eightieth of bf16's step at 1.0
        p16.grad, twin.grad = torch.ones(4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
        p32.grad = torch.ones(4096)
        o16.step()
        o32.step()
    state = o16.state[p16]
    assert p16.dtype == torch.bfloat16 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    moved32, moved16 = (start - p32.detach()).mean().item(), (start - p16.detach().float()).mean().item()
    assert moved32 == pytest.approx(30e-4, rel=1e-3)
    assert moved16 == pytest.approx(moved32, rel=0.1)  # round to nearest would leave every weight at 1.0
    assert (p16.detach() != 1).float().mean().item() > 0.3  # 0.54 here; the same bits every step: 0.02
    assert not torch.equal(p16.detach(), twin.detach())


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


SHAPES = [(64, 8), (8,), (16, 4), (4, 16), (32, 2)]  # two ranks, five shapes
RATES = [0.0, 1e-2, 5e-3, 2e-3, 1e-3]  # a warm-up's first step at 0, then a rate that changes every step


def _trained(compile_backend=None, decoupled=True, dtype=torch.bfloat16, after_step=lambda: None):
    """Parameters of two ranks and five shapes stepped at `RATES` with random gradients: their weights and moments."""
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in SHAPES]
    opt = LowPrecisionAdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3, decoupled=decoupled, seed=7,
                            compile_backend=compile_backend)
    for lr in RATES:
        opt.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(dtype)
        opt.step()
        after_step()
    return [p.detach() for p in params], [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("decoupled", [True, False])
def test_on_float32_weights_it_steps_as_torchs_adamw_and_adam_eager_and_compiled(decoupled):
    """The update itself, against torch's: AdamW's decoupled decay, or Adam's L2 (`decoupled=False`), with an eps
    that counts and a rate that starts at 0 and changes every step. float32 weights take no rounding bits."""
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = kind(params, lr=1e-2, weight_decay=0.1, eps=1e-3, foreach=False)
    for lr in RATES:
        reference.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        reference.step()
    torch._dynamo.reset()
    for backend in (None, "aot_eager"):
        weights, moments = _trained(backend, decoupled=decoupled, dtype=torch.float32)
        for got, want in zip(weights, params):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)
        for got, want in zip(moments, (reference.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq"))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_compiled_update_compiles_in_its_first_two_steps_alone_and_writes_the_eager_weights(decoupled):
    """`--compile`: each parameter's update compiled whole, the sizes, the step and the learning rate its inputs: a
    graph for each rank of tensor, one more where the rate leaves 0, and none after. It draws the eager update's
    rounding bits: the same bf16 weights, the moments within float32 rounding."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = []
    weights, moments = _trained(decoupled=decoupled)
    compiled_weights, compiled_moments = _trained(counter, decoupled=decoupled,
                                                  after_step=lambda: compiled.append(counter.frame_count))
    assert compiled[1:] == [compiled[1]] * 4 and compiled[1] <= 6, compiled  # not one a shape, nor one a step
    assert all(torch.equal(a, b) for a, b in zip(weights, compiled_weights))
    for a, b in zip(moments, compiled_moments):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)


def test_a_copy_of_a_compiled_optimizer_keeps_its_seed_and_steps_eagerly_as_the_original():
    p = torch.nn.Parameter(torch.ones(32, dtype=torch.bfloat16))
    opt = LowPrecisionAdamW([p], lr=1e-3, seed=11, decoupled=False, compile_backend="aot_eager")
    twin_p, twin = copy.deepcopy((p, opt))
    assert (twin.seed, twin.decoupled, twin.compile_backend) == (11, False, None)
    p.grad, twin_p.grad = torch.full_like(p, 0.5), torch.full_like(p, 0.5)
    opt.step()
    twin.step()
    assert torch.equal(p, twin_p)


@pytest.mark.parametrize("lr", [0.0, 1e-45])
def test_a_step_at_learning_rate_zero_or_below_float32s_reach_moves_no_weight_and_updates_the_moments(lr):
    """A warm-up's first step runs at lr 0, and the step size folded into the divisor must not divide by it, nor
    by a size float32 cannot hold (0/0 where a gradient was always 0)."""
    p = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    opt = LowPrecisionAdamW([p], lr=lr)
    p.grad = torch.full_like(p, 0.5).index_fill_(0, torch.tensor([3]), 0.0)
    opt.step()
    assert torch.equal(p, torch.ones_like(p))
    assert torch.equal(opt.state[p]["exp_avg"], torch.full((16,), 0.05).index_fill_(0, torch.tensor([3]), 0.0))
