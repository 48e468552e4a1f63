"""Rows of one shape, by slot, in a mapping whose pages cost memory (or disk blocks) only once written.

An AQ-SGD buffer knows at start how many rows it may need, rarely how many it will write: a run cut short by
`--max_steps`, or one whose samples mostly come back never, writes few. So its rows live in a mapping the kernel
fills lazily: private anonymous memory (an untouched page is the shared zero page: no zero-fill up front) or, with a
path, a file mapped shared, its blocks reserved when it is made (a write through a mapping to a full disk would kill
the process with SIGBUS; a reservation fails at once, in one line) and its pages read in as rows are used. Slots are
handed out from 0, so the rows that exist are a prefix: what a checkpoint saves, as a tensor over exactly that
prefix (`prefix`: no copy, and torch.save writes no more).
"""
from __future__ import annotations

import errno
import math
import mmap
import os
from pathlib import Path
from typing import BinaryIO

import torch


def human_bytes(nbytes: float) -> str:
    """Bytes as a reader compares them with RAM and disks (kB, MB, GB, TB: powers of 10), three digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes / 1e3:.3g} kB"


class RowStore:
    """`capacity` rows of `row_shape` in `dtype`: in memory, or in the file `path` (created or emptied here)."""

    def __init__(self, capacity: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 path: str | os.PathLike | None = None) -> None:
        self.row_shape, self.dtype = tuple(row_shape), dtype
        self.path = None if path is None else Path(path)
        self.row_numel = math.prod(self.row_shape)
        self.row_nbytes = self.row_numel * dtype.itemsize
        self.capacity = 0
        self._map: mmap.mmap | None = None
        self.values = torch.empty((0, *self.row_shape), dtype=dtype)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.open("wb").close()  # a row is read only after it is written: earlier contents never matter
        self.grow(capacity, keep=0)

    def grow(self, capacity: int, keep: int) -> None:
        """Room for `capacity` rows (at least the current), the first `keep` kept: a new, larger mapping."""
        capacity = max(capacity, self.capacity)
        if capacity == self.capacity and self._map is not None:
            return
        old = self.values
        nbytes = max(1, capacity * self.row_nbytes)  # mmap cannot map 0 bytes
        try:
            if self.path is None:
                mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
            else:
                with open(self.path, "r+b") as f:
                    os.posix_fallocate(f.fileno(), 0, nbytes)  # the blocks reserved, none written
                    mapped = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
        except (OSError, ValueError) as exc:  # ENOMEM: more than the kernel lets this process reserve
            where = "in memory" if self.path is None else f"in {self.path}"
            raise ValueError(f"AQ-SGD buffer: cannot map {capacity} rows of {self.row_nbytes} bytes "
                             f"({human_bytes(capacity * self.row_nbytes)}) {where} ({exc}): expected a budget this "
                             "machine holds (--buffer_memory_gb, --buffer_disk_gb)") from None
        values = torch.frombuffer(mapped, dtype=self.dtype, count=capacity * self.row_numel) if capacity else \
            torch.empty((0,), dtype=self.dtype)
        values = values.view(capacity, *self.row_shape)
        if keep and self.path is None:  # a file's rows are already in the larger mapping, in the same bytes
            values[:keep].copy_(old[:keep])
        self._map, self.values, self.capacity = mapped, values, capacity

    def prefix(self, count: int) -> torch.Tensor:
        """The first `count` rows, sharing this store's memory in a storage of exactly their bytes."""
        if not count:
            return self.values[:0].clone()
        return torch.frombuffer(self._map, dtype=self.dtype, count=count * self.row_numel).view(count, *self.row_shape)

    def write_prefix(self, f: BinaryIO, count: int, chunk_bytes: int = 4 << 20) -> None:
        """The first `count` rows' bytes to a binary file, a few MB at a time."""
        step = max(1, chunk_bytes // self.row_nbytes)
        for start in range(0, count, step):
            chunk = self.values[start:min(start + step, count)].contiguous().view(torch.uint8)
            f.write(memoryview(chunk.numpy()))

    def file_rows(self, source: str | os.PathLike, count: int) -> torch.Tensor:
        """`count` rows from a file of exactly their bytes (as `write_prefix` writes them), mapped: read as they are
        copied. ValueError, naming both sizes, for a file of another size."""
        size, want = Path(source).stat().st_size, count * self.row_nbytes
        if size != want:
            raise ValueError(f"AQ-SGD buffer rows {source} hold {size} bytes; {count} rows take {want}")
        if not count:
            return self.values[:0]
        return torch.from_file(str(source), shared=False, size=count * self.row_numel,
                               dtype=self.dtype).view(count, *self.row_shape)

    def hand_over(self, count: int, target: str | os.PathLike) -> None:
        """The file itself to `target`, cut to its first `count` rows: a run's last copy of rows no one writes again
        (a move within a filesystem, a copy across two). The store holds nothing after it."""
        if self.path is None:
            raise ValueError("RowStore.hand_over: only a store kept in a file hands its file over")
        self._map.flush()  # the rows written through the mapping, on disk
        os.truncate(self.path, count * self.row_nbytes)  # nothing reads the mapping past this again
        try:
            os.replace(self.path, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with open(target, "wb") as f:  # another filesystem: the rows' bytes are copied
                self.write_prefix(f, count)
                f.flush()
                os.fsync(f.fileno())
            self.path.unlink()
        self.release()

    def release(self) -> None:
        """Drop this store's mapping (its memory or file blocks go once no tensor over it is left): it holds nothing
        after."""
        self.values, self._map, self.capacity = self.values[:0].clone(), None, 0
