"""Qsparse-local-SGD: the paper's update on R workers against a one-process reference, bytes, memory, resume."""
import math

import pytest
import torch

from aqpipe.compression import QuantizedTensor, randk, topk
from aqpipe.data_parallel import qsparse  # noqa: F401  (registers "qsparse_local_sgd")
from aqpipe.data_parallel.base import create
from aqpipe.data_parallel.comm import Comm
from aqpipe.data_parallel.flat import worker_seed
from aqpipe.data_parallel.qsparse import QsparseLocalSGD, decode_indices, encode_indices
from tests.helpers.processes import spawn
from tests.helpers.dp_toy import flat, loss_of, restored, straight_and_saved, train_steps

LR, H, STEPS, RATIO = 0.1, 3, 9, 0.1
N = 420  # parameters of make_model()
K = math.ceil(RATIO * N - 1e-9)  # 42


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


# ----------------------------------------------------------------------------- the reference
def reference(world: int, sparsifier: str, bits: int | None, seed: int = 0, memory: bool = True) -> list:
    """The paper's rule on `world` workers in one process (plain SGD locally); history of every worker's model."""
    model = make_model()
    params = list(model.parameters())
    anchor = flat(model)
    xs = [anchor.clone() for _ in range(world)]
    mems = [torch.zeros(N) for _ in range(world)]
    gens = [torch.Generator().manual_seed(worker_seed(seed, r)) for r in range(world)]
    history = []
    for t in range(1, STEPS + 1):
        for r in range(world):
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(xs[r], params)
            model.zero_grad()
            loss_of(model, r, t - 1).backward()
            xs[r] = xs[r] - LR * torch.cat([p.grad.reshape(-1) for p in params])
        if t % H == 0:
            cs = []
            for r in range(world):
                delta = mems[r] + anchor - xs[r]
                sp = topk(delta, K) if sparsifier == "topk" else randk(delta, K, generator=gens[r])
                if bits is not None:
                    sp = sp.quantize(bits, generator=gens[r])
                c = sp.to_dense()
                if memory:
                    mems[r] = delta - c
                cs.append(c)
            anchor = anchor - sum(cs) / world
            xs = [anchor.clone() for _ in range(world)]
        history.append([x.clone() for x in xs])
    return history, mems


# ----------------------------------------------------------------------------- the workers
def train(rank: int, world: int, sparsifier: str, bits: int | None) -> dict:
    comm = Comm(None, list(range(world)))
    model = make_model()
    algo = create("qsparse_local_sgd", list(model.parameters()), comm, local_steps=H, topk_ratio=RATIO,
                  sparsifier=sparsifier, bits=bits)
    opt = algo.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    history, sent = [], []
    train_steps(model, algo, opt, rank, range(STEPS),
                on_step=lambda: (history.append(flat(model)), sent.append(comm.take_bytes())))
    return {"history": history, "sent": sent, "memory": algo.memory.clone(), "k": algo.k, "syncs": algo.syncs}


def resume(rank: int, world: int, total: int, cut: int) -> dict:
    comm = Comm(None, list(range(world)))

    def build():
        model = make_model()
        algo = QsparseLocalSGD(list(model.parameters()), comm, local_steps=H, topk_ratio=RATIO,
                               sparsifier="randk", bits=3, seed=7)
        return model, algo, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    straight, saved = straight_and_saved(build, rank, total, cut)
    out = {"straight": flat(straight[0])}
    for label in ("resumed", "no_memory"):
        fresh = restored(build, saved)
        if label == "no_memory":  # control: everything but the error memory
            fresh[1].memory.zero_()
        train_steps(*fresh, rank, range(cut, total))
        out[label] = flat(fresh[0])
    return out


def scenario(rank: int, world: int) -> dict:
    """Everything the tests need from one set of processes (starting them is the slow part)."""
    if world == 2:
        out = {"topk": train(rank, world, "topk", None), "randk": train(rank, world, "randk", 4),
               "resume": resume(rank, world, 8, 4)}
    else:
        out = {"topk8": train(rank, world, "topk", 8)}
    return out


@pytest.fixture(scope="module")
def two():
    return spawn(scenario, 2)


@pytest.fixture(scope="module")
def four():
    return spawn(scenario, 4)


def check(results: list[dict], sparsifier: str, bits: int | None) -> None:
    world = len(results)
    ref, mems = reference(world, sparsifier, bits)
    for t in range(STEPS):
        synced = (t + 1) % H == 0
        for r, res in enumerate(results):
            assert torch.allclose(res["history"][t], ref[t][r], atol=1e-6, rtol=0), f"rank {r} step {t + 1}"
            if synced:
                assert torch.equal(res["history"][t], results[0]["history"][t]), f"replicas differ after sync {t + 1}"
        if not synced and world > 1:
            assert not torch.allclose(results[0]["history"][t], results[1]["history"][t])  # local steps drift
    for r, res in enumerate(results):
        assert res["syncs"] == STEPS // H and res["k"] == K
        assert torch.allclose(res["memory"], mems[r], atol=1e-6)
        assert float(res["memory"].abs().max()) > 0


# ----------------------------------------------------------------------------- the update rule
def test_topk_without_quantization_is_the_reference_exactly(two):
    check([r["topk"] for r in two], "topk", None)


def test_randk_quantized_matches_the_reference_with_the_same_generators(two):
    check([r["randk"] for r in two], "randk", 4)


def test_four_replicas_topk_8_bits(four):
    check([r["topk8"] for r in four], "topk", 8)


def test_the_memory_changes_the_result(two):
    without, _ = reference(2, "topk", None, memory=False)
    assert not torch.allclose(two[0]["topk"]["history"][-1], without[-1][0], atol=1e-5)


# ----------------------------------------------------------------------------- bytes
def test_nothing_between_syncs_and_k_indices_plus_values_at_a_sync(two, four):
    for res in two:  # float32 values
        assert res["topk"]["sent"] == [0, 0, 1 * (4 * K + 4 * K)] * 3
        assert res["randk"]["sent"] == [0, 0, 1 * (4 * K + QuantizedTensor.wire_nbytes((K,), 4))] * 3
    for res in four:  # 8-bit values: one byte each plus one group's min and step
        assert res["topk8"]["sent"] == [0, 0, 3 * (4 * K + K + 8)] * 3
    per_step = sum(four[0]["topk8"]["sent"]) / STEPS
    allreduce = 2 * 3 * 4 * N / 4
    assert per_step / allreduce < 0.1, per_step / allreduce


def test_index_bytes_round_trip_little_endian():
    idx = torch.tensor([0, 1, 255, 256, 65_535, 2**31 + 5, 2**32 - 1])
    buf = encode_indices(idx, 4)
    assert buf.dtype == torch.uint8 and buf.numel() == 28
    assert buf[12:16].tolist() == [0, 1, 0, 0]  # 256, least significant byte first
    assert torch.equal(decode_indices(buf, 4), idx)
    big = torch.tensor([2**40 + 3])
    assert torch.equal(decode_indices(encode_indices(big, 8), 8), big)


# ----------------------------------------------------------------------------- error feedback, one process
def test_error_memory_is_kept_and_sent_at_the_next_sync():
    model = make_model()
    algo = QsparseLocalSGD(list(model.parameters()), Comm(None, None), local_steps=2, topk_ratio=RATIO, bits=None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = flat(model)
    seen = []
    for t in range(4):
        opt.zero_grad()
        loss_of(model, 0, t).backward()
        algo.after_backward()
        opt.step()
        before = (algo.anchor.clone(), flat(model), algo.memory.clone())
        algo.after_step()
        if (t + 1) % 2 == 0:
            seen.append((before, flat(model), algo.memory.clone()))
    assert torch.equal(seen[0][0][0], start)  # θ was the model before the first step
    for (anchor, local, memory), after, new_memory in seen:
        delta = memory + anchor - local
        c = topk(delta, K).to_dense()
        assert torch.allclose(after, anchor - c, atol=1e-7)
        assert torch.allclose(new_memory, delta - c, atol=1e-7)
        assert algo.comm.sent_bytes == 0
    first_memory = seen[0][2]
    assert float(first_memory.abs().max()) > 0  # 90% of the drift stayed behind ...
    assert torch.equal(seen[1][0][2], first_memory)  # ... and went into the second message
    anchor, local, memory = seen[1][0]
    assert not torch.allclose(anchor - topk(anchor - local, K).to_dense(), seen[1][1])  # it mattered


def test_weights_loaded_after_construction_are_the_starting_point():
    model = make_model()
    algo = QsparseLocalSGD(list(model.parameters()), Comm(None, None), local_steps=1, topk_ratio=1.0, bits=None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loss_of(model, 0, 0).backward()
    algo.after_backward()
    assert torch.equal(algo.anchor, flat(model))


def test_after_step_without_after_backward_is_an_error():
    model = make_model()
    algo = QsparseLocalSGD(list(model.parameters()), Comm(None, None))
    with pytest.raises(RuntimeError, match="after_backward"):
        algo.after_step()


# ----------------------------------------------------------------------------- resume
def test_state_dict_round_trip_resumes_exactly(two):
    for res in two:
        res = res["resume"]
        assert torch.equal(res["resumed"], res["straight"])
        assert not torch.equal(res["no_memory"], res["straight"])


def test_load_state_dict_refuses_another_model():
    a = QsparseLocalSGD(list(make_model().parameters()), Comm(None, None))
    b = QsparseLocalSGD([torch.nn.Parameter(torch.zeros(3))], Comm(None, None))
    with pytest.raises(ValueError, match="memory has 420 elements"):
        b.load_state_dict(a.state_dict())


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("options, message", [
    ({"local_steps": 0}, "local_steps=0"), ({"local_steps": 1.5}, "local_steps=1.5"),
    ({"local_steps": True}, "local_steps=True"),
    ({"topk_ratio": 0}, "topk_ratio=0"), ({"topk_ratio": 1.5}, "topk_ratio=1.5"),
    ({"topk_ratio": -0.1}, "topk_ratio=-0.1"), ({"topk_ratio": float("nan")}, "topk_ratio=nan"),
    ({"sparsifier": "bottomk"}, "sparsifier='bottomk'.*topk, randk"),
    ({"bits": 0}, "bits=0"), ({"bits": 9}, "bits=9"), ({"bits": "8"}, "bits='8'"),
    ({"seed": -1}, "seed=-1"), ({"momentum": 0.9}, "unknown option"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        QsparseLocalSGD(list(make_model().parameters()), Comm(None, None), **options)


def test_k_is_the_ceiling_of_ratio_times_numel():
    params = list(make_model().parameters())
    assert QsparseLocalSGD(params, Comm(None, None), topk_ratio=0.1).k == 42  # not 43 from 42.000000000000004
    assert QsparseLocalSGD(params, Comm(None, None), topk_ratio=0.01).k == 5  # ceil(4.2)
    assert QsparseLocalSGD(params, Comm(None, None), topk_ratio=1e-9).k == 1
    assert QsparseLocalSGD(params, Comm(None, None), topk_ratio=1).k == 420
