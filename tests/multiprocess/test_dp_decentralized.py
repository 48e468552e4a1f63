"""Decentralized SGD and its low-precision ring variant against one-process simulations of the seeds' formulas."""
import io
from types import SimpleNamespace

import pytest
import torch

import aqpipe.data_parallel.decentralized as dec
from aqpipe.compression import QuantizedTensor, dequantize, quantize
from aqpipe.data_parallel.base import REGISTRY, create
from aqpipe.data_parallel.comm import Comm
from aqpipe.data_parallel.flat import worker_seed
from tests.helpers.processes import spawn

STEPS, LR, GS = 5, 0.1, dec.DEFAULT_GROUP_SIZE
IN, HIDDEN, OUT = 8, 64, 40  # 3176 parameters: two quantization groups of 2048

# name, options, label: every distributed run below trains these from the same initial model
CONFIGS = [
    ("decentralized", {}, "shift_one"),
    ("decentralized", {"peer_selection": "all"}, "all"),
    ("decentralized", {"interval": 3}, "shift_one_i3"),
    ("decentralized", {"interval": 2}, "shift_one_i2"),
    ("low_precision_decentralized", {}, "lp8"),
    ("low_precision_decentralized", {"bits": 2, "seed": 7}, "lp2"),
    ("low_precision_decentralized", {"topology": "ring"}, "lp8_ring"),
]
TOPOLOGY = {"lp8": "directed_ring", "lp2": "directed_ring", "lp8_ring": "ring"}
# state_dict round trips checked in the same processes, per world size
RESUMES = {
    2: [("decentralized", {"interval": 2}), ("low_precision_decentralized", {"bits": 3, "seed": 5})],
    4: [("decentralized", {}), ("low_precision_decentralized", {"bits": 4})],
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)


def backward(model, rank, step):
    model.zero_grad()
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat(model, vec):
    with torch.no_grad():
        start = 0
        for p in model.parameters():
            p.copy_(vec[start:start + p.numel()].view_as(p))
            start += p.numel()


def pack(obj):
    """Tensors as bytes: tensors put on a multiprocessing queue travel as shared-memory handles that
    die with the worker process, before the parent may have read them."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def run(fn, world, *args):
    return [torch.load(io.BytesIO(b), weights_only=False) for b in spawn(fn, world, *args)]


def train_step(model, opt, algo, rank, step):
    backward(model, rank, step)
    algo.after_backward()
    opt.step()
    algo.after_step()


# ----------------------------------------------------------------------------- distributed workers
def train_worker(rank, world, configs, steps, resumes):
    """Every config for `steps` steps, then every resume check: one process start per world size."""
    out = {}
    for name, options, label in configs:
        model = make_model()
        comm = Comm(None, list(range(world)))
        algo = create(name, list(model.parameters()), comm, **options)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        flats, sent, peers = [], [], []
        for t in range(steps):
            if name == "decentralized":
                algo.last_peer = None  # None on steps without an exchange
            train_step(model, opt, algo, rank, t)
            flats.append(flat(model))
            sent.append(comm.take_bytes())
            peers.append(getattr(algo, "last_peer", None))
        replicas = {j: x.clone() for j, x in getattr(algo, "replicas", {}).items()}
        out[label] = {"flats": flats, "bytes": sent, "peers": peers, "replicas": replicas,
                      "sources": getattr(algo, "sources", None), "targets": getattr(algo, "targets", None)}
    out["resume"] = {(name, tuple(sorted(options.items()))): resume_run(rank, world, name, options, 3, 6)
                     for name, options in resumes}
    return pack(out)


def resume_run(rank, world, name, options, k, total):
    """Train `total` steps straight, and `k` steps, save, restore into fresh objects, train the rest."""
    comm = Comm(None, list(range(world)))

    def build(seed):
        model = make_model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        return model, opt, create(name, list(model.parameters()), comm, **options)

    model, opt, algo = build(0)
    for t in range(total):
        train_step(model, opt, algo, rank, t)
    straight = flat(model)

    model, opt, algo = build(0)
    for t in range(k):
        train_step(model, opt, algo, rank, t)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "algo": algo.state_dict()}, buf)
    for t in range(k, total):  # keep training after the save: the restore must not see these steps
        train_step(model, opt, algo, rank, t)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model, opt, algo = build(123)  # a different initial model: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    algo.load_state_dict(ckpt["algo"])
    for t in range(k, total):
        train_step(model, opt, algo, rank, t)
    return {"straight": straight, "resumed": flat(model)}


@pytest.fixture(scope="module")
def runs():
    return {R: run(train_worker, R, CONFIGS, STEPS, RESUMES[R]) for R in (2, 4)}


# ----------------------------------------------------------------------------- one-process references
@pytest.fixture
def one_thread():
    """The workers run on one thread; so does the reference, so that every float op matches."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_decentralized(R, steps, peer_selection="shift_one", interval=1):
    """Seed 001 on R simulated workers: x_i <- (x_i + x_peer)/2 with the gradient at x_t, then x -= lr g."""
    models = [make_model() for _ in range(R)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    history = []
    for t in range(steps):
        for i, m in enumerate(models):
            backward(m, i, t)
        if t % interval == 0:
            xs = [flat(m) for m in models]
            if peer_selection == "all":
                mean = torch.stack(xs).mean(0)
                new = [mean for _ in range(R)]
            else:
                new = [(xs[i] + xs[dec.shift_one_peer(i, R, t // interval)]) / 2 for i in range(R)]
            for m, x in zip(models, new):
                set_flat(m, x)
        for o in opts:
            o.step()
        history.append([flat(m) for m in models])
    return history


def reference_low_precision(R, steps, bits=8, seed=0, topology="directed_ring"):
    """Seeds 000/001 on R simulated workers, on the true models (every replica of x_j equals x_j).

    x_{t+1/2} = sum_j W_ij x_j - lr g_i (ring: self and both neighbours, 1/3 each; directed ring: self
    and the previous worker, 1/2 each; R == 2: 1/2 each), z = x_{t+1/2} - x_t,
    x_{t+1} = x_t + deQ(Q(z)) with each worker's own seeded dither generator.
    """
    models = [make_model() for _ in range(R)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    gens = [torch.Generator().manual_seed(worker_seed(seed, i)) for i in range(R)]
    history = []
    for t in range(steps):
        for i, m in enumerate(models):
            backward(m, i, t)
        xs = [flat(m) for m in models]
        for i, m in enumerate(models):
            if R == 2:
                avg = (xs[i] + xs[1 - i]) / 2
            elif topology == "directed_ring":
                avg = (xs[i] + xs[(i - 1) % R]) / 2
            else:
                avg = (xs[i] + xs[(i - 1) % R] + xs[(i + 1) % R]) / 3
            set_flat(m, avg)
        for o in opts:
            o.step()
        for i, m in enumerate(models):
            z = flat(m) - xs[i]
            set_flat(m, xs[i] + dequantize(quantize(z, bits, group_size=GS, generator=gens[i])))
        history.append([flat(m) for m in models])
    return history


# ----------------------------------------------------------------------------- decentralized
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("label,peer_selection,interval",
                         [("shift_one", "shift_one", 1), ("shift_one_i3", "shift_one", 3), ("all", "all", 1)])
def test_decentralized_matches_reference(runs, one_thread, R, label, peer_selection, interval):
    ref = reference_decentralized(R, STEPS, peer_selection, interval)
    for t in range(STEPS):
        for i in range(R):
            got = runs[R][i][label]["flats"][t]
            if peer_selection == "shift_one":  # (a + b) / 2 on both sides of a pair: exact
                assert torch.equal(got, ref[t][i]), (label, R, t, i)
            else:  # allreduce sums in its own order
                torch.testing.assert_close(got, ref[t][i], rtol=0, atol=1e-6)
    # the models really moved apart and back: averaging is not a no-op here
    assert not torch.equal(ref[-1][0], ref[-1][1])


def test_decentralized_all_is_the_global_mean(runs, one_thread):
    # after averaging (before the local step) all were equal: they differ only by lr * their own gradient
    models = [make_model() for _ in range(4)]
    mean = torch.stack([flat(m) for m in models]).mean(0)
    for i, m in enumerate(models):
        backward(m, i, 0)
        g = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        torch.testing.assert_close(runs[4][i]["all"]["flats"][0], mean - LR * g, rtol=0, atol=1e-6)
    # and at step 1 everyone averages the four step-0 models: the global mean again
    mean1 = torch.stack([runs[4][i]["all"]["flats"][0] for i in range(4)]).mean(0)
    for i, m in enumerate(models):
        set_flat(m, runs[4][i]["all"]["flats"][0])
        backward(m, i, 1)
        g = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        torch.testing.assert_close(runs[4][i]["all"]["flats"][1], mean1 - LR * g, rtol=0, atol=1e-6)


def test_shift_one_pairs_everyone_and_changes_peer_every_round():
    for R in (2, 4, 6, 8):
        h = R // 2
        for s in range(2 * R):
            peers = [dec.shift_one_peer(i, R, s) for i in range(R)]
            assert sorted(peers) == list(range(R))  # a permutation ...
            assert all(peers[peers[i]] == i and peers[i] != i for i in range(R))  # ... of disjoint pairs
            assert all((i < h) != (peers[i] < h) for i in range(R))  # across the two halves
            if R >= 4:
                assert all(dec.shift_one_peer(i, R, s + 1) != peers[i] for i in range(R))
        # over R/2 rounds worker 0 meets every worker of the other half
        assert {dec.shift_one_peer(0, R, s) for s in range(h)} == set(range(h, R))


def test_shift_one_peers_in_a_real_run(runs):
    for i in range(4):
        peers = runs[4][i]["shift_one"]["peers"]
        assert all(a != b for a, b in zip(peers, peers[1:])), peers
        for t, p in enumerate(peers):
            assert runs[4][p]["shift_one"]["peers"][t] == i  # my peer's peer is me
            assert (i < 2) != (p < 2)
        # interval 2: the peer changes with each communication round, not each step
        assert runs[4][i]["shift_one_i2"]["peers"][0::2] == [dec.shift_one_peer(i, 4, r) for r in range(3)]


@pytest.mark.parametrize("R", [2, 4])
def test_interval_communicates_only_on_its_steps(runs, R):
    numel = flat(make_model()).numel()
    for i in range(R):
        for label, interval in (("shift_one", 1), ("shift_one_i2", 2), ("shift_one_i3", 3)):
            sent = runs[R][i][label]["bytes"]
            assert sent == [4 * numel if t % interval == 0 else 0 for t in range(STEPS)], (label, sent)
        # "all" is one ring allreduce of the model per step
        assert runs[R][i]["all"]["bytes"] == [2 * (R - 1) * 4 * numel // R] * STEPS


def test_single_replica_is_plain_sgd_and_sends_nothing():
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for t in range(3):
        backward(ref, 0, t)
        ref_opt.step()
    for name in ("decentralized", "low_precision_decentralized"):
        model, comm = make_model(), Comm()
        algo = create(name, list(model.parameters()), comm)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for t in range(3):
            train_step(model, opt, algo, 0, t)
        assert torch.equal(flat(model), flat(ref)), name
        assert comm.sent_bytes == 0 and algo.step_count == 3


# ----------------------------------------------------------------------------- low precision
@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("label,bits,seed", [("lp8", 8, 0), ("lp2", 2, 7), ("lp8_ring", 8, 0)])
def test_low_precision_matches_reference(runs, one_thread, R, label, bits, seed):
    ref = reference_low_precision(R, STEPS, bits, seed, TOPOLOGY[label])
    for t in range(STEPS):
        for i in range(R):
            assert torch.equal(runs[R][i][label]["flats"][t], ref[t][i]), (label, R, t, i)
    # different seeds give different dither: the reference depends on it, so the match above is not luck
    other = reference_low_precision(R, 1, bits, seed + 1, TOPOLOGY[label])
    assert not torch.equal(other[0][0], ref[0][0])
    if R == 4:  # and the topology is the one asked for: the other one's weights end elsewhere
        twin = "ring" if TOPOLOGY[label] == "directed_ring" else "directed_ring"
        assert not torch.equal(reference_low_precision(R, 2, bits, seed, twin)[1][0], ref[1][0])


def test_low_precision_stays_near_full_precision_ring_average(runs, one_thread):
    """The algorithm's first step (worker 0 of the 4-process run) is within one quantization step, per
    group, of the unquantized update."""
    R = 4
    models = [make_model() for _ in range(R)]
    for i, m in enumerate(models):
        backward(m, i, 0)
    x0 = flat(models[0])
    g0 = torch.cat([p.grad.reshape(-1) for p in models[0].parameters()])
    # all start equal, so the weighted average is x0 (up to rounding) and z = -lr g0
    got = runs[R][0]["lp8"]["flats"][0]
    z = -LR * g0
    tol = torch.cat([torch.full_like(gr, float(gr.max() - gr.min()) / 255) for gr in z.split(GS)])
    error = (got - (x0 + z)).abs()
    assert (error <= tol + 1e-6).all()
    assert error.max() > 1e-6  # the change did travel quantized


@pytest.mark.parametrize("R", [2, 4])
def test_low_precision_replicas_are_bit_identical_across_the_ring(runs, R):
    for label in ("lp8", "lp2", "lp8_ring"):
        for i in range(R):
            mine = runs[R][i][label]
            if R == 2:
                expected, targets = [1 - i], [1 - i]
            elif TOPOLOGY[label] == "directed_ring":
                expected, targets = [(i - 1) % R], [(i + 1) % R]
            else:
                expected = targets = [(i - 1) % R, (i + 1) % R]
            assert (mine["sources"], mine["targets"]) == (expected, targets)
            assert set(mine["replicas"]) == {i, *expected}
            assert torch.equal(mine["replicas"][i], mine["flats"][-1])  # x̂_i is worker i's model
            for j in expected:
                assert torch.equal(mine["replicas"][j], runs[R][j][label]["replicas"][j]), (label, R, i, j)
        # the models did diverge, so the check above compares different tensors
        assert not torch.equal(runs[R][0][label]["flats"][-1], runs[R][1][label]["flats"][-1])


@pytest.mark.parametrize("R", [2, 4])
def test_low_precision_bytes_are_the_quantized_change(runs, R):
    numel = flat(make_model()).numel()
    wire8 = QuantizedTensor.wire_nbytes((numel,), 8, GS)
    wire2 = QuantizedTensor.wire_nbytes((numel,), 2, GS)
    assert wire8 == numel + 8 * 2 and wire2 == numel // 4 + (numel % 4 > 0) + 8 * 2
    ring_links = 1 if R == 2 else 2
    for i in range(R):
        assert runs[R][i]["lp8"]["bytes"] == [wire8] * STEPS  # the directed ring: one message at any R
        assert runs[R][i]["lp2"]["bytes"] == [wire2] * STEPS
        assert runs[R][i]["lp8_ring"]["bytes"] == [ring_links * wire8] * STEPS
        full = sum(runs[R][i]["shift_one"]["bytes"])
        # an 8-bit change is about a quarter of a float32 model: the whole step under 0.3x of decentralized
        assert sum(runs[R][i]["lp8"]["bytes"]) <= 0.3 * full, (R, full)


# ----------------------------------------------------------------------------- options and state
@pytest.mark.parametrize("name,options,size,match", [
    ("decentralized", {}, 3, r"even replica count, got 3 replicas"),
    ("decentralized", {"peer_selection": "shift_one"}, 5, r"got 5 replicas"),
    ("decentralized", {"peer_selection": "ring"}, 2, r"peer_selection='ring': expected one of shift_one, all"),
    ("decentralized", {"interval": 0}, 2, r"interval=0: expected an integer >= 1"),
    ("decentralized", {"interval": 1.5}, 2, r"interval=1.5: expected an integer >= 1"),
    ("decentralized", {"interval": True}, 2, r"interval=True"),
    ("decentralized", {"lr": 1}, 2, r"unknown option\(s\) lr"),
    ("low_precision_decentralized", {"bits": 0}, 2, r"bits=0: expected an integer from 1 to 8"),
    ("low_precision_decentralized", {"bits": 9}, 2, r"bits=9: expected an integer from 1 to 8"),
    ("low_precision_decentralized", {"seed": -1}, 2, r"seed=-1: expected an integer from 0"),
    ("low_precision_decentralized", {"group_size": 0}, 2, r"group_size=0: expected an integer >= 1"),
    ("low_precision_decentralized", {"peer_selection": "all"}, 2, r"unknown option\(s\) peer_selection"),
    ("low_precision_decentralized", {"topology": "star"}, 4, r"topology='star': expected one of directed_ring, ring"),
])
def test_bad_options_raise_clear_errors(name, options, size, match):
    fake_comm = SimpleNamespace(rank=0, size=size)  # validation happens before any communication
    with pytest.raises(ValueError, match=match) as err:
        create(name, list(make_model().parameters()), fake_comm, **options)
    assert name in str(err.value)


def test_good_options_are_accepted():
    assert REGISTRY["decentralized"] is dec.DecentralizedSGD
    assert REGISTRY["low_precision_decentralized"] is dec.LowPrecisionDecentralizedSGD
    params = list(make_model().parameters())
    a = create("decentralized", params, SimpleNamespace(rank=0, size=3), peer_selection="all", interval=4)
    assert (a.peer_selection, a.interval) == ("all", 4)
    b = create("low_precision_decentralized", params, SimpleNamespace(rank=1, size=5), bits=1, seed=3)
    assert (b.bits, b.seed, b.group_size, b.sources, b.targets) == (1, 3, GS, [0], [2])
    c = create("low_precision_decentralized", params, SimpleNamespace(rank=1, size=5), topology="ring")
    assert (c.sources, c.targets) == ([0, 2], [0, 2])


@pytest.mark.parametrize("R", [2, 4])
def test_state_dict_resume_is_exact(runs, R):
    assert len(runs[R][0]["resume"]) == 2
    for i in range(R):
        for key, r in runs[R][i]["resume"].items():
            assert torch.equal(r["resumed"], r["straight"]), (R, i, key)


def test_load_state_dict_rejects_a_mismatched_checkpoint():
    params = list(make_model().parameters())
    lp = dec.LowPrecisionDecentralizedSGD(params, SimpleNamespace(rank=0, size=4), bits=8)
    state = lp.state_dict()
    assert set(state["replicas"]) == {0, 3}
    ring = dec.LowPrecisionDecentralizedSGD(params, SimpleNamespace(rank=0, size=4), bits=8, topology="ring")
    with pytest.raises(ValueError, match="topology='directed_ring', this run has 'ring'"):
        ring.load_state_dict(state)
    other = dec.LowPrecisionDecentralizedSGD(params, SimpleNamespace(rank=0, size=4), bits=4)
    with pytest.raises(ValueError, match="bits=8, this run has 4"):
        other.load_state_dict(state)
    moved = dec.LowPrecisionDecentralizedSGD(params, SimpleNamespace(rank=2, size=4), bits=8)
    with pytest.raises(ValueError, match="rank=0, this run has 2"):
        moved.load_state_dict(state)
    d = dec.DecentralizedSGD(params, SimpleNamespace(rank=0, size=4))
    with pytest.raises(ValueError, match="size=4, this run has 2"):
        dec.DecentralizedSGD(params, SimpleNamespace(rank=0, size=2)).load_state_dict(d.state_dict())
