"""Every random stream a run draws from is its own: each boundary and direction, each tied weight's rows and
gradients, each replica, each stage's data-parallel algorithm. The streams are enumerated, not picked: every
`torch.Generator` reachable from a real run's engine (its codecs, their parts, the replicas' algorithm), as the
trainer builds it (train.build_engine), 3 stages x 2 replicas of a tied Llama. The two sides of one wire hold the
same stream (only the sender draws); nothing else may."""
from collections import defaultdict

import pytest
import torch

from aqpipe.data import load_tokenizer
from aqpipe.data_parallel import DataParallelConfig
from aqpipe.models import resolve_model
from aqpipe.pipeline import CompressionConfig
from aqpipe.settings import build
from aqpipe.world import World
from tests.helpers.files import tiny_llama_dir
from tests.helpers.processes import spawn

SEQ, STAGES, REPLICAS = 8, 3, 2
CONFIGS = {
    # the trainer's AQ-SGD (kept rows, first visits as 3-bit changes from a running base), the tie's rows as AQ-SGD
    # changes and its gradients in a basis, and a data-parallel algorithm that dithers
    "aqsgd": (CompressionConfig(forward="aqsgd", forward_bits=2, backward="direct", backward_bits=4,
                                first_visit="auto", first_visit_bits=3, first_visit_base="position", tie="aqsgd",
                                tie_bits=8, tie_rank=4),
              DataParallelConfig(replicas=REPLICAS, algorithm="cocktail_sgd")),
    "subspace": (CompressionConfig(forward="subspace", forward_bits=4, backward="subspace", backward_bits=4,
                                   subspace_rank=4, tie="aqsgd", tie_bits=8),
                 DataParallelConfig(replicas=REPLICAS, algorithm="qsparse_local_sgd")),
}


def draws(owner) -> bool:
    """Whether a generator's owner draws from it: a codec that sends full precision, or rounds to nearest, never
    does (it holds one all the same, for its state's shape)."""
    return getattr(owner, "mode", None) != "none" and getattr(owner, "stochastic", True)


def generators(obj, path="", seen=None, owner=None):
    """(attribute path, generator) of every torch.Generator reachable from `obj` through attributes, lists, tuples
    and dicts (tensors and modules are leaves) that its owner draws from."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, str, bytes, int, float, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Generator):
        if draws(owner):
            yield path, obj
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for key, value in items:
        yield from generators(value, f"{path}.{key}", seen, obj)


def streams(rank: int, world: int, directory: str, name: str) -> dict[tuple, int]:
    """This rank's streams by the wire (or algorithm) they belong to, whichever side holds them."""
    from aqpipe.train import build_engine

    torch.set_num_threads(1)
    compression, dp = CONFIGS[name]
    cfg = build("causal_lm", {"model": directory, "seq_len": SEQ, "pipeline_stages": STAGES, "scheduler": None,
                              "compression": compression, "data_parallel": dp, "partition": [1, 1, 1]})
    spec = resolve_model(directory, "llama", "causal_lm", load_tokenizer(directory), SEQ, None)
    engine = build_engine(cfg, spec, World(rank, world, rank, torch.device("cpu")), 64, 10)
    stage, replica = engine.groups.stage, engine.groups.replica
    out = {}
    for codec_name, codec in engine.codecs().items():
        side, _, rest = codec_name.partition(".")
        wire = {"prev": f"boundary {stage - 1}", "next": f"boundary {stage}"}.get(side, codec_name)
        wire = f"{wire}.{rest}" if side in ("prev", "next") else wire
        for path, g in generators(codec, seen=set()):
            out[(replica, wire, path)] = g.initial_seed()
    for path, g in generators(engine.data_parallel, seen=set()):
        out[(replica, f"data_parallel stage {stage}", path)] = g.initial_seed()
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(tiny_llama_dir(tmp_path_factory.mktemp("streams") / "llama", blocks=STAGES))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_stream_of_a_run_is_its_own_and_the_same_on_both_sides_of_its_wire(llama, name):
    by_rank = spawn(streams, STAGES * REPLICAS, llama, name)
    held = defaultdict(set)
    for found in by_rank:
        for key, seed in found.items():
            held[key].add(seed)
    assert all(len(seeds) == 1 for seeds in held.values()), {k: v for k, v in held.items() if len(v) > 1}
    seeds = {key: seeds.pop() for key, seeds in held.items()}
    wires = {(wire, path) for _, wire, path in seeds}
    # what a run of 3 stages draws from in each replica: 2 boundaries, 2 tied links (the embedding to the last stage's
    # head: one each way is one link), 3 stages' algorithms
    assert {w for w, _ in wires if w.startswith("boundary")} >= {"boundary 0.forward", "boundary 1.backward"}
    assert {w for w, _ in wires if w.startswith("data_parallel")} == {f"data_parallel stage {s}" for s in range(3)}
    assert any(w.startswith("tie.") for w, _ in wires)
    assert len(seeds) == REPLICAS * len(wires)  # every stream in every replica
    collide = defaultdict(list)
    for key, seed in seeds.items():
        collide[seed].append(key)
    assert len(collide) == len(seeds), [keys for keys in collide.values() if len(keys) > 1]
