"""Machines as they come: the plan against the launcher's numbering on emulated heterogeneous clusters.

Yuan et al.'s five scenarios (NeurIPS 2022, "Decentralized Training of Foundation Models in Heterogeneous
Environments"), scaled to 8 ranks as 4 stages x 2 replicas, then the same with two kinds of device (the second half
of the machines 2.5x slower), and a datacenter with one device 2.5x slower; first, a uniform cluster (every pair at
the datacenter's fast rate), where a plan should cost nothing; last, the datacenter's two kinds of device as 8
replicas of the whole model (data parallel alone: the replicas' shares are all a plan chooses). Their rates and
latencies are theirs (measured between AWS regions; published with their scheduler, DS3Lab/DT-FM
scheduler/generate_sim_com_matrices.py), the rates scaled by 1/100 (their Gbit/s as our 10 Mbit/s: the model here
is small, so the links decide as they did for theirs), the latencies as measured.

Every rank is a process on this host. Links: the transport's emulator (AQPIPE_LINK_MATRIX's LinkMatrix: each pair's
rate and latency, the boundaries' messages held, the collectives paced). Devices: every compute action stretched by
waiting (AQPIPE_COMPUTE_SLOWDOWN's stretch) to BASE_SLOWDOWN x the host's own time (2.5 x that for a slow device), so
that compute is mostly waiting and 8 processes sharing 2 cores do not decide it. No network namespaces here: the
emulator is one path, the kernel's (tc on a namespace per rank: benchmarks/heterogeneous_netns.py) is the other
(RESULTS.md says which a figure used).

For each scenario, in one launch of 8 processes: the profile `--placement auto` takes (measured through the
emulator), the plan from it, and measured steps (median of a few after a warm-up) of:
- rank order as a rendezvous gives it: 10 shuffled numberings (a machine per rank at random), each with the blocks
  `--partition auto` gives rank order (by parameter count); their median is "rank order";
- 100 random placements, predicted only (best and median), and the 3 the model predicts fastest, measured;
- the plan as `--placement auto` takes it: the model's best few of other kinds priced within 15% of its best, played
  for two steps each (plan/trials.py, `--placement_trials`' default 3), the fastest so measured; and the model's best
  alone ("model's best"), where the trials took another;
- with slow devices, the plan's placement with the parameter split (what the uneven split buys);
- the plan the model makes with the replicas' shares of micro-batches held equal ("plan, equal shares": what the
  shares buy). Rank order takes equal shares, as a run under `--placement rank` does; every other placement its
  shares as the model fits them (cost.CostModel.shares), each replica running its share of micro-batches a step.
The model's error: |predicted - measured| / measured for every measured placement, the median per scenario.

    python -m benchmarks.heterogeneous --steps 2 --json heterogeneous.json     # all 13: ~80 min on 2 cores
    python -m benchmarks.heterogeneous --scenarios "world-wide;uniform" --steps 2   # some (world-wide: 14 min)
    python -m benchmarks.heterogeneous --scenarios two-datacenters --shuffles 3 --steps 2     # one, quick (2 min)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BASE_SLOWDOWN = 10.0  # every device: its compute stretched to this many times the host's own
SLOW = 2.5  # a slow device, against the others
GBIT = 10.0  # a scenario's Gbit/s as this many Mbit/s here
MODEL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 16,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": True}
RUN = {"seq_len": 64, "micro_batch_size": 2, "num_micro_batches": 4, "pipeline_stages": 4, "replicas": 2,
       "lr": 1e-3, "scheduler": None}
# scenarios of another shape than RUN's 4 stages x 2 replicas: (stages, replicas)
SHAPES = {"datacenter, two devices, data parallel": (1, 8)}


def settings(scenario: str) -> dict[str, Any]:
    """RUN in `scenario`'s shape."""
    stages, replicas = SHAPES.get(scenario, (RUN["pipeline_stages"], RUN["replicas"]))
    return {**RUN, "pipeline_stages": stages, "replicas": replicas}

# Yuan et al.'s measurements between AWS regions: (latency ms, Gbit/s), both ways alike
CITIES = {
    ("Oregon", "Virginia"): (67, 0.79), ("Oregon", "Ohio"): (49, 1.10), ("Oregon", "Tokyo"): (96, 0.523),
    ("Oregon", "Seoul"): (124, 0.46), ("Oregon", "London"): (136, 0.42), ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482), ("Virginia", "Ohio"): (11, 1.12), ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.500), ("Virginia", "London"): (76, 1.16), ("Virginia", "Frankfurt"): (90, 1.02),
    ("Virginia", "Ireland"): (67, 1.05), ("Ohio", "Tokyo"): (130, 0.694), ("Ohio", "Seoul"): (159, 0.529),
    ("Ohio", "London"): (86, 1.05), ("Ohio", "Frankfurt"): (99, 0.799), ("Ohio", "Ireland"): (77, 1.14),
    ("Tokyo", "Seoul"): (34, 1.10), ("Tokyo", "London"): (210, 0.366), ("Tokyo", "Frankfurt"): (223, 0.36),
    ("Tokyo", "Ireland"): (199, 0.465), ("Seoul", "London"): (238, 0.342), ("Seoul", "Frankfurt"): (235, 0.358),
    ("Seoul", "Ireland"): (228, 0.335), ("London", "Frankfurt"): (14, 1.14), ("London", "Ireland"): (12, 1.09),
    ("Frankfurt", "Ireland"): (24, 1.08), ("Virginia", "California"): (59, 1.05), ("Oregon", "California"): (12, 1.25),
    ("California", "Ohio"): (52, 1.02),
}


def link(gbit: float, ms: float) -> dict[str, float]:
    return {"mbit": gbit * GBIT, "latency_ms": max(ms, 0.1)}


def cluster_file(regions: list[str], pairs: dict[tuple[str, str], tuple[float, float]],
                 inside: tuple[float, float]) -> dict[str, Any]:
    """A cluster table: machine i in regions[i]; a region's own link `inside` (ms, Gbit/s), the others by `pairs`."""
    names = sorted(set(regions))
    table: dict[str, dict[str, Any]] = {a: {} for a in names}
    for a in names:
        table[a][a] = link(inside[1], inside[0])
        for b in names:
            if a < b:
                ms, gbit = pairs.get((a, b)) or pairs[(b, a)]
                table[a][b] = link(gbit, ms)
    return {"machines": [{"name": f"{r}-{i}", "region": r, "block_ms": 1.0} for i, r in enumerate(regions)],
            "regions": table}


def scenarios() -> dict[str, dict[str, Any]]:
    """Each scenario's cluster table and devices' slowdowns (before the base), 8 machines."""
    out = {}
    # one datacenter: two instances of 4 GPUs, 97 Gbit/s inside one, 3.125 between (case 0)
    out["datacenter"] = cluster_file(["i0"] * 4 + ["i1"] * 4, {("i0", "i1"): (0.0, 3.125)}, (0.0, 97.0))
    # spot: one instance of 4 GPUs (99 Gbit/s inside), the other 4 alone, 1.25 Gbit/s between all (case 1)
    out["spot"] = cluster_file(["i0"] * 4 + ["s4", "s5", "s6", "s7"],
                               {pair: (0.0, 1.25) for pair in _pairs(["i0", "s4", "s5", "s6", "s7"])}, (0.0, 99.0))
    # two datacenters: Ohio and Virginia, 5 Gbit/s and 1 ms inside, 1.12 and 11 ms between (case 2)
    out["two-datacenters"] = cluster_file(["Ohio"] * 4 + ["Virginia"] * 4, {("Ohio", "Virginia"): (11, 1.12)},
                                          (1.0, 5.0))
    # regional: Virginia, Oregon, California, Ohio, two machines each, 2 Gbit/s and 10 ms inside (case 3)
    out["regional"] = cluster_file([c for c in ("Virginia", "Oregon", "California", "Ohio") for _ in range(2)],
                                   CITIES, (10.0, 2.0))
    # world-wide: eight cities on three continents, one machine each (case 4)
    out["world-wide"] = cluster_file(["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt",
                                      "Ireland"], CITIES, (10.0, 2.0))
    # uniform: the datacenter's fast links between every pair (the check that a plan costs nothing where all is alike)
    uniform = {"uniform": (cluster_file(["i0"] * 8, {}, (0.0, 97.0)), [1.0] * 8)}
    plain = {name: (table, [1.0] * 8) for name, table in out.items()}
    mixed = {f"{name}, two devices": (table, [1.0] * 4 + [SLOW] * 4) for name, table in out.items()}
    one = {"datacenter, one slow device": (out["datacenter"], [1.0] * 7 + [SLOW])}
    # eight machines of two kinds, each a replica of the whole model (SHAPES): the replicas' shares of micro-batches
    # are all a plan can choose
    whole = {"datacenter, two devices, data parallel": (out["datacenter"], [1.0] * 4 + [SLOW] * 4)}
    return {**uniform, **plain, **mixed, **one, **whole}


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def batches(rng_seed: int, replica: int, vocab: int, shares: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Replica `replica`'s micro-batches of a step: its share of them (`shares`, every replica's)."""
    g = torch.Generator().manual_seed(rng_seed * 7 + replica)
    out, each = [], shares
    for k in range(each[replica]):
        ids = torch.randint(3, vocab, (RUN["micro_batch_size"], RUN["seq_len"]), generator=g)
        base = (sum(each[:replica]) + k) * RUN["micro_batch_size"]
        out.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
                    "sample_id": torch.arange(base, base + RUN["micro_batch_size"])})
    return out


def worker(rank: int, world: int, scenario: str, model_dir: str, steps: int, shuffles: int, randoms: int,
           kernel: bool = False) -> dict:
    """One rank of one scenario: the profile, rank 0's plan and candidates, every candidate's measured steps.
    `kernel`: the links' rates are shaped by tc (benchmarks/heterogeneous_netns.py), the emulator adds only each
    pair's latency."""
    from aqpipe.data import load_tokenizer
    from aqpipe.models import resolve_model
    from aqpipe.pipeline import CompressionConfig, Grid
    from aqpipe.pipeline.emulated_link import LinkMatrix
    from aqpipe.plan import CostModel, parse, plan, profile, workload
    from aqpipe.plan.seat import play
    from aqpipe.settings import build
    from aqpipe.storage import broadcast
    from aqpipe.train import build_engine
    from aqpipe.world import World

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # one host: the profile times in turn
    torch.set_num_threads(1)
    table, slowdowns = scenarios()[scenario]
    links = parse(table, scenario, world)
    rates = [[math.inf] * world for _ in range(world)] if kernel else links.rate
    here = World(rank, world, rank, torch.device("cpu"), link_matrix=LinkMatrix(rank, links.latency, rates),
                 compute_slowdown=BASE_SLOWDOWN * slowdowns[rank])
    run = settings(scenario)
    cfg = build("causal_lm", {**run, "model": f"{model_dir}/config.json", "compression": CompressionConfig(),
                              "output_dir": f"{model_dir}/out{rank}"})
    tokenizer = load_tokenizer(model_dir)
    spec = resolve_model(f"{model_dir}/config.json", "llama", "causal_lm", tokenizer, RUN["seq_len"], None)
    work = workload.build(cfg, spec.model_class, spec.config, 1.0)
    measured, took = profile.measure(cfg, here, spec.model_class, spec.config, work.forward_bytes)
    S, R = run["pipeline_stages"], run["replicas"]
    candidates = chosen = None
    equal = replace(work, weighs=False)  # the replicas' shares of micro-batches held equal, as before they were planned
    if rank == 0:
        chosen = plan(measured, work, S, R)
    chosen = broadcast(chosen, here)
    began = time.perf_counter()  # the trials, as `--placement auto` plays them (every rank)
    taken = play(chosen, cfg, here, work, S, spec.model_class, spec.config)
    trials_s = time.perf_counter() - began
    played = taken.candidates if taken.measured else ()
    if rank == 0:
        model = CostModel(measured, work, S, R)
        rng = random.Random(1)
        by_params = tuple(_parameter_split(spec, S))
        shuffled = [rng.sample(range(world), world) for _ in range(shuffles)]
        randoms_priced = []
        for _ in range(randoms):
            p = rng.sample(range(world), world)
            split = model.balance(p)
            randoms_priced.append((model.predict(p, split).step, p, split))
        randoms_priced.sort(key=lambda x: x[0])
        unshared = plan(measured, equal, S, R)
        candidates = {"plan": [(taken.placement, tuple(taken.partition))],
                      "plan, equal shares": [(unshared.placement, tuple(unshared.partition))],
                      "model's best": [(chosen.placement, tuple(chosen.partition))] if taken.placement !=
                      chosen.placement or taken.partition != chosen.partition else [],
                      "rank order": [(p, by_params) for p in shuffled],
                      "best random": [(p, s) for _, p, s in randoms_priced[:3]],
                      "plan, parameter split": [(taken.placement, by_params)],
                      "predicted random": [t for t, _, _ in randoms_priced],
                      "profile_s": took, "plan_s": chosen.seconds,
                      "table": measured.to_dict()}
    candidates = broadcast(candidates, here)
    results: dict[str, list[dict[str, Any]]] = {}
    model, model_equal = CostModel(measured, work, S, R), CostModel(measured, equal, S, R)
    vocab = len(tokenizer)
    for kind in ("plan", "plan, equal shares", "model's best", "plan, parameter split", "best random", "rank order"):
        for placement, split in candidates[kind]:
            # rank order as a run takes it (equal shares), and the plan made without unequal shares
            priced = model_equal if kind in ("plan, equal shares", "rank order") else model
            predicted = priced.predict(list(placement), tuple(split))
            here.grid = Grid.for_world(world, S, placement)
            run_cfg = build("causal_lm", {**run, "model": f"{model_dir}/config.json",
                                          "compression": CompressionConfig(), "partition": list(split),
                                          "output_dir": f"{model_dir}/out{rank}"})
            engine = build_engine(run_cfg, spec, here, 64, steps + 1)
            times = []
            for step in range(steps + 1):
                dist.barrier()
                started = time.perf_counter()
                engine.train_batch(batches(step, engine.groups.replica, vocab, predicted.shares))
                dist.barrier()
                times.append(time.perf_counter() - started)
            results.setdefault(kind, []).append({"placement": list(placement), "partition": list(split),
                                                 "shares": list(predicted.shares),
                                                 "measured_s": statistics.median(times[1:]),
                                                 "predicted_s": predicted.step, "parts": predicted.parts()})
            del engine
    return {"results": results, "predicted_random": candidates["predicted random"],
            "profile_s": candidates["profile_s"], "plan_s": candidates["plan_s"], "table": candidates["table"],
            "trials": [c.to_dict() for c in played], "trials_s": trials_s}


def _parameter_split(spec: Any, stages: int) -> list[int]:
    from aqpipe.pipeline.loading import meta_model
    from aqpipe.pipeline.partitioning import stage_block_counts

    return stage_block_counts(meta_model(spec.model_class, spec.config), stages, "parameters")


def write_model(directory: Path) -> None:
    from transformers import LlamaConfig

    from aqpipe.data import load_tokenizer

    tokenizer = load_tokenizer(None)
    directory.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**{**MODEL, "vocab_size": len(tokenizer)}, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        directory)
    tokenizer.save_pretrained(directory)


def summarize(name: str, out: dict[str, Any]) -> dict[str, Any]:
    r = out["results"]
    order = statistics.median(x["measured_s"] for x in r["rank order"])
    planned = r["plan"][0]["measured_s"]
    best = min(x["measured_s"] for x in r["best random"])
    errors = [abs(x["predicted_s"] - x["measured_s"]) / x["measured_s"] for xs in r.values() for x in xs]
    row = {"scenario": name, "rank_order_s": order, "plan_s": planned, "speedup": order / planned,
           "best_random_measured_s": best, "plan_vs_best_random": best / planned,
           "random_predicted_best_s": min(out["predicted_random"]),
           "random_predicted_median_s": statistics.median(out["predicted_random"]),
           "plan_predicted_s": r["plan"][0]["predicted_s"], "model_error_median": statistics.median(errors),
           "model_error_max": max(errors), "profile_s": out["profile_s"], "search_s": out["plan_s"],
           "parameter_split_s": r["plan, parameter split"][0]["measured_s"],
           "model_best_s": r["model's best"][0]["measured_s"] if r.get("model's best") else planned,
           "trials": len(out["trials"]), "trials_s": out["trials_s"], "shares": r["plan"][0].get("shares"),
           "equal_shares_s": r["plan, equal shares"][0]["measured_s"] if r.get("plan, equal shares") else None}
    row["uneven_split_speedup"] = row["parameter_split_s"] / planned
    row["shares_speedup"] = row["equal_shares_s"] / planned if row["equal_shares_s"] else None
    if "tc_measured_mbit" in out:  # the kernel's path (heterogeneous_netns.py): what tc gave, measured after
        row["tc_measured_mbit"] = out["tc_measured_mbit"]
    return row


def chosen(p: argparse.ArgumentParser, text: str) -> list[str]:
    """The scenarios `--scenarios` names (semicolons between; `all`), or the parser's one-line refusal."""
    names = list(scenarios()) if text == "all" else [n.strip() for n in text.split(";")]
    unknown = sorted(set(names) - set(scenarios()))
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; expected some of {list(scenarios())}")
    return names


def run_scenarios(names: list[str], run: Any, json_path: str | None) -> list[dict[str, Any]]:
    """Each scenario by `run(name, model_dir)` (what `worker` returns, rank 0's), summarized and said in a line; the
    figures written to `json_path` after each (a later one that fails loses nothing measured)."""
    rows, everything = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp) / "model")
        for name in names:
            started = time.perf_counter()
            out = run(name, Path(tmp) / "model")
            row = summarize(name, out)
            rows.append(row)
            everything[name] = out
            if json_path:
                Path(json_path).write_text(json.dumps({"rows": rows, "scenarios": everything}, indent=1))
            kernel = f"; tc gave {row['tc_measured_mbit']} Mbit/s" if "tc_measured_mbit" in row else ""
            print(f"{name}: rank order {row['rank_order_s']:.2f} s, plan {row['plan_s']:.2f} s "
                  f"({row['speedup']:.2f}x), best random measured {row['best_random_measured_s']:.2f} s, "
                  f"predicted random best/median {row['random_predicted_best_s']:.2f}/"
                  f"{row['random_predicted_median_s']:.2f} s, plan predicted {row['plan_predicted_s']:.2f} s, "
                  f"model error median {row['model_error_median']:.1%} (max {row['model_error_max']:.1%}), "
                  f"parameter split {row['parameter_split_s']:.2f} s ({row['uneven_split_speedup']:.2f}x){kernel}; "
                  f"shares {row['shares']}, the plan with equal shares {row['equal_shares_s']:.2f} s "
                  f"({row['shares_speedup']:.2f}x); "
                  f"model's best {row['model_best_s']:.2f} s, {row['trials']} played in {row['trials_s']:.1f} s; "
                  f"profile {row['profile_s']:.1f} s, search {row['search_s']:.1f} s; "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from tests.helpers.processes import spawn  # the test harness's gloo ranks, forked from a preloaded server

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="all", help="names separated by semicolons (some have commas), or all")
    p.add_argument("--steps", type=int, default=3, help="measured steps per placement (after one warm-up)")
    p.add_argument("--shuffles", type=int, default=10)
    p.add_argument("--randoms", type=int, default=100)
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    run_scenarios(chosen(p, args.scenarios), lambda name, model: spawn(
        worker, 8, name, str(model), args.steps, args.shuffles, args.randoms, timeout=3600)[0], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
