"""Which ranks share this rank's storage: machines joined by a slow network rarely share a filesystem.

Every rank writes a token file into the output directory; then each lists the tokens it can see. The ranks whose
tokens it sees write where it writes (one machine's disk, or a filesystem some or all machines share). Of each such
group the lowest rank *finalizes*: it renames a checkpoint's directory into place and moves the `latest` marker.
Files that must end up on rank 0's storage (the merged model) are written directly by the ranks that share it,
and streamed to rank 0 by the others (export.py). The same test serves one machine, a cluster on NFS, and
machines with local disks alike, without a setting.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .world import World, barrier


@dataclass(frozen=True)
class Storage:
    """This rank's place among the ranks writing to the same storage (`peers`, this rank among them)."""

    rank: int
    peers: tuple[int, ...]

    @property
    def finalizer(self) -> bool:
        """Whether this rank renames and marks what its peers wrote (the lowest of them)."""
        return self.rank == min(self.peers)

    @property
    def with_rank_zero(self) -> bool:
        """Whether what this rank writes is where rank 0 reads."""
        return 0 in self.peers


def gather(obj: Any, world: World) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere); call on every rank once all are ready (after a barrier: the
    process group's timeout applies)."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size if world.rank == 0 else []
    dist.gather_object(obj, out if world.rank == 0 else None, dst=0)
    return out if world.rank == 0 else None


def broadcast(obj: Any, world: World) -> Any:
    """Rank 0's `obj` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def detect(directory: str | os.PathLike, world: World) -> Storage:
    """Which ranks see the files this rank writes under `directory` (created here if missing); every rank calls
    it at the same point."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if not world.distributed:
        return Storage(0, (0,))
    nonce = broadcast(uuid.uuid4().hex if world.rank == 0 else None, world)
    mine = root / f".aqpipe-storage-{nonce}-{world.rank}"
    mine.touch()
    barrier(world)
    seen = tuple(sorted(int(p.name.rsplit("-", 1)[1]) for p in root.glob(f".aqpipe-storage-{nonce}-*")))
    barrier(world)
    mine.unlink()
    return Storage(world.rank, seen)
