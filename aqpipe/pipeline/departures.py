"""Sends posted by a thread of their own, once their bytes are in host memory: a GPU stage's messages over gloo.

gloo reads a payload from host memory when the send is posted, so a message a GPU computes must be copied out
first, and that copy must wait for the compute queued before it. Waiting on the main thread stalls the queue that
feeds the GPU at every send (a host sync per message). Here the main thread only queues the copy into pinned memory
and an event after it; one worker thread, in the order the sends were made, waits for each event, entropy-codes
the bytes where the wire codes, and posts the send. A send made while any waits here goes through it too, so
messages to a peer keep their order (a probe's, with nothing queued, leaves at once: `idle`). What each send put
on the link is counted when `drain` collects it.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

POLL_S = 0.0002  # how often the worker asks whether a copy is done (an event's query never syncs; its wait might)


def copied_out(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """`t` copied into pinned host memory behind the work queued on its stream, and an event set once the copy is
    done (None for a host tensor: nothing to wait for). The host does not wait."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(t.device))
    return host, ready


def _wait(ready: Any) -> None:
    while ready is not None and not ready.query():
        time.sleep(POLL_S)


class Departures:
    """A FIFO of sends on one worker thread: `post` returns at once; `drain` waits until every send posted so far
    has gone and returns [(counter, bytes on the link)]. `device`: the stage's, made the worker's current device
    (so that nothing the worker asks of CUDA opens a context on another GPU)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current one, read here, not in the thread
            device = torch.device("cuda", torch.cuda.current_device())
        start = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aqpipe-departures", initializer=start)
        self._queued: list[Future] = []

    def post(self, payload: torch.Tensor, ready: Any, dst: int, *, tag: int, group: object | None,
             encode: Callable[[torch.Tensor], torch.Tensor] | None, counter: str | None) -> None:
        """Send `payload` (host memory, complete once `ready` is) to `dst`, through `encode` where given."""

        def depart() -> tuple[Any, torch.Tensor, str | None]:
            _wait(ready)
            data = encode(payload) if encode is not None else payload
            return dist.isend(data, dst, group=group, tag=tag), data, counter

        self._queued.append(self._worker.submit(depart))

    def idle(self) -> bool:
        """Whether every send posted so far is on the link already (so one made now, not through here, follows them)."""
        return all(future.done() for future in self._queued)

    def drain(self) -> list[tuple[str | None, int]]:
        """Every queued send posted and complete; what each put on the link. A send's error is raised here, the
        first one, once every other send has been waited for (none is left in flight with its buffer)."""
        queued, self._queued = self._queued, []
        sent: list[tuple[str | None, int]] = []
        error: BaseException | None = None
        for future in queued:
            try:
                work, data, counter = future.result()
                work.wait()
                sent.append((counter, data.numel()))
            except Exception as failed:  # noqa: BLE001 - raised below, after the rest
                error = error or failed
        if error is not None:
            raise error
        return sent


__all__ = ["Departures", "copied_out"]
