"""A lossless stage over a quantized message's bytes: the codes of a min-max quantizer are far from uniform (a
Gaussian row's 3-bit codes carry 2.48 bits of information, its 4-bit ones 3.52), so a Huffman coder takes 5-22% off
a message without touching a value. Both sides of a boundary see exactly the bytes the codec made, so they stay
bit-identical whatever the coder does.

The coder is deflate's Huffman stage (zlib, Z_HUFFMAN_ONLY: no string matching, which finds nothing in codes) over
bytes. At 2, 4 and 8 bits a byte holds whole codes, so byte statistics are the codes' own. At 3 bits codes straddle
bytes, and the packed stream repeats every 3 bytes: coding the bytes at positions 0, 1 and 2 (mod 3) as three
streams, each with its own table, keeps their statistics apart (0.87 of the raw size where one stream gets 0.95).
Which layout a message gets is read off its byte histograms, whose order-0 information estimates the coded size; a
message estimated to shrink by less than 3% travels as is, and so does one whose coded form turns out no shorter.
Either layout is three streams, coded on three threads. A boundary codes its compressing codecs' messages only
(AQ-SGD's whole float first visits among them): float rows shrink too (bfloat16's by 22%, float32's by 7%), but the
FP32 and bf16 wires are the baselines, sent as is.

A coded message is shorter than the receiver's buffer, which gloo accepts (it fills the front of a posted receive);
NCCL needs the sizes to match, so the stage runs over gloo links only (pipeline.transport.Wire). Layout:
  byte 0      0: raw, the n-byte message follows; 1: its thirds (WHOLE; below 16 KiB one stream and two empty);
              3: its bytes by position mod 3 (INTERLEAVED)
  bytes 1-8   coded: the first two streams' lengths (little-endian uint32)
  rest        coded: the three deflate streams, each decoded to the length the receiver knows from n
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

RAW, WHOLE, INTERLEAVED = 0, 1, 3
_STREAMS = 3
_HEADER = 1 + 4 * (_STREAMS - 1)  # the interleaved layout's header, the longest
_MIN_CODED = 256  # bytes below which a table costs more than it saves
_SPLIT = 1 << 14  # bytes from which the contiguous layout is cut in thirds (a third then also keeps a
# message's scales, at its front, apart from its codes: 0.86 of a 2-bit message where one stream gets 0.90)
_WORTH = 0.03  # the least share of a message the coder must be expected to save, else it travels raw
_pools: dict[int, ThreadPoolExecutor] = {}  # per process: a forked child inherits a pool whose threads it lacks


class CorruptMessage(RuntimeError):
    """A coded message that does not decode to the size its receiver expects (a raw one shorter than that is not
    caught: its length is the posted buffer's, as it is for a message sent without the stage)."""


def _pool() -> ThreadPoolExecutor:
    """Threads for the three streams (zlib releases the GIL), this process's own."""
    pid = os.getpid()
    if pid not in _pools:
        _pools[pid] = ThreadPoolExecutor(max_workers=_STREAMS, thread_name_prefix="aqpipe-entropy")
    return _pools[pid]


def capacity(nbytes: int) -> int:
    """The largest coded form of an `nbytes` message: what a receiver posts."""
    return nbytes + 1


def _deflate(data: np.ndarray) -> bytes:
    coder = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return coder.compress(np.ascontiguousarray(data)) + coder.flush()


def _inflate(data: memoryview, nbytes: int) -> tuple[bytes, int]:
    """The stream's `nbytes` decoded, and the coded bytes it took (what follows it in `data` is not its own)."""
    coder = zlib.decompressobj(-15)
    try:
        out = coder.decompress(data, nbytes + 1)  # room to read the end of the stream
    except zlib.error as e:
        raise CorruptMessage(f"an entropy-coded message of {nbytes} bytes does not decode ({e})") from None
    if len(out) != nbytes or not coder.eof:
        raise CorruptMessage(f"an entropy-coded message decoded to {len(out)} bytes, expected {nbytes}")
    return out, len(data) - len(coder.unused_data)


def _bits(histogram: np.ndarray) -> float:
    """The order-0 information of the bytes counted in `histogram`, in bits."""
    p = histogram[histogram > 0].astype(np.float64)
    n = p.sum()
    return float(-(p * np.log2(p / n)).sum())


def _layout(data: np.ndarray) -> int:
    """The layout the byte histograms favour: three streams (bytes by position mod 3) where they carry clearly less
    information than one; RAW where neither would save `_WORTH` of the message (coding it would cost time for
    nothing)."""
    parts = [np.bincount(data[k::_STREAMS], minlength=256) for k in range(_STREAMS)]
    one, three = _bits(sum(parts)), sum(_bits(h) for h in parts)
    best, layout = (three, INTERLEAVED) if three < 0.98 * one else (one, WHOLE)
    return layout if best < (1 - _WORTH) * 8 * data.size else RAW


def _bounds(n: int) -> list[int]:
    """Where the contiguous layout's streams start and end in an n-byte message: thirds, or all in the first below
    `_SPLIT` bytes, where two more tables would cost more than the threads save."""
    if n < _SPLIT:
        return [0, n, n, n]
    return [n * k // _STREAMS for k in range(_STREAMS + 1)]


def _streams(data: np.ndarray, layout: int) -> list[np.ndarray]:
    """The message's three streams: its thirds (WHOLE), or its bytes by position mod 3 (INTERLEAVED)."""
    if layout == INTERLEAVED:
        return [data[k::_STREAMS] for k in range(_STREAMS)]
    b = _bounds(data.size)
    return [data[b[k] : b[k + 1]] for k in range(_STREAMS)]


def encode(message: torch.Tensor) -> torch.Tensor:
    """`message` (1-D uint8 on the CPU) in its coded form, at most `capacity(len)` bytes."""
    data = message.numpy()
    n = data.size
    layout = _layout(data) if n >= _MIN_CODED else RAW
    if layout != RAW:
        streams = list(_pool().map(_deflate, _streams(data, layout)))
        head = np.array([len(s) for s in streams[:-1]], dtype="<u4").tobytes()
        coded = bytes([layout]) + head + b"".join(streams)
        if len(coded) <= n:
            return torch.frombuffer(bytearray(coded), dtype=torch.uint8)
    out = torch.empty(n + 1, dtype=torch.uint8)
    out[0] = RAW
    out[1:] = message
    return out


def decode(buf: torch.Tensor, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `nbytes` message whose coded form begins `buf` (a posted receive: bytes past the coded form are not
    read), written into `out` where given (1-D uint8 on the CPU: pinned memory, for a GPU's copy). CorruptMessage
    where it does not decode to exactly that many bytes."""
    return decode_sized(buf, nbytes, out)[0]


def decode_sized(buf: torch.Tensor, nbytes: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """`decode`'s message, and the bytes its coded form took on the link (a receiver knows only its posted size)."""
    out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
    if out.shape != (nbytes,) or out.dtype != torch.uint8 or out.device.type != "cpu":
        raise ValueError(f"out: expected {nbytes} uint8 bytes on the CPU, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    data = buf.numpy()
    if data.size < 1:
        raise CorruptMessage(f"an entropy-coded message of 0 bytes: expected at least 1 for {nbytes}")
    layout = int(data[0])
    if layout == RAW:
        if data.size < nbytes + 1:
            raise CorruptMessage(f"a raw message of {data.size - 1} bytes, expected {nbytes}")
        return out.copy_(buf[1 : nbytes + 1]), nbytes + 1
    if layout not in (WHOLE, INTERLEAVED) or data.size < _HEADER:
        raise CorruptMessage(f"an entropy-coded message with layout byte {layout}: expected 0, 1 or 3")
    lengths = np.frombuffer(data[1:_HEADER].tobytes(), dtype="<u4").tolist()
    starts = np.cumsum([_HEADER, *lengths]).tolist()
    targets = _streams(out.numpy(), layout)
    view = memoryview(data)
    pieces = [view[starts[k] : starts[k + 1]] if k < _STREAMS - 1 else view[starts[k] :] for k in range(_STREAMS)]
    used = 0
    for target, (part, taken) in zip(targets, _pool().map(_inflate, pieces, [t.size for t in targets])):
        target[:] = np.frombuffer(part, dtype=np.uint8)
        used = taken  # the last stream's: the others' lengths are in the header
    return out, starts[-1] + used
