"""A slow link emulated in user space, where network namespaces cannot shape one (a GPU host; the trainer's
`AQPIPE_LINK_MBIT` and `AQPIPE_LINK_LATENCY_MS`).

The receiving side holds each message back until a link of `mbit` would have delivered it: a message from a peer
starts crossing when its bytes landed here (the real transfer, on one machine, takes next to nothing) or when the
previous message from that peer finished crossing, whichever is later, takes its size over the rate, then the
one-way latency. Its receiver's compute goes on meanwhile: a message waited for after it was due costs nothing
more. When a message landed is taken by a thread of its own that waits on the receive from the moment it is posted
(gloo reports a receive complete only to a wait; NCCL's is polled, its wait does not block the host). The size is the
bytes on the link: an entropy-coded message's coded length. Data-parallel collectives are not delayed. Without a
rate, the latency alone is added to every receive, as before this module: an upper bound on a real link's cost (a
message already buffered when its receive was posted pays it too).
"""
from __future__ import annotations

import threading
import time
from typing import Any

POLL_S = 0.0005  # how often a receive that cannot be waited on from another thread (NCCL's) is asked


class Landing:
    """When a posted receive's bytes landed, taken by a thread that watches it from when it is posted: gloo's by
    waiting on it (`blocking`; its receiver then waits on this instead: a gloo receive waited on twice never returns),
    NCCL's by polling (its receiver still waits on it, which orders its stream after the message)."""

    def __init__(self, work: Any, blocking: bool) -> None:
        self.blocking = blocking
        self.at: float | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(work,), daemon=True, name="aqpipe-landing").start()

    def _watch(self, work: Any) -> None:
        try:
            if self.blocking:
                work.wait()
            else:
                while not work.is_completed():
                    time.sleep(POLL_S)
            self.at = time.monotonic()
        except BaseException as exc:  # noqa: BLE001  raised again where the receiver waits
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> float:
        """The landing time; the receive's own error where it failed (a peer gone, a timeout)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.at


class EmulatedLink:
    """Per peer: when its link is next free."""

    def __init__(self, latency_s: float = 0.0, mbit: float | None = None) -> None:
        if not latency_s >= 0:
            raise ValueError(f"link latency {latency_s!r} s: expected >= 0")
        if mbit is not None and not mbit > 0:
            raise ValueError(f"link rate {mbit!r} Mbit/s: expected > 0")
        self.latency_s, self.mbit = latency_s, mbit
        self._free_at: dict[int, float] = {}  # peer -> when its link has carried every message so far

    def watch(self, work: Any, blocking: bool) -> Landing | None:
        """A posted receive's landing to be taken (None without a rate: only the latency is added). `blocking`: the
        receive completes only by being waited on (gloo's)."""
        return Landing(work, blocking) if self.mbit is not None else None

    def hold(self, peer: int, nbytes: int, landed_at: float | None, now: float) -> float:
        """Seconds to hold back a message of `nbytes` from `peer` whose bytes landed at `landed_at` (None: unknown,
        taken as `now`), found landed at `now` (before it is decoded: decoding counts after the delivery)."""
        if self.mbit is None:
            return self.latency_s
        start = max(now if landed_at is None else landed_at, self._free_at.get(peer, 0.0))
        self._free_at[peer] = start + nbytes * 8 / (self.mbit * 1e6)
        return self._free_at[peer] + self.latency_s - now
