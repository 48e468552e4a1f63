"""`aqpipe plan [TASK] --cluster cluster.yaml [the run's flags] [--plan_file plan.json]`: the placement a run would
take on the machines a cluster file describes, before anything runs.

It prints who holds what (each stage's ranks and blocks), the predicted step with its parts (compute, each boundary,
the job's tables, the replicas' sync) against rank order's, and writes the plan for `--placement plan.json`. The
run's flags are a run's (`--model`, `--pipeline_stages`, `--replicas`, the codecs, the data-parallel algorithm...),
resolved for a world of as many ranks as the file has machines; TASK defaults to causal-lm.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from aqpipe.models import planned_model
from aqpipe.settings import resolve
from aqpipe.tasks import TASKS

from . import workload
from .cluster import read
from .search import MARGIN, Plan, plan
from .seat import first_share, fixed_blocks

USAGE = "usage: aqpipe plan [TASK] --cluster cluster.yaml [run flags] [--plan_file plan.json]"


def _take(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in argv (--flag value or --flag=value), removed from it; None where absent."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if word.startswith(flag + "="):
            del argv[i]
            return word.split("=", 1)[1]
    return None


def report(chosen: Plan) -> str:
    """Who holds what, and what the step is predicted to take, against rank order."""
    S, R = chosen.stages, chosen.replicas
    lines = [f"plan: {S * R} ranks as {S} stages x {R} replicas ({chosen.method} search over {chosen.evaluated} "
             f"placements, {chosen.seconds:.1f} s)"]
    for s in range(S):
        ranks = ", ".join(f"{chosen.placement[r * S + s]} (replica {r})" for r in range(R))
        lines.append(f"  stage {s}: {chosen.partition[s]} blocks on rank(s) {ranks}")
    p, o = chosen.predicted, chosen.rank_order
    if len(set(chosen.shares)) > 1:  # replicas of unequal speed: the faster take more of the step's micro-batches
        lines.append("  micro-batches a step by replica: " + ", ".join(f"{m} (replica {r})"
                                                                     for r, m in enumerate(chosen.shares)))
    lines.append(f"predicted step {p.step:.4g} s: {p.parts()}")
    lines.append(f"rank order: {o.step:.4g} s ({o.parts()}); the plan is {o.step / p.step:.2f}x faster")
    others = chosen.candidates[1:]
    if others:  # what `--placement auto` would play at start: the model cannot tell these from its best
        lines.append(f"priced within {MARGIN:.0%} of it (a run with --placement auto plays the plan and the first "
                     "of these, --placement_trials in all, and takes the fastest measured): " +
                     "; ".join(f"{c.placement} blocks {c.partition} {c.predicted.step:.4g} s" for c in others))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """The command; 0 after writing the plan, 2 with one line on bad input."""
    argv = list(argv)
    name = argv.pop(0) if argv and argv[0] in TASKS else "causal-lm"
    task = TASKS[name]
    out = Path(_take(argv, "--plan_file") or "plan.json")
    path = _take(list(argv), "--cluster")  # stays in argv: the run's settings check it too
    if path is None:
        print(f"aqpipe plan: error: --cluster is required ({USAGE})", file=sys.stderr)
        return 2
    try:
        cluster = read(path)
    except ValueError as exc:
        print(f"aqpipe plan: error: {exc}", file=sys.stderr)
        return 2
    if "--placement" not in argv:
        argv += ["--placement", "auto"]
    cfg = resolve(task.kind, argv, USAGE, defaults=task.defaults, prog="aqpipe plan", world_size=len(cluster))
    try:
        model_class, config = planned_model(cfg.model, task.shape, task.kind, cfg.data.seq_len)
        stages = cfg.distributed.pipeline_stages
        work = workload.build(cfg, model_class, config, first_share(cfg))
        chosen = plan(cluster, work, stages, cfg.replicas, partition=fixed_blocks(cfg, model_class, config, stages),
                      seed=cfg.seed)
    except ValueError as exc:
        print(f"aqpipe plan: error: {exc}", file=sys.stderr)
        return 2
    print(report(chosen))
    out.write_text(json.dumps(chosen.to_dict(), indent=1))
    print(f"written {out}: run with --placement {out}")
    return 0
