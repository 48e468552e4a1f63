"""A checkpoint resumed on another shape: more or fewer stages, or other blocks per stage, than the run that wrote it.

Each (stage, replica) of the new run reads the files of its replica's old stages that held any of its weights (its
blocks; the embeddings where it is first, the head where it is last, a tied weight's owner where it holds a copy),
and nothing else: `sources` names them before anything loads, so a machine fetches only those (checkpoint_copies).

What carries (`merge`), by the weights' names in the unpartitioned model, which every stage's state uses:
- the weights that train, each from the old stage that held it (a tied weight from its owner, whose copy is the
  truth), and the optimizer's state of each, moved to its position in the new stage's optimizer;
- the LR plan, the step count and the skipped steps (the same on every old stage);
- a boundary's codecs (AQ-SGD's rows, dither streams) where the new boundary sits at an old one's cut, both sides.

What starts as built, said in the start line: the codecs of boundaries that moved, the tied weights' codecs, the
data-parallel algorithm's memories (its parameters are other ones now), bits chosen per link, and an optimizer's own
tensors beside the per-parameter state (QAdam's server error; its step count carries).

Replicas that held different weights (the decentralized algorithms) become one by their uniform average (`averaged`):
each new stage reads every replica's files of its old stages, and the algorithm restarts from the averaged weights.

Another replica count (`Reading.regroups`): each new replica reads every old replica's files and averages them as
above; every boundary's codecs start fresh (AQ-SGD's rows and the dither streams were the old replicas', keyed by
their shards); the rest of the interrupted epoch is dealt over the new count with the global batch kept
(data/regroup.py, dealing.py, checkpoint._regrouped), so that epoch's steps are the run's.

Otherwise the data continues where the run stopped (the replicas' shards are unchanged), and the LR plan is the run's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .pipeline.loading import meta_model
from .pipeline.partitioning import block_ranges, partition, tie_groups

EXTRAS = ("data_parallel", "auto_bits")  # engine parts tied to the old stage's parameters: they start fresh


@dataclass(frozen=True)
class Shape:
    """A run's stages and each stage's blocks (global indices, contiguous)."""

    blocks: tuple[tuple[int, ...], ...]

    @property
    def stages(self) -> int:
        return len(self.blocks)

    @classmethod
    def from_counts(cls, counts: list[int]) -> "Shape":
        return cls(tuple(tuple(blocks) for blocks in block_ranges(counts)))

    def counts(self) -> list[int]:
        return [len(b) for b in self.blocks]


def saved_shape(manifest: dict[str, Any]) -> Shape | None:
    """The shape of the run that wrote a checkpoint (None: written before shapes were recorded)."""
    counts = manifest.get("stage_blocks")
    return None if counts is None else Shape.from_counts(list(counts))


@dataclass(frozen=True)
class Reading:
    """What one rank reads to resume on another shape: the old and new shapes, and the old stages it reads."""

    old: Shape
    new: Shape
    sources: list[int]
    replicas: int = 1  # the checkpoint's: every replica's files of each source are read, and averaged
    regroups: bool = False  # the run has another replica count than the checkpoint's

    def own(self, replica: int) -> int:
        """The old replica whose RNG states and codecs new replica `replica` takes (its own, where it had one)."""
        return min(replica, self.replicas - 1)


def reading(manifest: dict[str, Any], counts: list[int], stage: int, holds_tie: Callable[[], bool],
            replicas: int = 1) -> Reading | None:
    """How new stage `stage` (of a run with `counts` blocks per stage) reads a checkpoint (its manifest): None where
    the shape is the checkpoint's (each rank reads its own place's file). ValueError where the checkpoint does not say
    its shape and this run's stage count differs from its. `holds_tie`: whether the stage holds a tied copy, asked
    only where the shape differs (`holds_tie` below)."""
    new, old = Shape.from_counts(counts), saved_shape(manifest)
    theirs = manifest["fingerprint"].get("data_parallel.replicas", 1)
    if old is None:
        theirs = manifest["fingerprint"].get("distributed.pipeline_stages")
        if theirs == len(counts):
            return None  # the same stages: the blocks are the checkpoint's (a resume keeps them: checkpoint.py)
        raise ValueError(f"resume on another shape: the checkpoint, {theirs} stages, was written before checkpoints "
                         f"recorded their blocks per stage; expected pipeline_stages={theirs} (then save once and "
                         f"resume at {len(counts)})")
    if old == new and theirs == replicas:
        return None
    return Reading(old, new, sources(old, new, stage, holds_tie()), theirs, theirs != replicas)


def averaged(records: list[dict[str, Any]], own: int) -> dict[str, Any]:
    """One old stage's engine state as every replica's average (`records`: each replica's, `own`: this replica's,
    whose codecs, rows and streams stay its own): the weights that train and the optimizer's per-parameter state.
    Replicas an allreduce kept equal come out as they were, bit for bit; a decentralized algorithm's, which drift
    apart, become one by the uniform average its gossip converges to."""
    mine = records[own]
    if len(records) == 1:
        return mine
    out = {**mine, "model": {k: _mean([r["model"][k] for r in records]) for k in mine["model"]}}
    optimizer = mine["optimizer"]
    out["optimizer"] = {**optimizer, "state": {
        i: {k: _mean([r["optimizer"]["state"][i][k] for r in records]) if torch.is_tensor(v) else v
            for k, v in state.items()} for i, state in optimizer["state"].items()}}
    return out


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    if not first.is_floating_point() or all(torch.equal(first, t) for t in tensors[1:]):
        return first
    return (sum(t.double() for t in tensors) / len(tensors)).to(first.dtype)


def holds_tie(model_class: type, config: Any, counts: list[int], stage: int) -> bool:
    """Whether stage `stage` of `counts` holds a copy of a weight another stage holds too (a tied head, DeBERTa's
    relative embeddings), read from the model on the meta device."""
    stages = partition(meta_model(model_class, config), len(counts), list(counts), copy_modules=False)
    return any(stage in tie.holders for tie in tie_groups(stages).values())


def sources(old: Shape, new: Shape, stage: int, holds_tie: bool) -> list[int]:
    """The old stages whose files new stage `stage` reads: those holding any of its blocks, the first where it is
    first, the last where it is last, and both where it holds a tied copy (`holds_tie`: its owner is among them)."""
    mine = set(new.blocks[stage])
    out = {s for s, blocks in enumerate(old.blocks) if mine & set(blocks)}
    if stage == 0 or holds_tie:
        out.add(0)  # the embeddings
    if stage == new.stages - 1 or holds_tie:
        out.add(old.stages - 1)  # the final norm and the head, and a tied weight's owner (the last holder using
        # every row: ties.py)
    return sorted(out)


def _cut_before(shape: Shape, stage: int) -> int:
    return shape.blocks[stage][0] if shape.blocks[stage] else -1


def carried_boundaries(old: Shape, new: Shape, stage: int) -> dict[str, int]:
    """New stage `stage`'s boundary sides ("prev", "next") that sit at an old boundary's cut -> the old stage whose
    same side it takes. A cut is the first block after it; the other side of the same cut decides the same way."""
    out = {}
    cuts = {_cut_before(old, s): s for s in range(1, old.stages)}  # the cut before old stage s
    if stage > 0 and (s := cuts.get(_cut_before(new, stage))) is not None:
        out["prev"] = s
    if stage < new.stages - 1 and (s := cuts.get(_cut_before(new, stage + 1))) is not None:
        out["next"] = s - 1
    return out


def merge(records: dict[int, dict[str, Any]], template: dict[str, Any], old: Shape, new: Shape, stage: int,
          origin: dict[str, str], codecs: bool = True) -> tuple[dict[str, Any], set[str]]:
    """The engine state of new stage `stage` from old stages' engine states (`records`: old stage -> its state);
    `template`: the new engine's own state_dict (what it holds and in what order); `origin`: the new stage's weight
    names -> the name of the weight each holds (a tied copy, its owner's: PipelineStage.hf_parameter_names);
    `codecs`: whether boundaries at old cuts keep their codecs (not on another replica count). Returns (state, the
    parts that start fresh)."""
    first = records[min(records)]
    missing = [s for s, r in records.items() if "optimized" not in r]
    if missing:
        raise ValueError(f"resume on another shape: the checkpoint's stage {missing[0]} was written by an aqpipe that "
                         "did not record its parameters' order; expected a checkpoint from this version, or the "
                         f"shape that wrote it ({old.stages} stages, blocks {old.counts()})")
    owner = {}  # each weight that trained, by the name of the weight it holds -> (old stage, its name there)
    for s, r in records.items():
        for local in r["optimized"]:
            owner[r.get("tied_names", {}).get(local, local)] = (s, local)
    model = {}
    for name in template["model"]:
        # the stage that stepped it (a tied copy: its owner's, the truth), else any that held it (a buffer)
        s, local = owner.get(origin.get(name, name)) or next(
            ((s, name) for s, r in sorted(records.items()) if name in r["model"]), (None, None))
        if s is None:
            raise ValueError(f"resume on another shape: weight {name} of new stage {stage} is in none of the old "
                             f"stages {sorted(records)} read for it")
        model[name] = records[s]["model"][local]
    optimized = [origin.get(name, name) for name in template["optimized"]]
    state = {**template, "model": model, "optimizer": _optimizer(records, template, optimized, owner),
             "lr_scheduler": first["lr_scheduler"], "global_step": first["global_step"],
             "skipped_steps": first.get("skipped_steps", 0)}
    # bits chosen per link start afresh, at their most: a codec carried at its old bits would not be told
    carried = carried_boundaries(old, new, stage) if template.get("auto_bits") is None and codecs else {}
    codecs, fresh = {}, set(EXTRAS)
    for name in template["codecs"]:
        side = name.split(".", 1)[0]
        if side in carried:
            _same_cut(records[carried[side]]["blocks"], new.blocks[stage], side, name)
            codecs[name] = records[carried[side]]["codecs"][name]
        else:
            fresh.add(name)  # a moved boundary's, or a tied weight's (its holders are other stages now)
    state["codecs"] = codecs
    return state, fresh


def _same_cut(theirs: list[int], mine: tuple[int, ...], side: str, name: str) -> None:
    """Refuse to carry a codec's state (AQ-SGD's rows are the activations at its cut) to a boundary at another cut:
    the old stage's own blocks against the new stage's."""
    at = (lambda b: b[0]) if side == "prev" else (lambda b: b[-1] + 1)
    if not theirs or not mine or at(theirs) != at(mine):
        raise ValueError(f"resume on another shape: codec {name} of the boundary before block "
                         f"{at(theirs) if theirs else '-'} would be reused at the one before block "
                         f"{at(mine) if mine else '-'} (its AQ-SGD rows are another depth's activations); the "
                         "checkpoint's recorded blocks per stage do not match its stages' files")


def describe(reading: Reading, replicas: int) -> str:
    """The start line of a resume on another shape (`replicas`: this run's): what carried and what started fresh,
    for every stage."""
    old, new = reading.old, reading.new
    shared = [] if reading.regroups else sorted({_cut_before(old, s) for s in range(1, old.stages)}
                                                & {_cut_before(new, s) for s in range(1, new.stages)})
    moved = sorted({_cut_before(new, s) for s in range(1, new.stages)} - set(shared))
    cuts = lambda xs: ", ".join(f"before block {c}" for c in xs) or "none"  # noqa: E731
    many = lambda n: f"{n} replica{'s' if n > 1 else ''}"  # noqa: E731
    shapes = (f"{old.stages} stages (blocks {_counts(old)}) x {many(reading.replicas)} -> {new.stages} (blocks "
              f"{_counts(new)}) x {many(replicas)}" if reading.regroups else
              f"{old.stages} stages (blocks {_counts(old)}) -> {new.stages} (blocks {_counts(new)}), {many(replicas)} "
              "each")
    codecs = ("every boundary's codecs (their rows and streams were the old replicas')" if reading.regroups else
              f"the codecs at the new cuts ({cuts(moved)})")
    return (f"resume on another shape: {shapes}; kept: every weight that trains and its optimizer state, the LR plan "
            "and the data position" + ("" if reading.regroups else
                                       f", the boundaries' codecs at the cuts both shapes have ({cuts(shared)})") +
            f"; started fresh: {codecs}, the tied weights' wire, the data-parallel algorithm's memories, bits chosen "
            "per link (then every codec), QAdam's server error" +
            ("; the replicas' weights and moments averaged into one" if reading.replicas > 1 else ""))


def _counts(shape: Shape) -> str:
    return ",".join(map(str, shape.counts()))


def _optimizer(records: dict[int, dict[str, Any]], template: dict[str, Any], optimized: list[str],
               owner: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """The new stage's optimizer state: each parameter's state from the old stage that stepped it, at its new
    position; the hyperparameters of the old groups; the optimizer's own extras as built."""
    ours = template["optimizer"]
    if len(ours["param_groups"]) != 1 or any(len(r["optimizer"]["param_groups"]) != 1 for r in records.values()):
        raise ValueError("resume on another shape: the optimizer has several parameter groups; expected one (the "
                         "run's own optimizer)")
    state = {}
    for i, name in enumerate(optimized):
        s, local = owner.get(name, (None, None))
        if s is None:
            raise ValueError(f"resume on another shape: no old stage stepped {name}, which the new stage steps")
        old_index = records[s]["optimized"].index(local)
        saved = records[s]["optimizer"]["state"].get(old_index)
        if saved is not None:  # none: the old run never stepped it (no step taken yet)
            state[i] = saved
    theirs = records[min(records)]["optimizer"]
    group = {**theirs["param_groups"][0], "params": ours["param_groups"][0]["params"]}
    extras = {key: _plain_values(theirs.get(key), value) for key, value in ours.items()
              if key not in ("state", "param_groups")}
    return {**ours, **extras, "state": state, "param_groups": [group]}


def _plain_values(theirs: Any, ours: Any) -> Any:
    """An optimizer's own extras (QAdam's): the old run's plain values (its step count), and as built where a tensor
    or the old has none (its server error, over the old stage's parameters; its generator's state)."""
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return ours
    return {k: v if torch.is_tensor(v) or v is None or k not in theirs or torch.is_tensor(theirs[k]) else theirs[k]
            for k, v in ours.items()}
