"""reseed: the draws torch.manual_seed would give, at a fraction of its cost."""
from __future__ import annotations

import pytest
import torch

from aqpipe.pipeline import seeding
from aqpipe.pipeline.seeding import derive_seed, reseed


def test_reseed_draws_what_torch_manual_seed_of_the_derived_seed_draws():
    torch.manual_seed(derive_seed(11, 3))
    expected = torch.rand(64), torch.nn.functional.dropout(torch.ones(256), 0.5)
    torch.manual_seed(0)  # another state in between: reseed must set it, not inherit it
    torch.rand(5)
    reseed(11, 3)
    got = torch.rand(64), torch.nn.functional.dropout(torch.ones(256), 0.5)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_reseed_without_a_seed_leaves_the_generator_alone():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    reseed(None, "embed")
    assert torch.equal(torch.get_rng_state(), state)


def test_reseed_skips_torch_manual_seed_and_its_per_call_traceback(monkeypatch: pytest.MonkeyPatch):
    """torch.manual_seed queues the seed, with a captured traceback, for every accelerator kind not started (50-90 us
    a call); a stage reseeds once a block a micro-batch."""
    def refuse(*args: object) -> None:
        raise AssertionError("torch.manual_seed called")
    monkeypatch.setattr(torch, "manual_seed", refuse)
    monkeypatch.setattr(torch.random, "manual_seed", refuse)
    reseed(3, "head")
    seeding.seed_generators(7)
    assert torch.initial_seed() == 7
