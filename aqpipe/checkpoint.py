"""Checkpoints a run resumes from exactly: one file per rank, a manifest, a `latest` marker.

    <output_dir>/checkpoints/step_00000040/stage1_replica0.pt     engine state, RNGs, data position
    <output_dir>/checkpoints/step_00000040/boundary0_recv_replica0.buf   (disk-backed AQ-SGD buffers only)
    <output_dir>/checkpoints/step_00000040/manifest.json           config fingerprint, files, sha256
    <output_dir>/checkpoints/latest                                 "step_00000040"

Every rank writes its files into `step_N.partial` on its own storage (temporary name, fsync, rename); rank 0
gathers their checksums over the process group, and on each storage the ranks share (one machine's disk, or a
filesystem every machine mounts: storage.py) one rank writes the manifest, renames the directory to `step_N` and
only then moves `latest`. No filesystem need be shared: each machine holds its own ranks' files. A crash at any
point leaves either the previous checkpoint or a directory without a manifest, which never loads; a resume takes
the newest step every rank holds complete (`agree`). Files load with torch.load(weights_only=True):
a checkpoint is data, never code. The manifest's fingerprint is plain JSON, so a resume from
another stage count, model or codec config is refused before any process group starts.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint_copies as copies
from . import reshape
from .atomic_files import atomic_write, fsync_dir, sha256_of
from .compression.fields import FREE, KEPT, RESHAPES, THIS_RUN
from .config import RunConfig, destinations
from .flags import value_at
from .storage import Storage, broadcast, gather
from .world import World, barrier


FORMAT = 5  # 5: a fingerprint names every setting by where it lives ("data.seq_len"); 4: by name in some sections
READS = (4, 5)  # format 4 through `_from_format_4`, once, as a manifest is read
LATEST = "latest"
MANIFEST = copies.MANIFEST  # the directory's list of files and their checksums, named where copies read it


def fingerprint(cfg: "RunConfig") -> dict[str, Any]:
    """The settings that must match for a checkpoint to continue this run exactly (JSON values), one by one and by
    where each lives ("seed", "data.seq_len", "compression.forward"), so a refusal names the one that differs: every
    setting but those whose field says a resume may change it (`resume=FREE`: compression/fields.py)."""
    values = {"task": cfg.task}
    for dest, f in destinations():
        if f.metadata.get("resume") != FREE:
            values[dest] = value_at(cfg, dest)
    if values["data.max_train_samples"] == 0:  # 0 and None both mean all of them
        values["data.max_train_samples"] = None
    return _json(values)


def _json(value: Any) -> Any:
    """`value` as a manifest holds it (a dtype by its name, a tuple as a list)."""
    return json.loads(json.dumps(value, default=lambda v: str(v).removeprefix("torch.")))


def _from_format_4(theirs: dict[str, Any]) -> dict[str, Any]:
    """A format-4 fingerprint in format 5's names: the settings of the data, optimization, checkpointing and
    distributed sections were named alone ("seq_len"), and LoRA's, in checkpoints from before its section, flat
    ("lora_rank")."""
    alone = {dest.split(".", 1)[1]: dest for dest, _ in destinations()
             if dest.split(".")[0] in ("data", "optimization", "checkpointing", "distributed")}
    lora_flat = {f"lora_{dest.split('.', 1)[1]}": dest for dest, _ in destinations() if dest.startswith("lora.")}
    return {alone.get(k, lora_flat.get(k, k)): v for k, v in theirs.items()}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def rank_file(stage: int, replica: int) -> str:
    return f"stage{stage}_replica{replica}.pt"


# ---------------------------------------------------------------------- finding and checking
def find(resume: str, output_dir: str, allow_missing: bool = False) -> Path | None:
    """The checkpoint directory `--resume` names: latest/auto (under output_dir), a checkpoints
    directory, an output directory, or a step directory. ValueError when there is none
    (None for `auto` with nothing saved yet: the run starts fresh)."""
    base = Path(output_dir) / "checkpoints" if resume in ("latest", "auto") else Path(resume)
    for candidate in (base, base / "checkpoints"):
        if (candidate / MANIFEST).is_file():
            return candidate
        marker = candidate / LATEST
        if marker.is_file():
            target = candidate / marker.read_text().strip()
            if not (target / MANIFEST).is_file():
                raise ValueError(f"resume={resume!r}: {marker} names {target.name}, which has no {MANIFEST}")
            return target
    if resume == "auto" or allow_missing:
        return None
    raise ValueError(f"resume={resume!r}: no checkpoint at {base} (expected a directory with {MANIFEST} or "
                     f"a '{LATEST}' marker; --save_every N writes them)")


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, its fingerprint in this format's names whatever format wrote it."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {directory}: unreadable {MANIFEST} ({exc})") from None
    if manifest.get("format") not in READS:
        raise ValueError(f"checkpoint {directory}: format {manifest.get('format')!r}, this aqpipe reads "
                         f"{', '.join(map(str, READS))}")
    if manifest["format"] == 4:
        manifest["fingerprint"] = _from_format_4(manifest["fingerprint"])
    return manifest


def saved_buffer_plan(directory: Path | None) -> dict[str, Any] | None:
    """The buffer plan's note a checkpoint's run kept (None: none, or no checkpoint)."""
    return None if directory is None else read_manifest(directory).get("buffer_plan")


def check_compatible(directory: Path, cfg: "RunConfig") -> "RunConfig":
    """cfg with the values its run resolved when it started, after refusing a checkpoint whose settings differ
    from cfg's (naming each by its flag). What a setting missing from the checkpoint meant, and whether `auto` takes
    the checkpoint's resolved value, are its field's metadata (`older`, `resume=KEPT`: compression/fields.py)."""
    manifest = read_manifest(directory)
    mine, theirs = fingerprint(cfg), manifest["fingerprint"]
    fields_at = dict(destinations())
    same_stages = mine.get("distributed.pipeline_stages") == theirs.get("distributed.pipeline_stages")
    reshapes = "stage_blocks" in manifest  # a checkpoint from before it cannot say its blocks: its shape is kept
    for key, f in fields_at.items():
        if f.metadata.get("resume") == RESHAPES and reshapes:  # another shape reshards as it loads (reshape.py)
            if same_stages and mine.get(key) == "auto" and theirs.get(key) not in (None, "auto"):
                cfg = _with(cfg, key, theirs[key])  # the blocks the run had, where the stages are the same
            mine.pop(key, None)
            continue
        if key in mine and key not in theirs and "older" in f.metadata:  # written before the setting existed
            theirs[key] = mine[key] if f.metadata["older"] is THIS_RUN else _json(f.metadata["older"])
        if key == SHARES and theirs.get(REPLICAS, 1) != cfg.replicas:
            continue  # the shares of another replica count: this run's own (_regrouped)
        if f.metadata.get("resume") in (KEPT, RESHAPES) and mine.get(key) == "auto" and \
                theirs.get(key) not in (None, "auto"):
            mine[key] = theirs[key]  # resolved when its run started (a QAdam warm-up's steps): kept, whatever the
            # epochs now resolve it to
            cfg = _with(cfg, key, theirs[key])
    cfg = _regrouped(cfg, manifest, mine, theirs)
    diff = [f"{_flag(k, fields_at)}={theirs[k]!r} in the checkpoint, {v!r} in this run" if k in theirs else
            f"{_flag(k, fields_at)}={v!r} in this run, which the checkpoint does not record"
            for k, v in mine.items() if k not in theirs or theirs[k] != v]
    if diff:
        raise ValueError(f"checkpoint {directory} was written by a different run: " + "; ".join(diff))
    return cfg


REPLICAS, MICRO_BATCHES, SHARES = "data_parallel.replicas", "num_micro_batches", "data_parallel.shares"


def _regrouped(cfg: "RunConfig", manifest: dict[str, Any], mine: dict[str, Any],
               theirs: dict[str, Any]) -> "RunConfig":
    """cfg resuming on another replica count than the checkpoint's: the global batch is the checkpoint's, so each
    replica takes num_micro_batches x old replicas / new ones (the LR plan and the epoch's steps stay the run's:
    data/regroup.py). ValueError where the count does not divide it, or the checkpoint does not say its position."""
    old, new = theirs.get(REPLICAS, 1), cfg.replicas
    position = manifest.get("position") or {}
    if old != new and not position:
        raise ValueError(f"resume on {new} replicas: the checkpoint, {old} replicas, was written before checkpoints "
                         f"recorded their data position; expected replicas={old} (then save once and resume at {new})")
    if old != new:  # each replica's share is this run's (the rest of the epoch is cut as they weigh it)
        mine.pop(SHARES, None)
    whole = theirs[MICRO_BATCHES] * old  # micro-batches in a global batch
    # the count this run's flags give is the checkpoint's, or the one its launch was given before a regroup rescaled
    # it (an elastic restart passes the first launch's flags again): both mean the checkpoint's global batch
    given = (theirs[MICRO_BATCHES], position.get("launched", theirs[MICRO_BATCHES]))
    if cfg.num_micro_batches * new != whole and cfg.num_micro_batches not in given:
        return cfg  # another num_micro_batches than the checkpoint's: refused as any other change
    if whole % new:
        raise ValueError(f"resume on {new} replicas: the checkpoint's global batch of {whole} micro-batches "
                         f"({theirs[MICRO_BATCHES]} x {old} replicas) does not split over {new}; expected a replica "
                         f"count dividing {whole}")
    mine[MICRO_BATCHES] = theirs[MICRO_BATCHES]
    shares = cfg.data_parallel.shares
    if isinstance(shares, list) and sum(shares) != whole:
        raise ValueError(f"resume on {new} replicas: micro_batch_shares={','.join(map(str, shares))} sum to "
                         f"{sum(shares)} micro-batches, the checkpoint's global batch {whole} ({theirs[MICRO_BATCHES]} "
                         f"x {old} replicas); expected shares summing to {whole}, or auto")
    return _with(cfg, MICRO_BATCHES, whole // new)


def _with(cfg: "RunConfig", dest: str, value: Any) -> "RunConfig":
    """cfg with the setting at `dest` ("section.name" or "name") set to `value`."""
    section, _, name = dest.rpartition(".")
    return replace(cfg, **({section: replace(getattr(cfg, section), **{name: value})} if section else {name: value}))


def _flag(dest: str, fields_at: dict[str, Any]) -> str:
    """A setting by the name its flag gives it ("lora_rank" for "lora.rank")."""
    f = fields_at.get(dest)
    return dest if f is None else f.metadata.get("flag", f.name)


# ---------------------------------------------------------------------- state files
def write_state(path: Path, state: dict[str, Any]) -> str:
    """torch.save(state) atomically; returns the file's sha256."""
    return atomic_write(path, lambda f: torch.save(state, f))


def read_state(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """torch.load(weights_only=True), after checking the file against its recorded checksum."""
    if sha256 is not None and sha256_of(path) != sha256:
        raise ValueError(f"checkpoint file {path} does not match its checksum: it was changed or is incomplete")
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and python generators, as tensors and plain values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


# ---------------------------------------------------------------------- save and load
def save(root: Path, step: int, engine: Any, progress: dict[str, Any], cfg: "RunConfig", world: "World",
         storage: "Storage", keep: int | None = None, last: bool = False,
         buffer_plan: dict[str, Any] | None = None, keepers: list[tuple[int, ...]] | None = None) -> Path:
    """Every rank calls this after step `step`; returns the checkpoint directory.

    `progress` is the training loop's own state (data position, totals, losses, metrics time). Each rank writes its
    files on its own storage; after a barrier (no deadline: a large stage takes what it takes to write), rank 0
    gathers every rank's checksums over the process group, and every finalizer (one per storage: storage.py)
    writes the same manifest into its copy of the directory, renames it into place and moves its `latest`. `last`:
    the run trains no more, so AQ-SGD buffers kept in files hand their files over instead of copying them.
    `buffer_plan`: the note of the run's buffer plan (aqpipe.buffer_plan), which a resume keeps where it can.
    `keepers`: the storages (checkpoint_copies.storage_groups) among which each rank's files are copied to the next
    one before the manifest is written (None or one storage: no copy)."""
    state = engine.state_dict()
    place = state["place"]
    partial = root / f"step_{step:08d}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    externals = {}  # AQ-SGD buffers kept in files: their rows are copied beside the .pt, not into it
    for name, buffer in engine.file_buffers().items():
        target = partial / f"{Path(buffer.path).stem}.buf"
        if last:
            buffer.hand_over(target)
            fsync_dir(partial)
            externals[name] = {"file": target.name, "sha256": sha256_of(target)}
        else:
            externals[name] = {"file": target.name, "sha256": atomic_write(target, buffer.write_rows)}
    record = {"fingerprint": fingerprint(cfg), "step": step, "engine": state, "progress": progress,
              "rng": rng_state(), "external_buffers": externals}
    name = rank_file(place["stage"], place["replica"])
    note = {"rank": world.rank, "file": name, "sha256": write_state(partial / name, record),
            "external_buffers": externals, "stage": place["stage"], "blocks": len(state["blocks"])}
    barrier(world)  # every rank's files complete
    if keepers and len(keepers) > 1:
        copies.copy_to_keepers(partial, copies.rank_files(note), world, keepers)
    notes = gather(note, world)
    manifest = None
    if notes is not None and sorted(n["rank"] for n in notes) == list(range(world.size)):
        manifest = {"format": FORMAT, "step": step, "world_size": world.size, "fingerprint": fingerprint(cfg),
                    "files": sorted(notes, key=lambda n: n["rank"]), "buffer_plan": buffer_plan,
                    "placement": engine.groups.grid.placement,  # who held which (stage, replica): a resume may differ
                    "stage_blocks": [n["blocks"] for n in sorted({n["stage"]: n for n in notes}.values(),
                                                                 key=lambda n: n["stage"])],  # a resume may reshape
                    "position": _position(progress)}  # ... or regroup (dealing.py)
    manifest = broadcast(manifest, world)
    if manifest is None:
        raise RuntimeError(f"checkpoint {partial}: not every rank's files were noted")
    final = step_dir(root, step)
    if storage.finalizer:
        atomic_write(partial / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        if final.exists():
            shutil.rmtree(final)  # a stale copy from an earlier attempt at the same step
        os.replace(partial, final)
        fsync_dir(root)
        atomic_write(root / LATEST, lambda f: f.write(f"{final.name}\n".encode()))  # only now is it the one to load
        _prune(root, keep, final)
    barrier(world)  # every storage's copy in place before any rank goes on
    return final


def _position(progress: dict[str, Any]) -> dict[str, Any] | None:
    """Where the run stopped and how it deals that epoch (dealing.Dealing.note); None from a caller without it."""
    if "epoch" not in progress:
        return None
    return {"epoch": progress["epoch"], "index": progress["index"], **(progress.get("dealing") or {})}


def agree(found: Path | None, root: Path, world: "World", storage: "Storage | None" = None) -> Path | None:
    """The checkpoint every rank resumes from (None: every rank starts fresh): the one each found on its own
    storage (`found`, under `root`) when they agree, else the newest step whose every rank's files some machine holds
    (a machine stopped while the others finalized a later one, or came back empty: checkpoint_copies.py gives it
    its files from the machine holding a copy). ValueError, on every rank alike, when some rank resumes and no step
    has every rank's files anywhere."""
    held = copies.held(root)  # step -> the ranks whose files are all on this rank's storage
    here = {"name": found.name if found is not None else None,
            "steps": [step for step, ranks in held.items() if world.rank in ranks], "held": held,
            "sizes": copies.world_sizes(root)}
    everyone = gather(here, world)
    verdict: Any = None
    wants: dict[int, list[tuple[int, str]]] = {}
    if everyone is not None:
        names = {e["name"] for e in everyone}
        holders: dict[int, dict[int, int]] = {}  # step -> rank -> the lowest rank holding its files
        files: dict[int, dict[int, str]] = {}  # step -> rank -> its state file
        for holder, e in enumerate(everyone):
            for step, ranks in e["held"].items():
                for r, name in ranks.items():
                    holders.setdefault(int(step), {}).setdefault(r, holder)
                    files.setdefault(int(step), {})[r] = name
        sizes = {step: n for e in everyone for step, n in e["sizes"].items()}  # the world that wrote each step
        whole = [step for step, by in holders.items() if len(by) == sizes.get(step)]
        if len(names) == 1:
            verdict = names.pop() or ""
        elif whole:
            step = max(whole)
            verdict = step_dir(Path(), step).name
            if sizes[step] == world.size:  # each rank its own files, where its machine has none
                wants = {r: [(holders[step][r], files[step][r])] for r in range(world.size)
                         if step not in everyone[r]["steps"]}
            else:  # another world: the files each rank reads come after (train.place_ranks); here, the manifest,
                # with one file, to each rank whose machine holds none of the step
                first = min(holders[step])
                wants = {r: [(holders[step][first], files[step][first])] for r in range(world.size)
                         if step not in everyone[r]["held"]}
        else:
            verdict = f"resume: no checkpoint whose every rank's files some machine holds (steps by rank: " \
                      f"{[e['steps'] for e in everyone]}); a machine that lost its files has no copy elsewhere " \
                      "(--copy_checkpoints, the default, keeps one): restore them, or start anew with " \
                      "--overwrite_output_dir"
    verdict, wants = broadcast((verdict, wants), world)
    if verdict and not verdict.startswith("step_"):
        raise ValueError(verdict)
    if wants:
        copies.bring_back(root, verdict, wants, world, storage or Storage(world.rank, tuple(range(world.size))))
    elif found is not None and verdict == found.name:
        return found  # where --resume named it, perhaps another run's output directory
    return root / verdict if verdict else None


def _prune(root: Path, keep: int | None, newest: Path) -> None:
    """Drop all but the `keep` newest complete checkpoints (never the one `latest` names)."""
    if not keep:
        return
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / MANIFEST).is_file())
    for old in complete[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def load(directory: Path, engine: Any, cfg: "RunConfig | None", reading: "reshape.Reading | None" = None
         ) -> dict[str, Any]:
    """Load this rank's state into the engine and the global RNGs; returns the training loop's progress. `reading`:
    the old stages this rank's state is resharded from, where the run's shape differs from the checkpoint's. `cfg`:
    checked against the checkpoint first (None: its caller checked the settings as given, before the run resolved
    its `auto` values for its length: train.py)."""
    if cfg is not None:
        check_compatible(directory, cfg)
    manifest = read_manifest(directory)
    stage, replica = engine.groups.stage, engine.groups.replica
    if reading is None:
        record = _read_record(directory, manifest, stage, replica)
        engine.load_state_dict(record["engine"])
    else:  # each old stage as its replicas' average, its codecs this replica's own
        own = reading.own(replica)
        records = {s: [_read_record(directory, manifest, s, r, rows=r == own and not reading.regroups)
                       for r in range(reading.replicas)] for s in reading.sources}
        record = records[min(records)][own]
        state, fresh = reshape.merge({s: reshape.averaged([r["engine"] for r in rs], own)
                                      for s, rs in records.items()}, engine.state_dict(), reading.old, reading.new,
                                     stage, engine.stage.hf_parameter_names(), codecs=not reading.regroups)
        engine.load_state_dict(state, fresh)
    set_rng_state(record["rng"])
    return record["progress"]


def _read_record(directory: Path, manifest: dict[str, Any], stage: int, replica: int,
                 rows: bool = True) -> dict[str, Any]:
    """(stage, replica)'s record, checked against its checksum, naming its AQ-SGD rows' copy where kept in files
    (`rows`: checked too; another replica's, read for its weights alone, are not)."""
    name = rank_file(stage, replica)
    entry = next((f for f in manifest["files"] if f["file"] == name), None)
    if entry is None:
        raise ValueError(f"checkpoint {directory} has no {name} for stage {stage}, replica {replica}")
    record = read_state(directory / name, entry["sha256"])
    for codec_name, ref in record["external_buffers"].items() if rows else ():  # the .pt names the samples; the
        # rows are the copy's
        if sha256_of(directory / ref["file"]) != ref["sha256"]:
            raise ValueError(f"AQ-SGD buffer snapshot {directory / ref['file']} does not match its checksum")
        record["engine"]["codecs"][codec_name]["buffer"]["rows_file"] = str(directory / ref["file"])
    return record
