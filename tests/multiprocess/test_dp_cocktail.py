"""CocktailSGD: its update on R workers against a one-process reference, bytes, random subsets, resume."""
import pytest
import torch

from aqpipe.compression import dequantize, quantize
from aqpipe.data_parallel.base import create
from aqpipe.data_parallel.cocktail import CocktailSGD
from aqpipe.data_parallel.comm import Comm
from aqpipe.data_parallel.flat import worker_seed
from tests.helpers.dp_toy import flat, loss_of, restored, straight_and_saved, train_steps
from tests.helpers.processes import spawn

LR, STEPS, GROUP = 0.1, 6, 8
OPTIONS = {"random_ratio": 0.5, "topk_ratio": 0.25, "bits": 4, "seed": 3, "group_size": GROUP}
N = 420  # parameters of make_model()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def subsets_of(world: int, step: int) -> tuple[CocktailSGD, list[torch.Tensor]]:
    """The shared random subsets (a function of the seed and the step alone) and the shards' offsets."""
    algo = CocktailSGD(list(make_model().parameters()), Comm(None, list(range(world))), **OPTIONS)
    return algo, [s + algo.subset(i, step) for i, (s, _) in enumerate(algo.bounds)]


def compress(values: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Top-k of values, quantized in the order of their positions: the dense values they stand for."""
    keep = torch.zeros(values.numel(), dtype=torch.bool)
    keep[torch.topk(values.abs(), min(k, values.numel())).indices] = True
    out = torch.zeros_like(values)
    out[keep] = dequantize(quantize(values[keep], OPTIONS["bits"], group_size=GROUP, generator=gen))
    return out


# ----------------------------------------------------------------------------- the reference
def reference(world: int, owner_feedback: bool = True) -> dict:
    """The paper's rule on `world` workers in one process, plain SGD locally."""
    model = make_model()
    params = list(model.parameters())
    anchor = flat(model)
    xs = [anchor.clone() for _ in range(world)]
    algo, _ = subsets_of(world, 0)
    owner_errors = [torch.zeros(N) for _ in range(world)]  # owner i's error, indexed like the model
    gens = [torch.Generator().manual_seed(worker_seed(OPTIONS["seed"], r))
            for r in range(world)]
    history = []
    for t in range(STEPS):
        for r in range(world):
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(xs[r], params)
            model.zero_grad()
            loss_of(model, r, t).backward()
            xs[r] = xs[r] - LR * torch.cat([p.grad.reshape(-1) for p in params])
        _, positions = subsets_of(world, t)
        sent = [[compress(xs[r][pos] - anchor[pos], algo.k[i], gens[r]) for i, pos in enumerate(positions)]
                for r in range(world)]
        for r in range(world):
            for i, pos in enumerate(positions):
                xs[r][pos] -= sent[r][i]
        for i, pos in enumerate(positions):
            average = sum(sent[r][i] for r in range(world)) / world + owner_errors[i][pos]
            update = compress(average, algo.k[i], gens[i])
            if owner_feedback:
                owner_errors[i][pos] = average - update
            for r in range(world):
                xs[r][pos] += update
            anchor[pos] += update
        history.append([x.clone() for x in xs])
    return {"history": history, "anchor": anchor}


# ----------------------------------------------------------------------------- the workers
def worker(rank: int, world: int) -> dict:
    comm = Comm(None, list(range(world)))
    model = make_model()
    algo = create("cocktail_sgd", list(model.parameters()), comm, **OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history, sent = [], []
    train_steps(model, algo, opt, rank, range(STEPS),
                on_step=lambda: (history.append(flat(model)), sent.append(comm.take_bytes())))
    sizes = [[algo.message_nbytes(i, algo.subset(i, t).numel()) for i in range(world)] for t in range(STEPS)]
    out = {"history": history, "sent": sent, "sizes": sizes, "anchor": algo.anchor.clone()}
    if world == 2:
        def build():
            m = make_model()
            a = create("cocktail_sgd", list(m.parameters()), comm, **OPTIONS)
            return m, a, torch.optim.AdamW(m.parameters(), lr=1e-2)

        straight, saved = straight_and_saved(build, rank, 7, 3)
        fresh = restored(build, saved)
        train_steps(*fresh, rank, range(3, 7))
        out["resume"] = (flat(straight[0]), flat(fresh[0]))
    return out


@pytest.fixture(scope="module")
def runs():
    return {world: spawn(worker, world) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_replicas_follow_the_reference(runs, world):
    ref = reference(world)
    for r, res in enumerate(runs[world]):
        for t in range(STEPS):
            torch.testing.assert_close(res["history"][t], ref["history"][t][r], rtol=0, atol=1e-6)
        assert torch.equal(res["anchor"], runs[world][0]["anchor"])  # θ is bit-identical everywhere
        torch.testing.assert_close(res["anchor"], ref["anchor"], rtol=0, atol=1e-6)
    # the replicas keep what they did not send, so they differ; and the owner's error matters
    assert not torch.allclose(runs[world][0]["history"][-1], runs[world][1]["history"][-1], atol=1e-4)
    without = reference(world, owner_feedback=False)["anchor"]
    assert not torch.allclose(ref["anchor"], without, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_are_the_pieces_for_the_others_then_the_own_average_to_each(runs, world):
    for r, res in enumerate(runs[world]):
        for t in range(STEPS):
            sizes = res["sizes"][t]
            pieces = sum(b for i, b in enumerate(sizes) if i != r)
            assert res["sent"][t] == pieces + (world - 1) * sizes[r]
    algo, positions = subsets_of(world, 0)
    subset, k = positions[0].numel(), algo.k[0]
    assert algo.message_nbytes(0, subset) == -(-subset // 8) + (k * 4 + 7) // 8 + 8 * -(-k // GROUP)


def test_default_ratios_send_at_least_150_times_fewer_bytes_than_allreduce():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))  # 525k parameters
    for world in (2, 4):
        algo = CocktailSGD(list(model.parameters()), Comm(None, list(range(world))))
        sizes = [algo.message_nbytes(i, algo.subset(i, 0).numel()) for i in range(world)]
        ours = sum(sizes[1:]) + (world - 1) * sizes[0]
        allreduce = 2 * (world - 1) * 4 * algo.numel // world
        assert allreduce / ours >= 150, (world, allreduce / ours)


def test_random_subsets_cover_every_entry_once_a_cycle_and_agree_everywhere():
    algo, _ = subsets_of(4, 0)
    assert algo.cycle == 2
    for i, (s, e) in enumerate(algo.bounds):
        for start in (0, 2, 4):
            seen = torch.cat([algo.subset(i, t) for t in range(start, start + algo.cycle)])
            assert torch.equal(seen.sort().values, torch.arange(e - s))
        assert not torch.equal(algo.subset(i, 0), algo.subset(i, 2))  # a fresh permutation each cycle
    comm = Comm(None, list(range(4)))
    comm.rank = 2  # replica 2, without a process group: its subsets come from the seed alone, like replica 0's
    other = CocktailSGD(list(make_model().parameters()), comm, **OPTIONS)
    assert other.generator.initial_seed() != algo.generator.initial_seed()  # its own dither
    assert all(torch.equal(other.subset(i, 5), algo.subset(i, 5)) for i in range(4))


def test_state_dict_round_trip_resumes_exactly(runs):
    for res in runs[2]:
        straight, resumed = res["resume"]
        assert torch.equal(straight, resumed)


def test_one_replica_is_the_optimizer_alone_and_sends_nothing():
    a, b = make_model(), make_model()
    comm = Comm(None, None)
    algo = create("cocktail_sgd", list(a.parameters()), comm)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=LR), torch.optim.SGD(b.parameters(), lr=LR)
    train_steps(a, algo, opt_a, 0, range(3))
    for t in range(3):
        opt_b.zero_grad()
        loss_of(b, 0, t).backward()
        opt_b.step()
    assert torch.equal(flat(a), flat(b)) and comm.sent_bytes == 0 and algo.step_count == 3


@pytest.mark.parametrize("options, message", [
    ({"random_ratio": 0}, "random_ratio=0"), ({"random_ratio": 1.5}, "random_ratio=1.5"),
    ({"topk_ratio": 0.2, "random_ratio": 0.1}, "topk_ratio=0.2: expected at most random_ratio=0.1"),
    ({"bits": 9}, "bits=9"), ({"seed": -1}, "seed=-1"), ({"group_size": 0}, "group_size=0"),
    ({"local_steps": 2}, "unknown option"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        create("cocktail_sgd", list(make_model().parameters()), Comm(None, None), **options)


def test_load_state_dict_refuses_another_configuration():
    a = CocktailSGD(list(make_model().parameters()), Comm(None, None), bits=8)
    b = CocktailSGD(list(make_model().parameters()), Comm(None, None), bits=4)
    with pytest.raises(ValueError, match="bits=8, this run has 4"):
        b.load_state_dict(a.state_dict())
    comm = Comm(None, list(range(2)))
    comm.rank = 1
    with pytest.raises(ValueError, match="rank=0, this run has 1"):  # another replica's shard of the error
        CocktailSGD(list(make_model().parameters()), comm).load_state_dict(
            CocktailSGD(list(make_model().parameters()), Comm(None, list(range(2)))).state_dict())
    with pytest.raises(ValueError, match="group_size=128, this run has 64"):
        CocktailSGD(list(make_model().parameters()), Comm(None, None), group_size=64).load_state_dict(a.state_dict())
    a.after_backward()
    small = CocktailSGD(list(torch.nn.Linear(3, 2).parameters()), Comm(None, None), bits=8)
    with pytest.raises(ValueError, match="checkpoint's model has 420 parameters, this one 8"):
        small.load_state_dict({**a.state_dict(), "owner_error": small.owner_error})
    with pytest.raises(ValueError, match="checkpoint lacks anchor, owner_error.*not saved by cocktail_sgd"):
        a.load_state_dict({k: v for k, v in a.state_dict().items() if k not in ("anchor", "owner_error")})
    a.load_state_dict({k: v for k, v in a.state_dict().items() if k not in ("group_size", "rank")})  # saved before
