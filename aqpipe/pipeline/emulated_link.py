"""A slow link emulated in user space, where network namespaces cannot shape one (a GPU host; the trainer's
`AQPIPE_LINK_MBIT` and `AQPIPE_LINK_LATENCY_MS`).

The receiving side holds each message back until a link of `mbit` would have delivered it: a message from a peer
starts crossing when its bytes landed here (the real transfer, on one machine, takes next to nothing) or when the
previous message from that peer finished crossing, whichever is later, takes its size over the rate, then the
one-way latency. Its receiver's compute goes on meanwhile: a message waited for after it was due costs nothing
more. When a message landed is seen at the wire's next call (`stamp`), so an emulated transfer starts at most one
action late. The size is the bytes on the link: an entropy-coded message's coded length. Data-parallel collectives
are not delayed. Without a rate, the latency alone is added to every receive, as before this module: an upper bound
on a real link's cost (a message already buffered when its receive was posted pays it too).
"""
from __future__ import annotations

import time
from typing import Any


class EmulatedLink:
    """Per peer: when its link is next free, and the receives whose landing is not seen yet."""

    def __init__(self, latency_s: float = 0.0, mbit: float | None = None) -> None:
        if not latency_s >= 0:
            raise ValueError(f"link latency {latency_s!r} s: expected >= 0")
        if mbit is not None and not mbit > 0:
            raise ValueError(f"link rate {mbit!r} Mbit/s: expected > 0")
        self.latency_s, self.mbit = latency_s, mbit
        self._free_at: dict[int, float] = {}  # peer -> when its link has carried every message so far
        self._open: list[Any] = []  # posted receives (with `work` and `landed_at`) not yet seen complete

    def watch(self, incoming: Any) -> None:
        """Note a posted receive, to stamp when its bytes land."""
        if self.mbit is not None:
            self._open.append(incoming)

    def stamp(self) -> None:
        """Stamp every watched receive whose bytes have landed with the time now."""
        if not self._open:
            return
        now, still = time.monotonic(), []
        for incoming in self._open:
            if incoming.work.is_completed():
                incoming.landed_at = now
            else:
                still.append(incoming)
        self._open = still

    def hold(self, peer: int, nbytes: int, landed_at: float | None, now: float) -> float:
        """Seconds to hold back a message of `nbytes` from `peer`, whose bytes landed at `landed_at` (None: not
        seen before `now`), that is now decoded and ready."""
        if self.mbit is None:
            return self.latency_s
        start = max(now if landed_at is None else landed_at, self._free_at.get(peer, 0.0))
        self._free_at[peer] = start + nbytes * 8 / (self.mbit * 1e6)
        return self._free_at[peer] + self.latency_s - now
