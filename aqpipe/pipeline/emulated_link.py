"""A slow link emulated in user space, where network namespaces cannot shape one (a GPU host; the trainer's
`AQPIPE_LINK_MBIT` and `AQPIPE_LINK_LATENCY_MS`, or `AQPIPE_LINK_MATRIX` for a link of its own between every pair).

The receiving side holds each message back until a link of `mbit` would have delivered it: a message from a peer
starts crossing when its bytes landed here (the real transfer, on one machine, takes next to nothing) or when the
previous message from that peer finished crossing, whichever is later, takes its size over the rate, then the
one-way latency. Its receiver's compute goes on meanwhile: a message waited for after it was due costs nothing
more. When a message landed is taken by a thread of its own that waits on the receive from the moment it is posted
(gloo reports a receive complete only to a wait; NCCL's is polled, its wait does not block the host). The size is
the bytes on the link: an entropy-coded message's coded length. Without a rate, the latency alone is added to every
receive, as before this module: an upper bound on a real link's cost (a message already buffered when its receive
was posted pays it too). Under a matrix (`LinkMatrix`) each pair of ranks has its own rate and latency, and the
collectives (the data-parallel algorithms', the step's tables) are paced too; under one rate they are not delayed.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

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


KINDS = ("ring", "gather", "alltoall", "peers")  # the collectives' shapes, priced alike by the emulator and the plan


def collective_seconds(seconds: Callable[[int, int, float], float], ranks: list[int], nbytes: float, kind: str,
                       me: int | None = None) -> float:
    """What a collective of `nbytes` a member over global `ranks` takes on links whose one-way message time is
    `seconds(src, dst, nbytes)`, the ring in global-rank order as gloo runs it: "ring" (an allreduce: 2 (k-1) hops of
    nbytes / k), "gather" (an allgather: k-1 hops of nbytes), each hop as long as the ring's slowest link;
    "alltoall" (a reduce-scatter and an allgather of pieces, as `Comm.quantized_mean` sends them: two rounds of
    every pair's nbytes / k, each as long as its slowest pair); "peers" (`me` exchanging nbytes with each of the
    others, as long as the slowest way; without `me`, each with its ring neighbours). The plan's cost model and the
    emulator's pace both read it."""
    ranks = sorted(ranks)
    k = len(ranks)
    if k < 2:
        return 0.0
    if kind == "peers":
        pairs = [(me, p) for p in ranks if p != me] if me is not None else \
            [(ranks[i], ranks[(i + 1) % k]) for i in range(k)]
        return max(max(seconds(a, b, nbytes), seconds(b, a, nbytes)) for a, b in pairs)
    if kind == "alltoall":
        return 2 * max(seconds(a, b, nbytes / k) for a in ranks for b in ranks if a != b)
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: expected one of {', '.join(KINDS)}")
    share, hops = (nbytes / k, 2 * (k - 1)) if kind == "ring" else (nbytes, k - 1)
    return hops * max(seconds(ranks[i], ranks[(i + 1) % k], share) for i in range(k))


class LinkMatrix:
    """Every pair of ranks' emulated link (AQPIPE_LINK_MATRIX: a cluster file's links, aqpipe/plan/cluster.py), as
    rank `me` sees them: `latency[i][j]` seconds and `rate[i][j]` bytes a second from rank i to rank j. Besides
    each boundary's messages (`EmulatedLink`), it paces the collectives (`pace`): the data-parallel algorithms' and
    the step's job-wide tables, which a uniform rate left undelayed."""

    def __init__(self, me: int, latency: list[list[float]] | tuple, rate: list[list[float]] | tuple) -> None:
        self.me, self.latency, self.rate = me, latency, rate
        # every rate infinite: another layer (tc on network namespaces) shapes the bytes, this one adds the latency
        self.latency_only = all(math.isinf(r) for i, row in enumerate(rate) for j, r in enumerate(row) if i != j)

    def toward_me(self, src: int) -> tuple[float, float]:
        """(latency s, rate Mbit/s) of the link from `src` to this rank."""
        return self.latency[src][self.me], self.rate[src][self.me] * 8 / 1e6

    def seconds(self, src: int, dst: int, nbytes: float) -> float:
        return nbytes / self.rate[src][dst] + self.latency[src][dst] if src != dst else 0.0

    def collective_seconds(self, ranks: list[int], nbytes: float, kind: str) -> float:
        """What a collective of `nbytes` a member over `ranks` takes on these links, as this rank sees it
        (`collective_seconds`)."""
        return collective_seconds(self.seconds, ranks, nbytes, kind, self.me)

    def pace(self, started: float, ranks: list[int], nbytes: float, kind: str) -> None:
        """Wait until a collective begun at `started` (time.monotonic) has taken what these links would take; with
        latency only, its latencies after what the shaped links took."""
        since = time.monotonic() if self.latency_only else started
        hold = since + self.collective_seconds(ranks, nbytes, kind) - time.monotonic()
        if hold > 0:
            time.sleep(hold)


class EmulatedLink:
    """Per peer: when its link is next free. One rate and latency for every peer, or each its own (`matrix`)."""

    def __init__(self, latency_s: float = 0.0, mbit: float | None = None, matrix: LinkMatrix | None = None) -> None:
        if not latency_s >= 0:
            raise ValueError(f"link latency {latency_s!r} s: expected >= 0")
        if mbit is not None and not mbit > 0:
            raise ValueError(f"link rate {mbit!r} Mbit/s: expected > 0")
        self.latency_s, self.mbit, self.matrix = latency_s, mbit, matrix
        self._free_at: dict[int, float] = {}  # peer -> when its link has carried every message so far

    def watch(self, work: Any, blocking: bool) -> Landing | None:
        """A posted receive's landing to be taken (None without a rate: only the latency is added). `blocking`: the
        receive completes only by being waited on (gloo's)."""
        return Landing(work, blocking) if self.mbit is not None or self.matrix is not None else None

    def hold(self, peer: int, nbytes: int, landed_at: float | None, now: float) -> float:
        """Seconds to hold back a message of `nbytes` from `peer` whose bytes landed at `landed_at` (None: unknown,
        taken as `now`), found landed at `now` (before it is decoded: decoding counts after the delivery)."""
        latency_s, mbit = self.matrix.toward_me(peer) if self.matrix is not None else (self.latency_s, self.mbit)
        if mbit is None:
            return latency_s
        start = max(now if landed_at is None else landed_at, self._free_at.get(peer, 0.0))
        self._free_at[peer] = start + nbytes * 8 / (mbit * 1e6)
        return self._free_at[peer] + latency_s - now
