"""A checkpoint that outlives the machine that wrote it, with no shared filesystem.

Where ranks write to different machines' storage (storage.py), each save also copies every rank's files to the next
storage in a ring (ordered by lowest rank): machine 1's files to machine 0's rank that finalizes there, machine 0's to
machine 1's, so each checkpoint lives on two machines. A machine that comes back empty (a new one, a wiped disk)
is given its ranks' files of the newest checkpoint every rank's files exist for, by the rank that holds them, over
the process group, before anything loads (`bring_back`). The copy costs each rank's checkpoint once over the link
a save (`--no_copy_checkpoints` turns it off). With no copy anywhere, a resume with a machine's files lost is
refused in one line (checkpoint.agree).

Transfers go one source at a time in rank order, the same order on every rank: no two ranks wait on each other.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .atomic_files import atomic_write
from .storage import Storage, broadcast, gather
from .stream import recv_tensors, send_tensors
from .world import World, barrier

MANIFEST = "manifest.json"  # a checkpoint directory's list of its files (checkpoint.py writes it)


def storage_groups(storage: Storage, world: World) -> list[tuple[int, ...]]:
    """Every storage's ranks, ordered by their lowest rank: the same list on every rank."""
    everyone = gather(storage.peers, world)
    groups = sorted(set(everyone), key=min) if everyone is not None else None
    return broadcast(groups, world)


def keeper(groups: list[tuple[int, ...]], rank: int) -> int | None:
    """The rank that keeps a copy of `rank`'s checkpoint files: the lowest rank of the next storage (None: one)."""
    if len(groups) < 2:
        return None
    here = next(i for i, g in enumerate(groups) if rank in g)
    return min(groups[(here + 1) % len(groups)])


def _as_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    return {name: torch.frombuffer(bytearray((directory / name).read_bytes()), dtype=torch.uint8)
            for name in names}


def _write(directory: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Each file whole or not at all; returns the bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in tensors.items():
        atomic_write(directory / name, lambda f, data=data: f.write(data.numpy().tobytes()))
    return sum(t.numel() for t in tensors.values())


def rank_files(note: dict[str, Any]) -> list[str]:
    """A rank's files in a checkpoint, by its manifest entry: its state and its AQ-SGD buffer files."""
    return [note["file"], *(ref["file"] for ref in note.get("external_buffers", {}).values())]


_said = False  # the copy's cost is said once a process, at its first save


def copy_to_keepers(directory: Path, mine: list[str], world: World, groups: list[tuple[int, ...]]) -> int:
    """At a save, every rank's files (`mine` here) land in its keeper's copy of `directory` too; the bytes sent."""
    global _said
    sent = 0
    names = gather(mine, world)
    names = broadcast(names, world)
    for src in range(world.size):
        dst = keeper(groups, src)
        if dst is None:
            continue
        if world.rank == src:
            sent += send_tensors(_as_tensors(directory, names[src]), dst, world.transport)
        elif world.rank == dst:
            _write(directory, recv_tensors(src, world.transport))
    if sent and not _said:
        _said = True
        print(f"checkpoint: rank {world.rank}'s files ({sent / 1e6:.1f} MB) copied to rank "
              f"{keeper(groups, world.rank)} on another machine at each save, so a machine that comes back empty "
              "resumes (--no_copy_checkpoints: no copy)", file=sys.stderr, flush=True)
    return sent


def held(root: Path) -> dict[int, dict[int, str]]:
    """The finalized checkpoints under `root`: step -> the ranks whose files are all here (their own or a copy),
    each with its state file's name."""
    out: dict[int, dict[int, str]] = {}
    for directory in sorted(root.glob("step_*")):
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError):
            continue  # unfinished
        out[int(manifest["step"])] = {entry["rank"]: entry["file"] for entry in manifest.get("files", [])
                                      if all((directory / name).is_file() for name in rank_files(entry))}
    return out


def world_sizes(root: Path) -> dict[int, int]:
    """The finalized checkpoints under `root`: step -> the number of ranks that wrote it."""
    out = {}
    for directory in sorted(root.glob("step_*")):
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            out[int(manifest["step"])] = int(manifest.get("world_size", len(manifest.get("files", []))))
        except (OSError, ValueError, KeyError):
            continue  # unfinished
    return out


def slot_files(directory: Path) -> list[str]:
    """The state files (one per (stage, replica)) of a checkpoint whose files are all in `directory` here."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    return [entry["file"] for entry in manifest.get("files", [])
            if all((directory / name).is_file() for name in rank_files(entry))]


def fetch_slots(directory: Path, mine: list[str], world: World, storage: Storage) -> None:
    """The (stage, replica) files of checkpoint `directory` each rank reads (`mine`: this rank's state files) on its
    own storage, fetched from a rank whose storage holds them where it has none: a resume under another placement or
    shape than the checkpoint's run had, with no shared filesystem. Every rank calls it; nothing moves where each has
    its own."""
    everyone = gather({"want": list(mine), "have": slot_files(directory)}, world)
    wants: dict[int, list[tuple[int, str]]] = {}
    if everyone is not None:
        for rank, e in enumerate(everyone):
            for name in e["want"]:
                if name not in e["have"]:
                    holder = next((r for r, other in enumerate(everyone) if name in other["have"]), None)
                    if holder is not None:  # none: checkpoint.load says which file is missing
                        wants.setdefault(rank, []).append((holder, name))
    wants = broadcast(wants, world)
    if wants:
        bring_back(directory.parent, directory.name, wants, world, storage)


def bring_back(root: Path, step_name: str, wants: dict[int, list[tuple[int, str]]], world: World,
               storage: Storage) -> None:
    """The checkpoint `step_name` given to each rank that lacks files it reads (`wants`: rank -> (the rank that holds
    them, a state file's name) for each) by their holder, with the manifest; each storage that received files
    finalizes the directory after."""
    directory = root / step_name
    received = False
    for rank, holder, name in sorted((rank, holder, name) for rank, want in wants.items() for holder, name in want):
        if world.rank == holder:
            manifest = json.loads((directory / MANIFEST).read_text())
            entry = next(f for f in manifest["files"] if f["file"] == name)
            files = _as_tensors(directory, rank_files(entry))
            files[MANIFEST] = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8)
            send_tensors(files, rank, world.transport)
        elif world.rank == rank:
            tensors = recv_tensors(holder, world.transport)
            manifest = tensors.pop(MANIFEST)
            nbytes = _write(directory, tensors)
            (directory / f".{MANIFEST}.received{world.rank}").write_bytes(manifest.numpy().tobytes())
            received = True
            print(f"checkpoint: {step_name}'s {name} and its files ({nbytes / 1e6:.1f} MB) received by rank {rank} "
                  f"from rank {holder}: this machine held none", file=sys.stderr, flush=True)
    any_here = gather(received, world)
    any_here = broadcast(any_here, world)
    if storage.finalizer and any(any_here[r] for r in storage.peers):
        if not (directory / MANIFEST).is_file():
            received_manifest = next(directory.glob(f".{MANIFEST}.received*"))
            os.replace(received_manifest, directory / MANIFEST)
        for leftover in directory.glob(f".{MANIFEST}.received*"):
            leftover.unlink()
        atomic_write(root / "latest", lambda f: f.write(f"{step_name}\n".encode()))  # only now the one to load
    barrier(world)  # every storage's copy finalized before any rank loads it
