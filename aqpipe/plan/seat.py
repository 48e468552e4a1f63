"""A run's ranks put in their places at start, as `--placement` says, with one line from rank 0:

- `rank`: stage s of replica r on rank r x stages + s (the launcher's numbering); blocks as `--partition` says
  (auto: by parameter count);
- `auto`: the machines measured (profile.py) or read from `--cluster`, and the placement the cost model predicts
  fastest (search.py), blocks in proportion to speed unless `--partition` fixes them (a resumed run keeps its
  checkpoint's); where the model prices others within its error of it, up to `--placement_trials` of them are
  played for two steps on every rank (trials.py) and the fastest measured is taken, in a second line;
- a plan file `aqpipe plan` wrote: its placement and blocks.

With `--micro_batch_shares auto` the replicas take the plan's shares of the step's micro-batches (equal under rank
order, or where the algorithm cannot weigh them); the settings come back with them resolved, which a checkpoint
records and a resume on as many replicas keeps (its shards hold the AQ-SGD rows).

Rank 0 reads the files (with no shared filesystem, its machine's copy) and plans, and every rank takes its answer
(the search keeps to a time budget, so two ranks could reach two answers). Returns the grid and the settings with
`partition` resolved to the blocks the run takes and `micro_batch_shares` to the shares.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aqpipe.data_parallel import REGISTRY
from aqpipe.pipeline import Grid
from aqpipe.pipeline.loading import meta_model
from aqpipe.pipeline.partitioning import stage_block_counts
from aqpipe.storage import broadcast

from . import profile, trials, workload
from .cluster import Cluster, read
from .search import MARGIN, Candidate, Plan, plan

PLACEMENTS = ("rank", "auto")  # or a plan file's path


def first_share(cfg: Any) -> float:
    """Of a run's forward messages, the share that carry first visits (AQ-SGD's buffers hold none before)."""
    return 1.0 / max(1, cfg.epochs)


def fixed_blocks(cfg: Any, model_class: type, config: Any, stages: int) -> list[int] | None:
    """The blocks per stage the settings fix (a list, parameters, uniform), or None where the plan chooses."""
    method = cfg.distributed.partition
    if method == "auto":
        return None
    if isinstance(method, list):
        return list(method)
    return stage_block_counts(meta_model(model_class, config), stages, method)


def read_plan(path: str | Path, world_size: int, stages: int) -> dict[str, Any]:
    """A plan file's placement and blocks, checked against this run; ValueError in one line naming what differs."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"placement={str(path)!r}: expected rank, auto or a plan file ({exc.strerror or exc})") \
            from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"placement={str(path)!r}: not a plan file (JSON: {exc.msg})") from None
    need = {"stages", "replicas", "placement", "partition"}
    if not isinstance(data, dict) or not need <= set(data):
        raise ValueError(f"placement={str(path)!r}: expected a plan file with {', '.join(sorted(need))}")
    if data["stages"] * data["replicas"] != world_size or data["stages"] != stages:
        raise ValueError(f"placement={str(path)!r}: planned for {data['stages']} stages x {data['replicas']} "
                         f"replicas; this run has {stages} stages on {world_size} ranks")
    Grid.for_world(world_size, stages, data["placement"])  # each rank once, or a one-line refusal
    return data


def describe(chosen: Plan, source: str, took: float | None) -> str:
    """The start line of a planned run."""
    where = f"measured in {took:.1f} s" if took is not None else f"from {source}"
    speedup = chosen.rank_order.step / chosen.predicted.step if chosen.predicted.step else 1.0
    shares = chosen.shares
    each = f", micro-batches by replica {','.join(map(str, shares))}" if len(set(shares)) > 1 else ""
    return (f"placement auto ({where}): ranks by (stage, replica) {chosen.placement}, blocks per stage "
            f"{chosen.partition}{each}; predicted step {chosen.predicted.step:.3g} s ({chosen.predicted.parts()}), "
            f"rank order's {chosen.rank_order.step:.3g} s ({speedup:.2f}x); {chosen.method} search over "
            f"{chosen.evaluated} placements in {chosen.seconds:.1f} s")


def rank_order(cfg: Any, world_size: int) -> tuple[Grid, Any]:
    """The launcher's numbering, and the settings' blocks (auto: by parameter count)."""
    blocks = cfg.distributed.partition
    return Grid.for_world(world_size, cfg.distributed.pipeline_stages), \
        _with_shares(_with_blocks(cfg, "parameters" if blocks == "auto" else blocks), None)


def seat(cfg: Any, world: Any, model_class: type, config: Any) -> tuple[Grid, Any, Plan | None]:
    """(the grid, the settings with their blocks resolved, the plan where one was made) of this run."""
    stages, how = cfg.distributed.pipeline_stages, cfg.distributed.placement
    if how == "rank" or world.size == 1:
        return (*rank_order(cfg, world.size), None)
    fixed = fixed_blocks(cfg, model_class, config, stages)  # the settings' (or a resumed checkpoint's) blocks
    work = workload.build(cfg, model_class, config, first_share(cfg)) if how == "auto" else None
    took = cluster = None
    if how == "auto" and not cfg.distributed.cluster:  # every rank measures, and holds the table
        cluster, took = profile.measure(cfg, world, model_class, config, work.forward_bytes)
    chosen: Any = None
    if world.rank == 0:  # rank 0 reads the files (where no filesystem is shared, its machine's) and plans
        try:
            chosen = _rank_zeros(cfg, world, stages, how, fixed, work, cluster, took)
        except ValueError as exc:  # said on every rank, not left for the others to wait out
            chosen = str(exc)
    chosen = broadcast(chosen, world)
    if isinstance(chosen, str):
        raise ValueError(chosen)
    if getattr(chosen, "candidates", ()):  # a plan made here (a plan file's is taken as it is)
        chosen = play(chosen, cfg, world, work, stages, model_class, config)
    blocks = cfg if fixed is not None else _with_blocks(cfg, list(chosen.partition))
    return Grid.for_world(world.size, stages, chosen.placement), _with_shares(blocks, chosen.shares), chosen


def play(chosen: Plan, cfg: Any, world: Any, work: Any, stages: int, model_class: type, config: Any) -> Plan:
    """The plan after its candidates are played (up to `--placement_trials`, trials.py) and the fastest measured
    taken (call on every rank at once, with the same plan); as it was where there is one candidate or one trial, or
    under NCCL (one stream a pair, no tags), said in one line."""
    count = min(cfg.distributed.placement_trials, len(chosen.candidates))
    if count > 1 and world.transport.type != "cpu":
        if world.rank == 0:
            print(f"placement auto: {len(chosen.candidates) - 1} other placement(s) priced within {MARGIN:.0%} of "
                  "the plan are not played under nccl (the trials' messages need gloo's tags); the model's best is "
                  "taken", file=sys.stderr)
        return chosen
    if count < 2:
        return chosen
    return measured(chosen, trials.run(chosen.candidates[:count], work, stages, world, cfg, model_class, config),
                    world.rank == 0)


def measured(chosen: Plan, played: list[Candidate], say: bool) -> Plan:
    """The plan with the fastest measured candidate's placement and blocks, the played candidates recorded; said in
    one line (`say`)."""
    best = min(played, key=lambda c: c.measured)
    if say:
        seen = "; ".join(f"{c.placement} blocks {c.partition}: {c.measured:.3g} s (predicted {c.predicted.step:.3g})"
                         for c in played)
        print(f"placement auto: the model's best {len(played)} measured, {trials.STEPS} steps each: {seen}; took "
              f"{best.placement}", file=sys.stderr)
    return replace(chosen, placement=best.placement, partition=best.partition, predicted=best.predicted,
                   candidates=tuple(played), measured=True)


def _rank_zeros(cfg: Any, world: Any, stages: int, how: str, fixed: list[int] | None, work: Any, cluster: Any,
                took: float | None) -> Any:
    """Rank 0's part of `seat`: the plan file's placement (checked against the run), or the plan from the table
    (measured, or `--cluster`'s), said in one line."""
    if how != "auto":
        data = read_plan(how, world.size, stages)
        if fixed is not None and fixed != list(data["partition"]):
            raise ValueError(f"placement={how!r}: its blocks per stage {data['partition']} are not this run's "
                             f"partition={cfg.distributed.partition!r} ({fixed}); expected a plan made with that "
                             "partition (a resumed run keeps its checkpoint's blocks)")
        shares = _plan_shares(data, cfg, how)
        each = f", micro-batches by replica {','.join(map(str, shares))}" if len(set(shares or [0])) > 1 else ""
        print(f"placement {how}: ranks by (stage, replica) {data['placement']}, blocks per stage "
              f"{data['partition']}{each}", file=sys.stderr)
        return SimpleNamespace(placement=list(data["placement"]), partition=list(data["partition"]), shares=shares)
    if cluster is None:
        cluster = read(cfg.distributed.cluster, world.size)
    chosen = plan(cluster, work, stages, cfg.replicas, partition=fixed, seed=cfg.seed)
    print(describe(chosen, cfg.distributed.cluster or "", took), file=sys.stderr)
    if took is not None:
        _write_table(cluster, cfg)
    return chosen


def _with_blocks(cfg: Any, blocks: Any) -> Any:
    return replace(cfg, distributed=replace(cfg.distributed, partition=blocks))


def _with_shares(cfg: Any, shares: list[int] | None) -> Any:
    """cfg with `auto` shares resolved: the plan's where they differ, else equal (a run's own list stays)."""
    if cfg.data_parallel.shares != "auto":
        return cfg
    resolved = list(shares) if shares and len(set(shares)) > 1 else "equal"
    return replace(cfg, data_parallel=replace(cfg.data_parallel, shares=resolved))


def _plan_shares(data: dict[str, Any], cfg: Any, path: str) -> list[int] | None:
    """A plan file's micro-batch shares (None where it has none), checked against this run's global batch and
    algorithm; ValueError in one line."""
    shares = data.get("shares")
    if not shares or len(set(shares)) == 1 or cfg.data_parallel.shares != "auto":
        return None  # none, equal, or the run's own (a resume keeps its checkpoint's)
    whole = cfg.replicas * cfg.num_micro_batches
    if len(shares) != cfg.replicas or sum(shares) != whole:
        raise ValueError(f"placement={path!r}: its micro-batch shares {','.join(map(str, shares))} are not this "
                         f"run's global batch of {cfg.replicas} x {cfg.num_micro_batches} micro-batches; expected a "
                         "plan made with this run's --num_micro_batches")
    if not REGISTRY[cfg.data_parallel.algorithm].WEIGHTS:
        return None  # the algorithm cannot weigh them: equal shares
    return list(shares)


def _write_table(cluster: Cluster, cfg: Any) -> None:
    """The measured table beside the run's results, for --cluster and `aqpipe plan`."""
    out = Path(cfg.checkpointing.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster.write(out / "cluster.yaml")
