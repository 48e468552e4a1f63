"""Tensors on their way to and from a process group whose backend lives on another device.

gloo moves host memory only. A stage computing on a GPU under gloo (several stages sharing one GPU, or a WAN link
where TCP is the robust choice) hands gloo a host copy of each payload and gets host buffers back: `outgoing`
copies a payload to the transport's device (into pinned memory, which the GPU copies at full speed), `landing`
allocates a receive buffer there, `arrived` moves a received buffer to where the stage computes. Where the two
devices are one (CPU under gloo, a GPU under NCCL) each is the identity, so callers stage unconditionally.
`seconds` is the time spent copying, which a step reports as its staging share.

An outgoing copy has the host wait for the work that made its tensor (gloo reads host memory), which in a schedule
is all the compute queued before the send. An arriving copy runs on a side stream: it overlaps the compute queued
before it on the copy engine, and only the compute stream waits for it (an event), not the host.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .buffers import to_device


class HostStaging:
    """Copies between the compute device and `transport` (the device the process group's tensors must live on)."""

    def __init__(self, transport: torch.device | str = "cpu") -> None:
        self.transport = torch.device(transport)
        self.seconds = 0.0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # a GPU's side stream for arriving copies

    def _pinned(self, device: torch.device) -> bool:
        return self.transport.type == "cpu" and device.type == "cuda"

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def outgoing(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the transport's device (a new tensor the caller keeps alive until the send completes)."""
        if t.device == self.transport:
            return t
        if t.device.type == "cpu":  # to a GPU transport (NCCL): through pinned memory, the host not waiting
            return to_device(t, self.transport)
        if t.device.type == "cuda":  # the copy waits for the work that makes t: that wait is compute, not staging
            torch.cuda.current_stream(t.device).synchronize()
        start = time.perf_counter()
        out = torch.empty(t.shape, dtype=t.dtype, device=self.transport, pin_memory=self._pinned(t.device))
        out.copy_(t)  # synchronous from a GPU: the bytes are in host memory before gloo reads them
        self.seconds += time.perf_counter() - start
        return out

    def landing(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A receive buffer on the transport's device for a tensor that will be used on `device`."""
        return torch.empty(numel, dtype=dtype, device=self.transport, pin_memory=self._pinned(torch.device(device)))

    def arrived(self, buf: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A received buffer on `device` (from a GPU's side stream the current one waits for: later kernels there see
        it complete)."""
        device = torch.device(device)
        if buf.device == device:
            return buf
        start = time.perf_counter()
        if not self._pinned(device):
            out = buf.to(device)
        else:
            side, compute = self._side(device), torch.cuda.current_stream(device)
            with torch.cuda.stream(side):
                out = buf.to(device, non_blocking=True)
            compute.wait_stream(side)  # later kernels on the compute stream see it complete; the host does not wait
            out.record_stream(compute)  # made on the side stream, read on the compute one
        self.seconds += time.perf_counter() - start
        return out

    def all_reduce_(self, t: torch.Tensor, group: object | None = None) -> torch.Tensor:
        """Sum `t` in place over `group`, through the transport's device."""
        moved = self.outgoing(t)
        dist.all_reduce(moved, group=group)
        if moved is not t:
            t.copy_(moved)
        return t

    def all_to_all_rows(self, row: torch.Tensor, members: int, group: object | None = None) -> torch.Tensor:
        """Every member's `row` (1-D) as one matrix, row i from the group's rank i: one all-to-all, each rank's row
        sent to every other at once, through the transport's device."""
        moved = self.outgoing(row.reshape(1, -1).expand(members, -1).contiguous())
        out = torch.empty_like(moved)
        dist.all_to_all_single(out, moved, group=group)
        return self.arrived(out, row.device)

    def take_seconds(self) -> float:
        """Seconds spent copying since the last call."""
        spent, self.seconds = self.seconds, 0.0
        return spent
