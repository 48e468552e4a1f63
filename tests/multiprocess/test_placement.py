"""A cluster on one host: each pair's emulated link (AQPIPE_LINK_MATRIX) delays its boundary messages at its own rate
and latency, and paces the collectives: the replicas' sync at the group's slowest link, the step's tables (one round
of direct messages) at each rank's slowest pair; AQPIPE_COMPUTE_SLOWDOWN stretches a rank's compute; and
`--placement auto` on every rank measures one table and takes one plan."""
import statistics
import time

import torch
import torch.distributed as dist

from aqpipe.data_parallel import Comm
from aqpipe.pipeline import Grid, build_groups
from aqpipe.pipeline.emulated_link import LinkMatrix
from aqpipe.pipeline.transport import Wire
from aqpipe.plan import CostModel, parse
from tests.helpers.processes import spawn

MB = 1_000_000
# rank 0 -> 1: 8 Mbit/s and 50 ms; 0 -> 2: 80 Mbit/s and 5 ms; 1 <-> 2: 16 Mbit/s and 20 ms (both ways alike)
LATENCY = [[0.0, 0.05, 0.005], [0.05, 0.0, 0.02], [0.005, 0.02, 0.0]]
RATE = [[0.0, 1e6, 1e7], [1e6, 0.0, 2e6], [1e7, 2e6, 0.0]]  # bytes a second


def links(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    matrix = LinkMatrix(rank, LATENCY, RATE)
    wire = Wire(matrix=matrix)
    out = {}
    payload = torch.zeros(MB // 4, dtype=torch.uint8)  # 250 kB
    for src, dst in ((0, 1), (0, 2)):
        dist.barrier()
        started = time.monotonic()
        if rank == src:
            wire.send(payload, dst)
            wire.flush()
        elif rank == dst:
            wire.post(payload.numel(), src, torch.device("cpu")).wait()
            out[(src, dst)] = time.monotonic() - started
    comm = Comm(dist.group.WORLD, [0, 1, 2], pace=matrix.pace)  # the replicas' sync over all three
    dist.barrier()
    started = time.monotonic()
    comm.allreduce_mean_(torch.ones(3 * MB // 4))  # 3 MB of float32
    out["allreduce"] = time.monotonic() - started
    groups = build_groups(Grid.for_world(3, 3), rank)  # one pipeline of three: the step's table over it
    groups.pace = matrix.pace
    dist.barrier()
    started = time.monotonic()
    rows = groups.gather(torch.full((256,), float(rank), dtype=torch.float64), "pipeline")  # 2 kB a row
    out["table"] = time.monotonic() - started
    out["rows"] = rows[:, 0].tolist()
    return out


def test_each_pair_carries_its_messages_at_its_own_rate_and_the_collectives_at_the_slowest_links():
    ranks = spawn(links, 3)
    got = {**ranks[1], **ranks[2]}
    slow, fast = 0.25 + 0.05, 0.025 + 0.005  # 250 kB at 1 MB/s and 10 MB/s, then the latency
    assert slow <= got[(0, 1)] < slow + 0.15, got
    assert fast <= got[(0, 2)] < fast + 0.15, got
    ring = 4 * (1e6 / 1e6 + 0.05)  # 2 (3-1) hops of a third of 3 MB, at the ring's slowest link (0 <-> 1)
    # the table: one round, each rank's row straight to the others; a rank waits for its slowest pair, not the ring's
    # 2 (3-1) hops (0.20 s)
    table = {0: 2048 / 1e6 + 0.05, 1: 2048 / 1e6 + 0.05, 2: 2048 / 2e6 + 0.02}
    for me, rank in enumerate(ranks):
        assert ring <= rank["allreduce"] < ring + 0.5, rank
        assert table[me] <= rank["table"] < table[me] + 0.12, (me, rank["table"])
        assert rank["rows"] == [0.0, 1.0, 2.0], rank["rows"]


def slowed(rank: int, world: int) -> dict:
    """One stage's toy steps, its compute stretched 1x then 3x (the same batches, the same work)."""
    from aqpipe.pipeline import EngineSettings, PipelineEngine, owned_parameters
    from tests.helpers.toy import toy_batches, toy_stages

    torch.set_num_threads(1)
    out = {}
    for factor in (1.0, 3.0):
        stage = toy_stages(1, num_blocks=8, hidden=256)[0]
        engine = PipelineEngine(stage, build_groups(Grid.for_world(1, 1), 0),
                                torch.optim.SGD(owned_parameters(stage, {}), lr=0.1),
                                EngineSettings(num_samples=64, seq_len=64, compute_slowdown=factor))
        times = []
        for mbs in toy_batches(64, 64, 8, 2, epoch=0):
            started = time.perf_counter()
            engine.train_batch(mbs)
            times.append(time.perf_counter() - started)
        out[factor] = sorted(times)[len(times) // 2]
    return out


def test_a_slower_device_is_emulated_by_stretching_its_compute():
    times = spawn(slowed, 1)[0]
    assert times[3.0] > 2.2 * times[1.0], times


# four machines in two regions the rendezvous interleaved (a, b, a, b), rank 3 five times slower
REGIONS = [[0.0 if i == j else (0.001 if i % 2 == j % 2 else 0.03) for j in range(4)] for i in range(4)]
REGION_RATES = [[0.0 if i == j else (1e8 if i % 2 == j % 2 else 1e6) for j in range(4)] for i in range(4)]
SLOWDOWNS = [1.0, 1.0, 1.0, 5.0]


def seated(rank: int, world: int, directory: str) -> dict:
    from aqpipe.models import resolve_model
    from aqpipe.data import load_tokenizer
    from aqpipe.plan import profile
    from aqpipe.plan.seat import seat
    from aqpipe.pipeline import CompressionConfig
    from aqpipe.pipeline.adapters import LoraSettings
    from aqpipe.settings import build
    from aqpipe.world import World

    import os

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # one machine, as torchrun says it
    torch.set_num_threads(1)
    cfg = build("causal_lm", {"model": directory, "seq_len": 16, "pipeline_stages": 2, "replicas": 2,
                              "micro_batch_size": 2, "num_micro_batches": 4, "placement": "auto",
                              "compression": CompressionConfig(), "output_dir": f"{directory}/../out{rank}",
                              "lora": LoraSettings(rank=4)})  # adapters: the replicas' sync is light
    spec = resolve_model(directory, "llama", "causal_lm", load_tokenizer(directory), 16, None, frozen=True)
    here = World(rank, world, rank, torch.device("cpu"), link_matrix=LinkMatrix(rank, REGIONS, REGION_RATES),
                 compute_slowdown=SLOWDOWNS[rank])
    table, _ = profile.measure(cfg, here, spec.model_class, spec.config, 64 << 10)
    grid, resolved, chosen = seat(cfg, here, spec.model_class, spec.config)
    return {"table": table.to_dict(), "placement": grid.placement, "blocks": resolved.distributed.partition,
            "plan": chosen.to_dict()}


def seated_work(directory: str):
    """The workload `seated` plans (its settings, its model)."""
    from aqpipe.data import load_tokenizer
    from aqpipe.models import resolve_model
    from aqpipe.pipeline import CompressionConfig
    from aqpipe.pipeline.adapters import LoraSettings
    from aqpipe.plan import workload
    from aqpipe.settings import build

    cfg = build("causal_lm", {"model": directory, "seq_len": 16, "pipeline_stages": 2, "replicas": 2,
                              "micro_batch_size": 2, "num_micro_batches": 4, "compression": CompressionConfig(),
                              "lora": LoraSettings(rank=4)})
    spec = resolve_model(directory, "llama", "causal_lm", load_tokenizer(directory), 16, None, frozen=True)
    return workload.build(cfg, spec.model_class, spec.config, 1.0)


def test_every_rank_measures_one_table_and_takes_one_plan(tmp_path):
    from tests.helpers.files import tiny_llama_dir

    directory = str(tiny_llama_dir(tmp_path / "llama", blocks=6))
    ranks = spawn(seated, 4, directory)
    first = ranks[0]
    assert all(r["table"] == first["table"] and r["plan"] == first["plan"] for r in ranks)
    assert all(r["placement"] == first["placement"] and r["blocks"] == first["blocks"] for r in ranks)
    links = {(x["from"], x["to"]): x for x in first["table"]["links"]}
    for (i, j), link in links.items():  # the emulated links, as measured through them (a fast one's rate at 64 kB
        assert abs(link["latency_ms"] - REGIONS[i][j] * 1e3) < 5, link  # is the software's as much as the link's)
        if i % 2 != j % 2:
            assert 0.6 < link["mbit"] / (REGION_RATES[i][j] * 8e-6) < 1.5, link
        else:
            assert link["mbit"] > 5 * REGION_RATES[0][1] * 8e-6, link
    blocks = [m["block_ms"] for m in first["table"]["machines"]]
    assert blocks[3] > 2 * statistics.median(blocks[:3]), blocks  # the slowed machine, as measured
    placement = first["placement"]  # each pipeline within a region (the sync is light, the boundaries' latency is not)
    assert {placement[0] % 2, placement[1] % 2} in ({0}, {1}) and \
        {placement[2] % 2, placement[3] % 2} in ({0}, {1}), first["plan"]
    # the slow machine is made up for: its stage holds fewer blocks than it would were that machine as fast as the
    # others, or its replica takes fewer of the step's micro-batches (a split paced by the faster replica)
    table = dict(first["table"])
    table["machines"] = [dict(m, block_ms=statistics.median(blocks[:3])) if i == 3 else m
                         for i, m in enumerate(table["machines"])]
    even = CostModel(parse(table), seated_work(directory), 2, 2).balance(placement)
    slow_stage, slow_replica = placement.index(3) % 2, placement.index(3) // 2
    shares = first["plan"]["shares"]
    assert first["blocks"][slow_stage] < even[slow_stage] or shares[slow_replica] < shares[1 - slow_replica], \
        (first["blocks"], even, shares)


def gathered(rank: int, world: int) -> list[int]:
    group = dist.new_group([0, 1])
    comm = Comm(group, [1, 0])  # a stage's replicas as a placement may order them: replica 0 on rank 1
    return [int(t) for t in comm.allgather(torch.tensor([10 + rank]))]


def test_an_allgather_returns_the_replicas_in_their_order_not_the_ranks():
    """torch numbers a group's members by global rank; the algorithms index what they gather by replica."""
    assert spawn(gathered, 2) == [[11, 10], [11, 10]]


# what a cluster file says: every link alike but ranks 0 <-> 1, which look the fastest; what the links are: 0 <-> 1
# the slowest by far
SAID = {"machines": [{"name": f"m{i}", "block_ms": 5.0} for i in range(4)],
        "links": [{"from": a, "to": b, "mbit": 1600, "latency_ms": 0.5} for a, b in ((0, 1), (1, 0))],
        "default_link": {"mbit": 800, "latency_ms": 1.0}}
TRUE_LATENCY = [[0.0 if i == j else (0.04 if {i, j} == {0, 1} else 0.001) for j in range(4)] for i in range(4)]
TRUE_RATE = [[0.0 if i == j else (5e5 if {i, j} == {0, 1} else 1e8) for j in range(4)] for i in range(4)]


def tried(rank: int, world: int, directory: str, said: str) -> dict:
    """The plan from a cluster file that misstates one link, once as the model has it (one trial) and once with the
    model's best few played on the links as they are."""
    import os

    from aqpipe.data import load_tokenizer
    from aqpipe.models import resolve_model
    from aqpipe.pipeline import CompressionConfig
    from aqpipe.plan.seat import seat
    from aqpipe.settings import build
    from aqpipe.world import World

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    spec = None
    out = {}
    for trials in (1, 8):
        cfg = build("causal_lm", {"model": directory, "seq_len": 16, "pipeline_stages": 2, "replicas": 2,
                                  "micro_batch_size": 2, "num_micro_batches": 4, "placement": "auto", "cluster": said,
                                  "placement_trials": trials, "compression": CompressionConfig(),
                                  "output_dir": f"{directory}/../out{rank}"})
        spec = spec or resolve_model(directory, "llama", "causal_lm", load_tokenizer(directory), 16, None)
        here = World(rank, world, rank, torch.device("cpu"), link_matrix=LinkMatrix(rank, TRUE_LATENCY, TRUE_RATE))
        grid, _, chosen = seat(cfg, here, spec.model_class, spec.config)
        out[trials] = {"placement": grid.placement, "plan": chosen.to_dict()}
    return out


def apart(placement: list[int], a: int, b: int) -> bool:
    """Whether ranks a and b are neither neighbouring stages of one replica nor replicas of one stage (2 x 2)."""
    (sa, ra), (sb, rb) = ((p % 2, p // 2) for p in (placement.index(a), placement.index(b)))
    return sa != sb and ra != rb


def test_the_model_s_best_few_are_measured_and_the_fastest_taken(tmp_path):
    """The model, misled into pricing the slowest link as the fastest, puts ranks 0 and 1 together; played on the
    links as they are, the candidates show it, and the run takes one that keeps them apart."""
    import json

    from tests.helpers.files import tiny_llama_dir

    directory = str(tiny_llama_dir(tmp_path / "llama", blocks=4))
    said = tmp_path / "said.json"
    said.write_text(json.dumps(SAID))
    ranks = spawn(tried, 4, directory, str(said))
    first = ranks[0]
    assert all(r == first for r in ranks)  # every rank played the same candidates and took the same one
    assert not apart(first[1]["placement"], 0, 1), first[1]  # the model alone is misled
    played = first[8]["plan"]["candidates"]
    assert len(played) >= 3 and all(c["measured_step_s"] is not None for c in played), played
    assert first[8]["plan"]["measured"] and apart(first[8]["placement"], 0, 1), first[8]
    fastest = min(played, key=lambda c: c["measured_step_s"])
    assert fastest["placement"] == first[8]["placement"], played
    together = [c["measured_step_s"] for c in played if not apart(c["placement"], 0, 1)]
    # a placement that keeps 0 and 1 together crosses their link at least twice a step: 40 ms each way, at least
    assert together and min(together) > fastest["measured_step_s"] + 0.08, played


def played(rank: int, world: int, directory: str) -> dict:
    """Two placements of 2 stages x 2 replicas played under each schedule, over links of 30 ms each way."""
    import os

    from aqpipe.data import load_tokenizer
    from aqpipe.models import resolve_model
    from aqpipe.pipeline import CompressionConfig
    from aqpipe.plan import Prediction, trials, workload
    from aqpipe.plan.search import Candidate
    from aqpipe.settings import build
    from aqpipe.world import World

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    latency = [[0.0 if i == j else 0.03 for j in range(4)] for i in range(4)]
    rate = [[0.0 if i == j else 1e9 for j in range(4)] for i in range(4)]
    here = World(rank, world, rank, torch.device("cpu"), link_matrix=LinkMatrix(rank, latency, rate))
    spec = None
    out = {}
    for schedule in ("gpipe", "zb1"):  # 1F1B: the test above
        cfg = build("causal_lm", {"model": directory, "seq_len": 16, "pipeline_stages": 2, "replicas": 2,
                                  "micro_batch_size": 2, "num_micro_batches": 3, "schedule": schedule,
                                  "compression": CompressionConfig(), "output_dir": f"{directory}/../out{rank}"})
        spec = spec or resolve_model(directory, "llama", "causal_lm", load_tokenizer(directory), 16, None)
        work = workload.build(cfg, spec.model_class, spec.config, 1.0)
        guess = Prediction(1.0, 1.0, 1.0)
        candidates = (Candidate([0, 1, 2, 3], [2, 2], guess), Candidate([3, 0, 1, 2], [3, 1], guess))
        out[schedule] = [c.measured for c in trials.run(candidates, work, 2, here, cfg, spec.model_class, spec.config)]
    return out


def test_a_trial_plays_every_schedule_to_its_end_through_the_links(tmp_path):
    """Under gpipe and zero-bubble as under 1F1B, every rank's part of a trial step completes (each receive meets its
    send), all ranks read one step, and it holds at least what the links make it wait: an activation forward and
    its gradient back, the pipeline's table round and the replicas' ring of 2 hops, 30 ms each, in turn."""
    from tests.helpers.files import tiny_llama_dir

    ranks = spawn(played, 4, str(tiny_llama_dir(tmp_path / "llama", blocks=4)))
    assert all(r == ranks[0] for r in ranks), ranks
    for schedule, steps in ranks[0].items():
        assert len(steps) == 2 and all(0.03 * 4 <= s < 5.0 for s in steps), (schedule, steps)
