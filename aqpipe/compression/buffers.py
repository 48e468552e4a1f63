"""Per-sample activation buffers m[ξ] for AQ-SGD, in memory or backed by a file.

A row for each sample that holds one: both sides of a boundary keep one buffer and apply the same updates, so
their rows stay bit-identical. A sample takes a row (a slot of a `RowStore`: row_store.py) when it is first stored,
and only a sample the buffer keeps (`keep`: those a run reads back) is: rows cost memory only once written, in
anonymous memory or in a memory-mapped file, and a checkpoint holds the rows that exist.

A row is held in a float dtype (float16 by default) or, with `bits` (4 or 8), quantized:
every vector of the last dimension (a token's hidden state) as `bits`-bit codes with its own
float32 min and step, rounded to nearest. Rounding is deterministic, so both sides, given the
same values, hold the same bytes; what a row loses to rounding returns in the next change the
sender computes against it. At 8 bits a GPT-2 row costs (1 + 8/hidden) bytes per value, about
half of float16; at 4 bits about a quarter.

Rows live in host memory (a dataset's worth does not fit a GPU). A pipeline step `defer`s its buffers' writes so
that no message waits for the GPU: rows read for a GPU travel through pinned memory without a host sync, rows
written are copied back the same way and are checked at `land_writes`, once the step's schedule is done (the first row
that overflows the buffer's dtype, as a BufferRangeError to report, not raise); rows from a GPU then land in the
buffer on a worker thread while the next step computes, and a read of them waits for that.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from .quantizer import QuantizedTensor, dequantize, quantize
from .row_store import RowStore
from .sample_ids import as_sample_ids
from .fields import check_int, is_int

BUFFER_BITS = (4, 8)  # quantized rows: byte-aligned codes, and at 8 bits half of float16

def row_nbytes(sample_shape: tuple[int, ...], dtype: torch.dtype = torch.float16, bits: int | None = None) -> int:
    """One buffer row's bytes: a sample's values in `dtype`, or at `bits` with a float32 min and step per vector of
    the last dimension."""
    if bits is None:
        return math.prod(sample_shape) * dtype.itemsize
    return QuantizedTensor.wire_nbytes(tuple(sample_shape), bits)


class BufferRangeError(ValueError):
    """An activation a buffer's dtype cannot hold (float16 above 65504): stored, it would become inf and
    poison every later visit of the sample. Raised before the buffer changes, on both sides alike."""

    def __init__(self, sample_id: int, value: float, dtype: torch.dtype) -> None:
        self.sample_id, self.value, self.dtype = sample_id, value, dtype
        super().__init__(f"sample {sample_id}'s activation reaches {value:.4g}, beyond what the {dtype} AQ-SGD "
                         "buffer can hold: use a bfloat16 or float32 buffer")


def check_storable(ids: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rows` (finite, one per id) as `dtype`; BufferRangeError naming the first sample that overflows it."""
    stored = rows.to(dtype)
    bad = ~torch.isfinite(stored.flatten(1)).all(dim=1) if stored.dim() > 1 else ~torch.isfinite(stored)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise BufferRangeError(int(ids[first]), float(rows[first].abs().max()), dtype)
    return stored


_LANDER: ThreadPoolExecutor | None = None


def _lander() -> ThreadPoolExecutor:
    """The one worker thread that lands rows copied from a GPU (torch's copies release the GIL)."""
    global _LANDER
    if _LANDER is None:
        _LANDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aqsgd-buffer")
    return _LANDER


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, for a GPU through pinned memory and without waiting for it (the caching host
    allocator keeps the pinned copy until the transfer is done)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def positions(mask: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The indices where a host mask is set, on `device` without a host sync (a mask indexing a GPU tensor would
    read its count back)."""
    return to_device(mask.nonzero().squeeze(1), device)


def _pinned_like(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


class Prepared(NamedTuple):
    """What `prepare` makes of rows about to be stored: `stored`, the buffer's own form (what `store` writes);
    `held`, the rows as the buffer will then hold them; `peaks`, each row's largest magnitude (inf where a
    quantized row's range passes float32), kept by a deferred buffer for `land_writes`'s range check, else None."""

    stored: torch.Tensor
    held: torch.Tensor
    peaks: torch.Tensor | None = None


class _Write(NamedTuple):
    """A deferred write: its samples and their slots, the rows' host copy, their peaks, and the event after which
    both are there (None on CPU)."""

    ids: torch.Tensor
    slots: torch.Tensor
    stored: torch.Tensor
    peaks: torch.Tensor
    ready: Any


CHUNK_ROWS = 256  # rows a checkpoint's rows are copied in at a time


class _Picked:
    """Rows `ids` of `rows`, gathered a slice at a time as they are copied (a checkpoint from before slots held every
    sample's row, maybe in a file larger than memory)."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        self.rows, self.ids = rows, ids

    def __getitem__(self, part: slice) -> torch.Tensor:
        return self.rows.index_select(0, self.ids[part])


class SampleBuffer:
    """m[ξ] for the samples that hold a row, and which do.

    `bits` None: rows held as `dtype`; 4 or 8: rows quantized (see the module doc), `dtype` unused. `keep`: which
    samples may hold a row (a bool per sample; None: every one). A sample kept out is never stored, so each of its
    visits is a first visit: a run gives rows only to the samples it will read back. A row is a slot in a
    `RowStore` (row_store.py), taken when the sample is first stored: rows cost memory only once written, and the
    store is sized for the kept samples alone.
    """

    def __init__(
        self, num_samples: int, sample_shape: tuple[int, ...], dtype: torch.dtype = torch.float16,
        path: str | os.PathLike | None = None, bits: int | None = None, keep: torch.Tensor | None = None,
    ) -> None:
        check_int("num_samples", num_samples, 1, what="a positive integer (the dataset size)")
        shape = tuple(sample_shape)
        if not all(is_int(d) and d >= 1 for d in shape):
            raise ValueError(f"sample_shape={sample_shape!r}: expected a tuple of positive integers")
        if not dtype.is_floating_point:
            raise ValueError(f"buffer_dtype={dtype}: expected a floating dtype (float16, bfloat16, float32)")
        if bits is not None and bits not in BUFFER_BITS:
            raise ValueError(f"buffer_bits={bits!r}: expected one of {', '.join(map(str, BUFFER_BITS))}, "
                             "or none for rows in the buffer dtype")
        if keep is not None and (not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool
                                 or tuple(keep.shape) != (num_samples,)):
            raise ValueError(f"keep: expected a bool tensor of one value per sample ({num_samples}), got "
                             f"{getattr(keep, 'dtype', type(keep).__name__)} {tuple(getattr(keep, 'shape', ()))}")
        self.num_samples, self.sample_shape, self.bits = num_samples, shape, bits
        self.dtype = dtype if bits is None else torch.float32  # what a row decodes to (and the range it holds)
        self.path = None if path is None else Path(path)
        if bits is None:
            row_shape, storage = shape, dtype
        else:
            numel = math.prod(shape)
            if numel * bits % 8:
                raise ValueError(f"buffer_bits={bits}: a sample of {numel} values at {bits} bits is not whole bytes; "
                                 "use 8 bits")
            self._groups = numel // shape[-1]  # one per vector of the last dimension
            row_shape, storage = (row_nbytes(shape, bits=bits),), torch.uint8
        self.keep = None if keep is None else keep.cpu().clone()
        self._slot = torch.full((num_samples,), -1, dtype=torch.int32)  # each sample's row in the store, -1: none
        self.used = 0  # slots taken: rows 0..used-1 of the store hold samples
        self.store_rows = RowStore(num_samples if keep is None else int(keep.sum()), row_shape, storage, self.path)
        self._writes: list[_Write] | None = None  # deferred writes (defer); None: each written at once
        self._overflow: BufferRangeError | None = None  # the first a landed write found since the last land_writes
        self._landing: tuple[Future, torch.Tensor] | None = None  # rows still landing on the worker, their ids

    def defer(self) -> None:
        """From now on rows are written at `land_writes` (seen bits at once): for a caller that calls it after each
        step's schedule and undoes a step whose `land_writes` reports an overflow. Nothing then waits for the GPU per
        message."""
        if self._writes is None:
            self._writes = []

    @property
    def values(self) -> torch.Tensor:
        """The store's rows by slot (rows 0..used-1 hold samples), in the buffer's own form."""
        return self.store_rows.values

    @property
    def seen(self) -> torch.Tensor:
        """Whether each sample holds a row (a new vector: `has_row` reads a micro-batch's)."""
        return self._slot >= 0

    @property
    def row_nbytes(self) -> int:
        """One row's bytes in the buffer's own form."""
        return self.store_rows.row_nbytes

    @property
    def nbytes(self) -> int:
        """The bytes of the rows held (their slots'); the store maps more, which costs nothing until written."""
        return self.used * self.row_nbytes

    @property
    def index_nbytes(self) -> int:
        """The bytes of the slot table: 4 a sample, held or not (all a sample costs before it has a row)."""
        return self._slot.numel() * self._slot.element_size()

    def has_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each of `ids` holds a row (a host bool vector)."""
        return self._slot[ids] >= 0

    def keeps(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each of `ids` holds a row or may take one when stored (a host bool vector)."""
        return self.has_row(ids) | (True if self.keep is None else self.keep[ids])

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the samples holding rows, ascending; their rows in the buffer's own form): what two sides compare."""
        self._land(None)
        ids = self.seen.nonzero().squeeze(1)
        return ids, self.values.index_select(0, self._slot[ids].long())

    def check_ids(self, sample_ids: Any, batch: int | None = None) -> torch.Tensor:
        return as_sample_ids(sample_ids, self.num_samples, batch)

    def _room(self) -> int:
        """Rows this buffer may come to hold: one for each sample kept or holding one."""
        return self.num_samples if self.keep is None else int((self.keep | (self._slot >= 0)).sum())

    def _check_live(self) -> None:
        if self.used and not self.store_rows.capacity:
            raise RuntimeError("AQ-SGD buffer: its rows were handed over to the run's last checkpoint; nothing reads "
                               "or writes them after")

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_live()
        slots = self._slot[ids].long()
        if ids.numel() and int(slots.min()) < 0:
            missing = ids[slots < 0].tolist()
            raise RuntimeError(f"AQ-SGD buffer: samples {missing[:8]} hold no row (read before their first visit)")
        return slots

    def rows(self, ids: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """The rows of `ids` as the buffer holds them (quantized rows decoded to float32), on `device` (default:
        the buffer's): quantized rows travel there as their codes and are decoded there."""
        self._land(ids)
        slots = self._slots(ids)
        if device is not None and torch.device(device).type == "cuda" and self.values.device.type == "cpu":
            held = torch.index_select(self.values, 0, slots, out=_pinned_like((ids.numel(), *self.values.shape[1:]),
                                                                              self.values.dtype))
            held = held.to(device, non_blocking=True)
        else:
            held = self.values.index_select(0, slots)
            if device is not None:
                held = held.to(device)
        if self.bits is None:
            return held
        n, g = ids.numel(), self._groups
        scales = held[:, :8 * g].contiguous()  # each row: its mins, its steps, then its codes
        q = QuantizedTensor(held[:, 8 * g:].reshape(-1), scales[:, :4 * g].contiguous().view(torch.float32).reshape(-1),
                            scales[:, 4 * g:].contiguous().view(torch.float32).reshape(-1),
                            torch.Size((n, *self.sample_shape)), torch.float32, self.bits)
        return dequantize(q)

    def prepare(self, ids: torch.Tensor, rows: torch.Tensor) -> Prepared:
        """`rows` (one per id) made ready to store, on rows' device. At once: BufferRangeError before anything
        changes when a row does not fit (float16 beyond 65504). Deferred: no check here, which would read the
        device; the rows' peaks go with them to `land_writes`."""
        deferred = self._writes is not None
        peaks = rows.detach().flatten(1).abs().amax(dim=1).float() if deferred and rows.shape[0] else None
        if self.bits is None:
            # deferred: a copy, never `rows` itself (same dtype), which the caller computes with until the rows land
            stored = rows.to(self.dtype, copy=True) if deferred else check_storable(ids, rows, self.dtype)
            return Prepared(stored, stored, peaks)
        if not deferred:
            check_storable(ids, rows, torch.float32)
        q = quantize(rows.float(), self.bits, stochastic=False, check=not deferred)  # groups: last-dim vectors
        n, g = rows.shape[0], self._groups
        if peaks is not None:  # a group whose range passes float32 stores garbage: report it as an overflow
            peaks = torch.where(torch.isfinite(q.steps.view(n, g)).all(dim=1), peaks, float("inf"))
        packed = torch.cat([q.mins.view(torch.uint8).view(n, 4 * g), q.steps.view(torch.uint8).view(n, 4 * g),
                            q.codes.view(n, self.values.shape[1] - 8 * g)], dim=1)
        return Prepared(packed, dequantize(q), peaks)

    def _take_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The slots of `ids` (every one kept), a new one for each that holds no row yet, in the order given."""
        slots = self._slot[ids]
        new = slots < 0
        if bool(new.any()):
            if self.keep is not None and not bool(self.keep[ids[new]].all()):
                raise ValueError(f"AQ-SGD buffer: samples {ids[new][~self.keep[ids[new]]].tolist()[:8]} are kept out "
                                 "of this buffer (keep): expected only kept samples stored")
            count = int(new.sum())
            self._check_live()
            if self.used + count > self.store_rows.capacity:  # not after a load, which makes room for all at once
                self._land(None)
                self.store_rows.grow(max(self.used + count, self._room()), keep=self.used)
            slots[new] = torch.arange(self.used, self.used + count, dtype=slots.dtype)
            self._slot[ids[new]] = slots[new]
            self.used += count
        return slots.long()

    def store(self, ids: torch.Tensor, prepared: Prepared | torch.Tensor) -> None:
        """Write rows in the buffer's own form (`prepare`'s result; for a float buffer, rows in any dtype) for `ids`,
        which must be kept (`keeps`): at once, or, deferred, a host copy of them (from a GPU: pinned, without
        waiting for it) kept until `land_writes`."""
        if not ids.numel():
            return
        stored = prepared.stored if isinstance(prepared, Prepared) else prepared
        peaks = prepared.peaks if isinstance(prepared, Prepared) else None
        slots = self._take_slots(ids)
        if self._writes is None or peaks is None:
            self._land(ids)  # a write at once comes after the deferred ones of the same rows
            self.values.index_copy_(0, slots, stored.to(device="cpu", dtype=self.values.dtype))
            return
        ready, device = None, stored.device
        if device.type == "cuda":
            stored = _pinned_like(stored.shape, stored.dtype).copy_(stored, non_blocking=True)
            peaks = _pinned_like(peaks.shape, peaks.dtype).copy_(peaks, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._writes.append(_Write(ids, slots, stored, peaks, ready))

    def land_writes(self) -> BufferRangeError | None:
        """Check every deferred write (waiting for the GPU's copies once) and land them, in order; the first row that
        overflows the buffer's dtype, or None. An overflowing row lands too (as inf): the caller undoes the step.
        Rows copied from a GPU land on a worker thread, overlapping the next step's compute: a later read of them
        (or any read of every row) waits for it first."""
        self._wait_landing(None)
        writes = self._writes or []
        if self._writes is not None:
            self._writes = []
        for write in writes:
            self._check(write)
        if any(write.ready is not None for write in writes):
            self._landing = (_lander().submit(self._copy, writes), torch.cat([write.ids for write in writes]))
        else:
            self._copy(writes)
        found, self._overflow = self._overflow, None
        return found

    def _check(self, write: _Write) -> None:
        """Wait for a write's copy from the GPU and note its first row beyond the buffer's dtype (the first found)."""
        if write.ready is not None:
            write.ready.synchronize()
        if self._overflow is None:
            try:  # a row fits exactly where its largest magnitude does
                check_storable(write.ids, write.peaks, self.dtype)
            except BufferRangeError as exc:
                self._overflow = exc

    def _copy(self, writes: list[_Write]) -> None:
        for write in writes:
            self.values.index_copy_(0, write.slots, write.stored.to(self.values.dtype))

    def _wait_landing(self, ids: torch.Tensor | None) -> None:
        """Wait for the worker's landing if it holds any of `ids` (or at all, for None)."""
        if self._landing is not None:
            future, landing = self._landing
            if ids is None or bool(torch.isin(ids, landing).any()):
                future.result()
                self._landing = None

    def _discard(self) -> None:
        """Drop the deferred writes and their overflow (rows about to be replaced whole: a checkpoint's)."""
        self._wait_landing(None)
        if self._writes is not None:
            self._writes = []
        self._overflow = None

    def _land(self, ids: torch.Tensor | None) -> None:
        """Land deferred writes at once, in order, noting the first overflow: all, or those up to the last that
        touches `ids` (a step's sample ids are distinct, so within a step that is none)."""
        self._wait_landing(ids)
        if not self._writes:
            return
        count = len(self._writes)
        if ids is not None:
            touching = [i for i, write in enumerate(self._writes) if bool(torch.isin(write.ids, ids).any())]
            count = touching[-1] + 1 if touching else 0
        if count:
            self._wait_landing(None)  # an earlier step's rows land before these
        landing, self._writes = self._writes[:count], self._writes[count:]
        for write in landing:
            self._check(write)
        self._copy(landing)

    # ------------------------------------------------------------------ checkpoints
    def _ids_by_slot(self) -> torch.Tensor:
        """The sample each taken slot holds, in slot order."""
        ids = self.seen.nonzero().squeeze(1)
        return ids[self._slot[ids].argsort()]

    def state_dict(self) -> dict[str, Any]:
        """The rows that exist, not the dataset's worth: the sample of each slot and, in memory, a reference to the
        slots' rows (as torch's state_dicts do: save, don't mutate). A buffer kept in a file leaves its rows there
        (`rows` None): `write_rows` copies them as bytes, and the loaded state names the copy."""
        self._land(None)
        rows = None if self.path is not None else self.store_rows.prefix(self.used)
        return {"ids": self._ids_by_slot(), "rows": rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of state_dict (and of its form before slots: every sample's row and a seen bit each). A state
        without rows names the file holding them (`rows_file`, as `write_rows` wrote it: a checkpoint's copy of a
        buffer kept in a file); the rows land in this buffer wherever it keeps them."""
        source = state.get("rows_file")
        if "seen" in state:  # before slots: a row for every sample, the seen ones meaningful
            seen = state["seen"]
            if tuple(seen.shape) != (self.num_samples,):
                raise ValueError(f"seen bits for {tuple(seen.shape)} samples; this buffer has {self.num_samples}")
            ids, rows = seen.nonzero().squeeze(1), state["values"]
            if rows is None and source is not None:  # every sample's row, in order: these samples' picked out
                rows = self.store_rows.file_rows(source, self.num_samples)
            if rows is not None:
                rows = _Picked(self._checked_rows(rows, self.num_samples), ids)
        else:
            ids, rows = state["ids"], state["rows"]
            if rows is None and source is not None:
                rows = self.store_rows.file_rows(source, ids.numel())
        ids = as_sample_ids(ids, self.num_samples)
        if rows is None:
            raise ValueError("AQ-SGD buffer state without its rows: expected them, or the file that holds them")
        if not isinstance(rows, _Picked):
            rows = self._checked_rows(rows, ids.numel())
        self._discard()
        self._slot.fill_(-1)
        self._slot[ids] = torch.arange(ids.numel(), dtype=self._slot.dtype)
        self.used = ids.numel()
        self.store_rows.grow(self._room(), keep=0)  # the rows it brings and those still to come (one remap at most)
        for start in range(0, self.used, CHUNK_ROWS):  # a few rows at a time: a file's rows are read as copied
            part = slice(start, min(start + CHUNK_ROWS, self.used))
            self.values[part].copy_(rows[part])

    def _checked_rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        want = (count, *self.values.shape[1:])
        if tuple(rows.shape) != want or rows.dtype != self.values.dtype:
            raise ValueError(f"buffer state holds {tuple(rows.shape)} {rows.dtype}; this buffer expects {want} "
                             f"{self.values.dtype}")
        return rows

    def write_rows(self, f: BinaryIO, chunk_bytes: int = 4 << 20) -> None:
        """The held rows' bytes, in slot order, to a binary file, a few MB at a time: how a checkpoint copies a
        buffer too big for memory (its state then names the copy as `rows_file`)."""
        self._land(None)
        self.store_rows.write_prefix(f, self.used, chunk_bytes)

    def hand_over(self, target: str | os.PathLike) -> None:
        """A buffer kept in a file: the file itself becomes `target`, holding the rows `write_rows` would write, as
        a run's last checkpoint takes them (no copy of rows no step will change); the buffer is spent after it."""
        self._land(None)
        self.store_rows.hand_over(self.used, target)

    def release(self) -> None:
        """Let go of the rows (their memory, or their file's blocks once the file is removed): the buffer is spent."""
        self._land(None)
        self.store_rows.release()

    # ------------------------------------------------------------------ undo
    def snapshot(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Copies of the slots and rows of `ids` and the slots taken, to undo a step that must leave no trace."""
        ids = ids.to(device="cpu", dtype=torch.int64)
        self._land(ids)
        slots = self._slot[ids].clone()
        return ids, slots, self.values.index_select(0, slots[slots >= 0].long()), self.used

    def restore(self, snapshot: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]) -> None:
        """Put back what `snapshot` copied (undo in reverse order when ids repeat across snapshots): slots taken
        since are free again."""
        ids, slots, rows, used = snapshot
        self._land(None)
        self._overflow = None  # the step that overflowed is being undone
        if ids.numel():
            self._slot[ids] = slots
            self.values.index_copy_(0, slots[slots >= 0].long(), rows)
        self.used = used
