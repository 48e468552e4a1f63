"""Files a crash never leaves half-written: written under a temporary name, synced, renamed into place."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO


class _HashingWriter:
    """A file object that hashes what passes through it (torch.save writes into it)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, fill: Any) -> str:
    """Write path through a temporary name (fsync, rename); `fill(f)` writes the bytes. Returns their sha256."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        fill(writer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return writer.sha.hexdigest()


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()
