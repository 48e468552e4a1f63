"""Tensors sent to another rank over the process group, in chunks, with no deadline: a stage's weights crossing
a slow link to the machine that writes the merged model may take minutes, longer than any collective's timeout.
A peer that dies is the watchdog's to find (watchdog.py), not a timeout's.

    send_tensors({"lm_head.weight": w, ...}, dst=0, device=device)     # on the stage's rank
    tensors = recv_tensors(src=1, device=device)                       # on rank 0

A header (names, dtypes, shapes, as JSON: data, never code) goes first, then each tensor's bytes in chunks of
`CHUNK` bytes.
"""
from __future__ import annotations

import json
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

CHUNK = 1 << 22  # 4 MiB: a few seconds on a 10 Mbit/s link
NO_DEADLINE = timedelta(days=1)


def _chunks(flat: torch.Tensor) -> Iterator[torch.Tensor]:
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start:start + CHUNK]


def _send(buf: torch.Tensor, dst: int, device: torch.device) -> None:
    dist.isend(buf.to(device), dst).wait(NO_DEADLINE)


def _recv(buf: torch.Tensor, src: int, device: torch.device) -> torch.Tensor:
    landing = buf.to(device)
    dist.irecv(landing, src).wait(NO_DEADLINE)
    return landing.cpu()


def send_tensors(tensors: dict[str, torch.Tensor], dst: int, device: torch.device) -> int:
    """Send `tensors` to rank `dst` (which calls `recv_tensors`); returns the bytes sent."""
    header = json.dumps([(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                         for name, t in tensors.items()]).encode()
    _send(torch.tensor([len(header)], dtype=torch.int64), dst, device)
    _send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, device)
    sent = 0
    for t in tensors.values():
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        for chunk in _chunks(flat):
            _send(chunk, dst, device)
        sent += flat.numel()
    return sent


def recv_tensors(src: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors rank `src` sends with `send_tensors`, on the CPU."""
    size = _recv(torch.zeros(1, dtype=torch.int64), src, device)
    header = json.loads(_recv(torch.zeros(int(size), dtype=torch.uint8), src, device).numpy().tobytes())
    out = {}
    for name, dtype, shape in header:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        flat = t.reshape(-1).view(torch.uint8)
        for chunk in _chunks(flat):
            chunk.copy_(_recv(torch.empty_like(chunk), src, device))
        out[name] = t
    return out
