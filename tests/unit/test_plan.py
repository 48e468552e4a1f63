"""The plan: cluster tables read and refused in one line, the cost model's parts, the exact search against a brute
force that knows no symmetry, the heuristic within 5% of the exact optimum, blocks in proportion to speed, and the
memory a stage needs."""
import itertools
import json
import random
from dataclasses import replace

import pytest

from aqpipe.pipeline import Grid
from aqpipe.plan import CostModel, Workload, parse, plan, read
from aqpipe.plan.cost import ring_seconds
from aqpipe.plan.profile import rounds
from aqpipe.plan.seat import read_plan

WORK = Workload(blocks=8, block_flops=1e9, first_extra=0.0, last_extra=0.5, micro_batches=4, schedule="1f1b",
                forward_bytes=2e5, backward_bytes=2e5, tie_bytes=0, block_trained=100_000, first_trained=0,
                last_trained=0, dp_bytes_per_parameter=4.0, dp_kind="ring", block_memory=1e6,
                activation_memory=1e5, first_memory=0, last_memory=0)
TWO_REGIONS = {"a": {"a": {"mbit": 1000, "latency_ms": 0.1}, "b": {"mbit": 20, "latency_ms": 20}},
               "b": {"b": {"mbit": 1000, "latency_ms": 0.1}}}


def random_cluster(rng: random.Random, n: int):
    return parse({"machines": [{"region": rng.choice("abc"), "block_ms": rng.choice([10, 10, 25])}
                               for _ in range(n)],
                  "regions": {a: {b: {"mbit": 1000 if a == b else rng.choice([10, 50, 200]),
                                      "latency_ms": 0.1 if a == b else rng.choice([5, 40, 100])}
                                  for b in "abc" if b >= a} for a in "abc"}})


def test_a_cluster_file_gives_each_pair_its_link_the_specific_one_first(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("""
machines:
  - {name: a0, region: a, block_ms: 10, memory_gb: 2}
  - {name: b0, region: b, tflops: 50}
  - {name: c0, block_ms: 20}
regions: {a: {a: {mbit: 1000, latency_ms: 0.1}, b: {mbit: 20, latency_ms: 30}}}
links: [{from: a0, to: c0, mbit: 8, latency_ms: 5}]
default_link: {mbit: 100, latency_ms: 1}
""")
    c = read(path, ranks=3)
    assert c.rate[0][1] == c.rate[1][0] == 20e6 / 8 and c.latency[1][0] == 0.03  # a region pair, both ways
    assert c.rate[0][2] == 1e6 and c.latency[2][0] == 0.005  # the pair's own link, both ways
    assert c.rate[1][2] == 100e6 / 8  # neither: the default
    assert c.seconds(0, 1, 2.5e6) == pytest.approx(1.0 + 0.03)
    assert c.block_seconds(1, 1e12) == pytest.approx(1 / 50) and c.block_seconds(0, 1e12) == 0.01
    assert c.machines[0].memory_bytes == 2e9
    again = tmp_path / "again.json"
    c.write(again)  # what a profile writes reads back as the same table
    back = read(again)
    assert back.rate == c.rate and back.latency == c.latency
    assert [m.block_s for m in back.machines] == [m.block_s for m in c.machines]


@pytest.mark.parametrize("text,message", [
    ("machines: []", "expected a mapping with a list of machines"),
    ("machines: [{block_ms: 10}, {region: a}]", r"machines\[1\]: no speed; expected block_ms .* or tflops"),
    ("machines: [{block_ms: -1}]", r"machines\[0\]\.block_ms=-1: expected a number > 0"),
    ("machines: [{block_ms: 1, speed: 2}]", r"machines\[0\]: unknown key\(s\) speed"),
    ("machines: [{block_ms: 1}, {block_ms: 1}]", "no link from rank0 to rank1"),
    ("machines: [{block_ms: 1}, {block_ms: 1}]\nlinks: [{from: 0, to: 7, mbit: 1}]",
     r"links\[0\]\.to=7: expected a machine's name or rank \(0\.\.1\)"),
    ("machines: [{block_ms: 1}, {block_ms: 1}]\ndefault_link: {mbit: 0}", r"default_link\.mbit=0: expected a number"),
    ("machines: [{block_ms: 1}]\nextra: 1", r"unknown key\(s\) extra"),
    ("machines: [{block_ms: 1}, {block_ms: 1}]\ndefault_link: {mbit: 5}\n", "2 machines for a run of 4 ranks"),
    ("{{{", "not YAML or JSON"),
])
def test_a_bad_cluster_file_is_refused_in_one_line_naming_the_field(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as refused:
        read(path, ranks=4 if "run of 4" in message else None)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


def test_the_step_is_the_schedule_the_tables_and_the_sync():
    """Two stages on one fast pair and a slow one between them: the boundary's messages cross the slow link (its
    rate and latency), the replicas' sync rings over the fast ones."""
    cluster = parse({"machines": [{"region": r, "block_ms": 10} for r in "abab"], "regions": TWO_REGIONS})
    model = CostModel(cluster, WORK, 2, 2)
    crossing = model.predict([0, 1, 2, 3], (4, 4))
    inside = model.predict([0, 2, 1, 3], (4, 4))  # each pipeline in a region, each stage's replicas across
    assert crossing.boundaries[0] == pytest.approx(4 * 2 * (2e5 / 2.5e6 + 0.02))  # 4 micro-batches each way
    assert inside.boundaries[0] == pytest.approx(4 * 2 * (2e5 / 125e6 + 0.0001))
    assert inside.data_parallel == pytest.approx(ring_seconds(cluster, [0, 1], 4.0 * 4 * 100_000))
    assert crossing.data_parallel == pytest.approx(ring_seconds(cluster, [0, 2], 4.0 * 4 * 100_000))
    # the step's tables, each one round of direct messages at its slowest pair: the job's table and the sync's byte
    # count over the job (across the regions either way), the norm after the sync over each pipeline
    across, near = 1024 / 2.5e6 + 0.02, 1024 / 125e6 + 0.0001
    assert crossing.tables == pytest.approx(3 * across)
    assert inside.tables == pytest.approx(2 * across + near)
    assert crossing.step == pytest.approx(crossing.pipeline + crossing.tables + crossing.data_parallel)
    assert crossing.compute == pytest.approx(4 * (4 + 0.5) * 0.01)  # the last stage's head


@pytest.mark.parametrize("speeds", [(10, 30), (30, 10), (10, 10, 25), (25, 10, 10, 10)])
def test_blocks_go_to_the_faster_stages_as_the_slowest_stage_is_fastest(speeds):
    """Against every split of the 8 blocks: the slowest stage's compute (its blocks and the last one's half block of
    head, at its machine's pace) is the least any split gives, with more blocks on the faster machines."""
    cluster = parse({"machines": [{"block_ms": ms} for ms in speeds], "default_link": {"mbit": 1000}})
    S = len(speeds)
    model = CostModel(cluster, WORK, S, 1)

    def slowest(split):
        return max((split[s] + (0.5 if s == S - 1 else 0)) * speeds[s] for s in range(S))

    splits = [c for c in itertools.product(range(1, 9), repeat=S) if sum(c) == 8]
    chosen = model.balance(list(range(S)))
    assert sum(chosen) == 8 and slowest(chosen) == min(slowest(c) for c in splits)
    fast, slow = speeds.index(min(speeds)), speeds.index(max(speeds))
    assert chosen[fast] > chosen[slow]


def brute_force(cluster, stages, replicas):
    """Every assignment of ranks to places, no symmetry used, blocks balanced as the plan balances them (paced by each
    stage's slowest replica, or its fastest)."""
    model = CostModel(cluster, WORK, stages, replicas)
    return min(model.predict(list(p), model.balance(list(p), fastest)).step
               for p in itertools.permutations(range(stages * replicas)) for fastest in (False, True))


@pytest.mark.parametrize("stages,replicas", [(2, 2), (3, 2), (2, 3)])
def test_the_exact_search_finds_brute_forces_optimum(stages, replicas):
    rng = random.Random(stages * 10 + replicas)
    for _ in range(3):
        cluster = random_cluster(rng, stages * replicas)
        chosen = plan(cluster, WORK, stages, replicas)
        assert chosen.method == "exact"
        assert chosen.predicted.step == pytest.approx(brute_force(cluster, stages, replicas), rel=1e-12)


def test_the_heuristic_is_within_5_percent_of_the_exact_optimum_on_8_ranks():
    rng = random.Random(7)
    gaps = []
    for _ in range(4):
        cluster = random_cluster(rng, 8)
        exact = plan(cluster, WORK, 4, 2)
        searched = plan(cluster, WORK, 4, 2, exact_up_to=0, budget_s=60, evaluations=6000)  # as busy as may be
        assert searched.method == "search"
        gaps.append(searched.predicted.step / exact.predicted.step - 1)
    assert max(gaps) <= 0.05, gaps


def test_two_regions_interleaved_by_the_rendezvous_are_placed_one_pipeline_each():
    """The launcher numbered the machines a, b, a, b: rank order puts each boundary across the slow link; the plan
    keeps each pipeline in a region when the boundary outweighs the replicas' sync (adapters: a small sync)."""
    cluster = parse({"machines": [{"region": r, "block_ms": 10} for r in "abab"], "regions": TWO_REGIONS})
    chosen = plan(cluster, replace(WORK, block_trained=1000), 2, 2)
    regions = [cluster.machines[r].region for r in chosen.placement]
    assert regions[:2] in (["a", "a"], ["b", "b"]) and regions[2:] in (["a", "a"], ["b", "b"])
    assert chosen.rank_order.step > 2 * chosen.predicted.step


def test_a_stage_that_fits_no_machine_is_refused_naming_what_is_short():
    cluster = parse({"machines": [{"block_ms": 10, "memory_gb": 0.001}] * 2, "default_link": {"mbit": 1000}})
    with pytest.raises(ValueError, match=r"no placement of 2 stages x 1 replicas fits the machines' memory: its "
                                         r"largest stage needs .* GB, the largest machine has 0.00 GB"):
        plan(cluster, WORK, 2, 1)


def test_every_pair_meets_once_in_n_minus_1_rounds_of_disjoint_pairs():
    for n in (2, 5, 8, 16):
        played = [pair for r in rounds(n) for pair in r]
        assert len(rounds(n)) == (n - 1 if n % 2 == 0 else n)
        assert sorted(tuple(sorted(p)) for p in played) == list(itertools.combinations(range(n), 2))
        assert all(len({x for p in r for x in p}) == 2 * len(r) for r in rounds(n))


def test_a_plan_file_is_checked_against_the_run(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stages": 2, "replicas": 2, "placement": [1, 0, 3, 2], "partition": [2, 2]}))
    assert read_plan(path, 4, 2)["placement"] == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="planned for 2 stages x 2 replicas; this run has 4 stages on 8 ranks"):
        read_plan(path, 8, 4)
    path.write_text(json.dumps({"stages": 2, "replicas": 2, "placement": [1, 1, 3, 2], "partition": [2, 2]}))
    with pytest.raises(ValueError, match=r"placement \[1, 1, 3, 2\]: expected each rank of 0..3 once"):
        read_plan(path, 4, 2)
    with pytest.raises(ValueError, match="expected rank, auto or a plan file"):
        read_plan(tmp_path / "missing.json", 4, 2)


def test_a_grid_places_any_rank_anywhere_and_answers_both_ways():
    grid = Grid.for_world(6, 3, [4, 0, 2, 1, 5, 3])
    assert [grid.coords(r) for r in range(6)] == [(1, 0), (0, 1), (2, 0), (2, 1), (0, 0), (1, 1)]
    assert all(grid.rank(*grid.coords(r)) == r for r in range(6))
    assert grid.pipeline_ranks(1) == [1, 5, 3] and grid.data_parallel_ranks(0) == [4, 1]
    assert Grid.for_world(6, 3, list(range(6))) == Grid.for_world(6, 3)  # rank order is no placement at all


def test_a_ring_moves_2_k_minus_1_shares_at_its_slowest_links_pace():
    """A ring allreduce of 3 MB over 3 ranks, one link of them slow: 4 hops of 1 MB, each as long as the slow
    link takes (its rate and latency)."""
    cluster = parse({"machines": [{"block_ms": 1}] * 3, "default_link": {"mbit": 800, "latency_ms": 1},
                     "links": [{"from": 1, "to": 2, "mbit": 8, "latency_ms": 10}]})
    assert ring_seconds(cluster, [0, 1, 2], 3e6) == pytest.approx(4 * (1e6 / 1e6 + 0.01))
    assert ring_seconds(cluster, [0, 2], 3e6) == pytest.approx(2 * (1.5e6 / 100e6 + 0.001))
    assert ring_seconds(cluster, [1], 3e6) == 0.0


def test_a_stage_keeps_the_pace_of_its_slowest_replica():
    """Stage 0's replicas: one fast machine, one three times slower; stage 1's both fast. The replicas sync each
    step, so stage 0 runs at its slow replica's pace and gets the fewer blocks."""
    cluster = parse({"machines": [{"block_ms": ms} for ms in (10, 10, 30, 10)], "default_link": {"mbit": 1000}})
    model = CostModel(cluster, WORK, 2, 2)
    assert model.balance([0, 1, 2, 3]) == (2, 6)  # 2 x 30 and 6.5 x 10: any other split has a slower stage
    assert model.predict([0, 1, 2, 3], (2, 6)).compute == pytest.approx(4 * 6.5 * 0.01)


def test_aqpipe_plan_prints_who_holds_what_and_writes_the_plan_a_run_takes(tmp_path, capsys, monkeypatch):
    from transformers import LlamaConfig

    from aqpipe.cli import main

    monkeypatch.chdir(tmp_path)
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "model")
    (tmp_path / "cluster.yaml").write_text("""
machines: [{region: a, block_ms: 10}, {region: b, block_ms: 10}, {region: a, block_ms: 10}, {region: b, block_ms: 40}]
regions: {a: {a: {mbit: 1000, latency_ms: 0.1}, b: {mbit: 20, latency_ms: 30}}, b: {b: {mbit: 1000, latency_ms: 0.1}}}
""")
    code = main(["plan", "--cluster", "cluster.yaml", "--model", str(tmp_path / "model" / "config.json"),
                 "--pipeline_stages", "2", "--replicas", "2", "--lora_rank", "4", "--plan_file", "p.json"])
    out = capsys.readouterr().out
    assert code == 0, out
    written = json.loads((tmp_path / "p.json").read_text())
    assert out.startswith("plan: 4 ranks as 2 stages x 2 replicas (exact search over 13 placements")
    assert f"stage 0: {written['partition'][0]} blocks on rank(s) {written['placement'][0]} (replica 0)" in out
    assert "rank order:" in out and "written p.json: run with --placement p.json" in out
    assert sum(written["partition"]) == 6 and sorted(written["placement"]) == [0, 1, 2, 3]
    regions = ["ab"[r % 2] for r in written["placement"]]  # light sync (LoRA): each pipeline in one region
    assert regions[0] == regions[1] and regions[2] == regions[3]
    held = written["placement"].index(3) // 2  # the slow machine's replica: fewer of the step's 8 micro-batches
    assert sum(written["shares"]) == 8 and written["shares"][held] < written["shares"][1 - held]
    assert f"{written['shares'][held]} (replica {held})" in out.split("micro-batches a step by replica:")[1]
    others = written["candidates"][1:]  # what a run would play at start besides the plan
    assert written["candidates"][0]["placement"] == written["placement"] and others
    assert all(f"{c['placement']} blocks {c['partition']}" in out.split("priced within 15%")[1] for c in others), out
    assert main(["plan", "--model", "x"]) == 2 and "--cluster is required" in capsys.readouterr().err


def test_the_split_a_placement_gets_heeds_its_machines_memory():
    """Two machines alike in speed, one with room for few blocks: each placement's split is its own (the blocks go
    where they fit), and the search finds brute force's optimum (a split reused from the other placement, which
    shares its speeds, would not fit, and price it at infinity)."""
    cluster = parse({"machines": [{"block_ms": 10, "memory_gb": 0.0035}, {"block_ms": 10}],
                     "default_link": {"mbit": 1000}})  # the small one first: the placement searched first
    model = CostModel(cluster, WORK, 2, 1)
    small_first, small_last = model.balance([0, 1]), model.balance([1, 0])
    assert small_first[0] < small_first[1] and small_last[1] < small_last[0]
    assert plan(cluster, WORK, 2, 1).predicted.step == pytest.approx(brute_force(cluster, 2, 1), rel=1e-12)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_embedding_is_synced_by_the_stage_that_steps_it_alone(tied):
    """The replicas of stage 0 sync its blocks only where the head owns the tied embedding (ties.py): counted there
    too, a plan priced stage 0's sync by a whole vocabulary it never sends and gave it fewer blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe.pipeline import CompressionConfig
    from aqpipe.plan import workload
    from aqpipe.settings import build

    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    cfg = build("causal_lm", {"model": "x", "pipeline_stages": 2, "compression": CompressionConfig()})
    w = workload.build(cfg, LlamaForCausalLM, config, 1.0)
    assert w.first_trained == (0 if tied else 4096 * 32)
    assert w.last_trained == 4096 * 32 + 32  # the head (the tied weight's owner) and the final norm


def test_a_links_rate_is_read_from_two_messages_back_to_back_so_a_token_buckets_burst_does_not_raise_it():
    """tc's token bucket sends its burst at line rate after an idle moment: a 64 kB message alone over its time reads
    a 1.4 MB/s link as 1.9 MB/s, which the replicas' megabytes never see. Sent right behind it, a message four times
    its size lands its own bytes' time later: that gap reads the rate they do, with no round trip in it."""
    from aqpipe.plan.profile import LARGEST, SMALLEST, probe_sizes, second_rate

    rate, burst, latency = 1.4e6, 16384, 0.011
    small, large = probe_sizes(65536)
    assert (small, large) == (65536, 262144)
    first = latency + (small - burst) / rate  # the burst spent on the first
    second = first + large / rate
    assert second_rate(large, second - first) == pytest.approx(rate)
    assert small / (first - latency) > 1.3 * rate  # what one message's time gave
    assert probe_sizes(100) == (SMALLEST, 4 * SMALLEST) and probe_sizes(10 << 20) == (LARGEST // 4, LARGEST)


def test_the_candidates_to_measure_are_near_the_best_and_no_two_alike():
    """A measured table of four regions alike, two machines each (every figure off by up to 5%, as measurements are):
    the candidates a run plays at start are the best, then others the model prices within 15% of it, and none is
    another with alike machines swapped or the regions' roles swapped (playing it would measure the noise)."""
    rng = random.Random(3)
    regions = "abcdabcd"
    noisy = [[rng.uniform(0.95, 1.05) for _ in regions] for _ in regions]
    cluster = parse({"machines": [{"region": r, "block_ms": 10 * rng.uniform(0.95, 1.05)} for r in regions],
                     "links": [{"from": i, "to": j, "mbit": (1000 if a == b else 20) * noisy[i][j],
                                "latency_ms": (0.1 if a == b else 20) * noisy[j][i]}
                               for i, a in enumerate(regions) for j, b in enumerate(regions) if i != j]})
    chosen = plan(cluster, replace(WORK, block_trained=20_000, forward_bytes=2e4, backward_bytes=2e4), 4, 2)
    found = chosen.candidates
    assert found[0].placement == chosen.placement and len(found) >= 4, found
    steps = [c.predicted.step for c in found]
    assert steps[1:] == sorted(steps[1:]) and steps[0] == min(steps) and steps[-1] <= 1.15 * steps[0], steps

    def kind(placement: list[int]) -> tuple:  # up to renamed regions
        return min(tuple(sorted(tuple(name[regions[r]] for r in placement[i:i + 4]) for i in (0, 4)))
                   for name in (dict(zip("abcd", p)) for p in itertools.permutations("abcd")))

    kinds = [kind(c.placement) for c in found]
    assert len(set(kinds)) == len(kinds), kinds


def compositions(total: int, parts: int):
    """Every way to give `parts` replicas at least one micro-batch each, `total` in all."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("stages,replicas", [(2, 2), (1, 3), (2, 3)])
def test_replicas_of_unequal_speed_take_the_shares_that_make_the_step_shortest(stages, replicas):
    """Where the algorithm weighs gradients, a placement's shares are the ones of every possible split of the global
    batch whose slowest replica is fastest; they sum to it, and the step is never longer than with equal shares."""
    rng = random.Random(stages + 10 * replicas)
    weighed = replace(WORK, weighs=True)
    for _ in range(4):
        cluster = random_cluster(rng, stages * replicas)
        model, equal = CostModel(cluster, weighed, stages, replicas), CostModel(cluster, WORK, stages, replicas)
        placement = rng.sample(range(stages * replicas), stages * replicas)
        split = model.balance(placement)
        pipes = [tuple(placement[r * stages:(r + 1) * stages]) for r in range(replicas)]
        shares = model.shares(pipes, split)
        assert sum(shares) == replicas * WORK.micro_batches and min(shares) >= 1

        def slowest(each):
            return max(model.pipeline(p, split, m)[0] for p, m in zip(pipes, each))
        best = min(slowest(c) for c in compositions(replicas * WORK.micro_batches, replicas))
        assert slowest(shares) == pytest.approx(best, rel=1e-12)
        predicted = model.predict(placement, split)
        assert predicted.shares == tuple(shares)
        assert predicted.step <= equal.predict(placement, split).step * (1 + 1e-12)


def test_a_replica_on_slower_machines_takes_fewer_micro_batches_where_the_algorithm_weighs_them():
    """Two fast machines and two 2.5x slower, one stage each, all well linked: each machine a replica; the slow ones
    take fewer of the 16 micro-batches, the step falls by more than a third; an algorithm that averages models
    keeps equal shares."""
    cluster = parse({"machines": [{"block_ms": ms} for ms in (10, 25, 10, 25)], "default_link": {"mbit": 10000}})
    weighed = plan(cluster, replace(WORK, weighs=True), 1, 4)
    equal = plan(cluster, WORK, 1, 4)
    assert sorted(weighed.shares) == [2, 2, 6, 6] and equal.shares == [4, 4, 4, 4]
    assert [weighed.shares[weighed.placement.index(r)] for r in range(4)] == [6, 2, 6, 2]  # the fast ranks more
    assert weighed.predicted.step < 0.65 * equal.predicted.step
    assert plan(cluster, replace(WORK, weighs=True, shares=(4, 4, 4, 4)), 1, 4).shares == [4, 4, 4, 4]  # fixed
