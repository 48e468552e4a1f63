"""Bound how long a run outlives one of its processes: heartbeats and failure reports in the rendezvous store.

What happens without it, on gloo: a rank blocked on a peer that died gets "Connection closed
by peer" at once, but a rank blocked on a peer that is alive and itself blocked waits for the
whole collective timeout, and nobody learns which rank failed. torchrun and the deepspeed
launcher stop the other processes of their own machine, but not those of another machine,
and a plain or by-hand launch stops nothing.

So every rank runs a thread that, once per `interval`, bumps its own counter in the store
the launcher already runs (MASTER_ADDR:MASTER_PORT) and reads everyone's. A rank whose
counter has not moved for `peer_timeout` seconds is dead; a rank that fails in Python first
writes what failed. Either way every other rank prints one line naming the rank, its stage
and replica, and exits with status 1 within about `peer_timeout + interval` seconds; a rank
whose own receive already failed (gloo: "Connection closed by peer") needs only a few
missed beats, not the whole `peer_timeout`, to name the dead one. If the
store itself goes away (under deepspeed or a plain launch it lives in rank 0's process), that
names rank 0. A rank that is alive but stuck keeps its heartbeat; the collective timeout
(`dist_timeout`) ends its peers' waits, and their failure reports then end it too.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist

from . import interrupts

_RELAYED = "stopped because "  # a report that passes on what another rank found
_BAD_INPUT = "bad input: "  # a report of bad input: the rank that found it said so; the others exit quietly, status 2


class Watchdog:
    def __init__(self, rank: int, world_size: int, describe: Callable[[int], str], prog: str, *,
                 prefix: str, peer_timeout: float, interval: float = 1.0, host: str | None = None,
                 port: int | None = None) -> None:
        """`prefix`: the keys of this launch's round (launch_round.py), which every rank agreed on: never derived
        here from TORCHELASTIC_RESTART_COUNT, which counts each machine's own restarts, so two machines of one
        round could watch under different keys, or read an earlier round's beats and failures."""
        self.rank, self.world_size, self.describe, self.prog = rank, world_size, describe, prog
        self.peer_timeout, self.interval = peer_timeout, interval
        self.host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(port or os.environ.get("MASTER_PORT", "29500"))
        self.prefix = prefix
        self.store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(2.0, 2 * interval)))
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.suspicious = False  # set after a communication error: a few missed beats then mean dead
        self.barriers = 0  # barriers passed: every rank passes the same ones in the same order
        self.thread = threading.Thread(target=self._loop, name="aqpipe-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._op(lambda s: s.add(self._key("beat", self.rank), 1))
        self.thread.start()
        return self

    def _key(self, kind: str, rank: int | None = None) -> str:
        return self.prefix + kind + ("" if rank is None else f"/{rank}")

    def _op(self, fn: Callable) -> object:
        with self.lock:
            return fn(self.store)

    # ------------------------------------------------------------------ main thread
    def report(self, message: str, bad_input: bool = False) -> None:
        """This rank failed: tell the others what, so they stop at once and say why (with `bad_input`, this rank
        has said it in one line already: the others stop without repeating it)."""
        message = (_BAD_INPUT if bad_input else "") + message
        try:
            self._op(lambda s: (s.set(self._key("failed", self.rank), message), s.add(self._key("failures"), 1)))
        except Exception:  # the store is gone too: the others find out from the missing heartbeat
            pass

    def linger(self) -> None:
        """After `report`: stay until every other rank has read it (each reports back as it stops), or a few beats.
        Rank 0's process may hold the store (deepspeed, plain launches): leaving at once would leave the others to
        find a dead store instead of the report."""
        try:
            self._wait_briefly(lambda s: int(s.add(self._key("failures"), 0)) >= self.world_size)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read it
            pass

    def _reports(self) -> Iterator[tuple[str, str]]:
        """(message, the failure it names) of each other rank that reported one: a survivor's relayed news names
        the rank it names, bad input stands as it is said, anything else names its rank."""
        for r in range(self.world_size):
            key = self._key("failed", r)
            if r != self.rank and self._op(lambda s: s.check([key])):
                message = self._op(lambda s: s.get(key)).decode(errors="replace")
                if message.startswith(_RELAYED):
                    yield message, message[len(_RELAYED):]
                elif message.startswith(_BAD_INPUT):
                    yield message, message
                else:
                    yield message, f"rank {r} ({self.describe(r)}) failed: {message}"

    def peer_failure(self) -> str | None:
        """What another rank reported, where it failed for a reason of its own (not an interruption)."""
        try:
            return next((culprit for message, culprit in self._reports()
                         if not message.removeprefix(_RELAYED).endswith("interrupted")), None)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to read
            return None

    def leave(self) -> None:
        """After reporting an interruption every rank had: rank 0's process may hold the store, so it leaves last.
        The others stop their heartbeat and mark that they are gone; rank 0 waits for their marks (a few beats at
        most), so no rank's last store call finds the store gone (torch would print a stack for it)."""
        self.stopped.set()
        try:
            if self.rank == 0:
                others = [self._key("left", r) for r in range(self.world_size) if r != 0]
                self._wait_briefly(lambda s: s.check(others))
            else:
                self._op(lambda s: s.set(self._key("left", self.rank), "1"))
        except Exception:  # noqa: BLE001 - the store is gone already
            pass

    def stop(self) -> None:
        """A clean finish: this rank's heartbeat stops without anyone taking it for dead. Rank 0 leaves last (a few
        beats at most): under deepspeed or a plain launch its process holds the store, and the others' last words
        to it must not find it gone."""
        try:
            self._op(lambda s: s.set(self._key("done", self.rank), "1"))
            others = [self._key("done", r) for r in range(self.world_size) if r != self.rank]
            if self.rank == 0 and others:
                self._wait_briefly(lambda s: s.check(others))
        except Exception:
            pass
        self.stopped.set()
        self.thread.join(timeout=2 * self.interval + 1)

    def _wait_briefly(self, done: Callable[[dist.Store], bool]) -> None:
        """Poll the store until `done(store)`, a few beats at most (for the others' last words)."""
        deadline = time.monotonic() + 3 * self.interval + 1
        while time.monotonic() < deadline and not self._op(done):
            time.sleep(0.05)

    def barrier(self, poll: float = 0.05) -> None:
        """Wait until every rank has arrived, for as long as that takes: set-up work (tokenizing a large
        corpus, downloading a model) has no deadline while the ranks doing it live. A rank that dies or fails
        meanwhile ends the wait from the thread, naming it, as anywhere else in the run; a collective
        barrier would instead give up after the collective timeout and blame the network."""
        self.barriers += 1
        key = self._key("barrier", self.barriers)
        arrived = int(self._op(lambda s: s.add(key, 1)))
        while arrived < self.world_size:
            time.sleep(poll)
            poll = min(2 * poll, 0.5)
            arrived = int(self._op(lambda s: s.add(key, 0)))

    def wait_for_verdict(self) -> None:
        """After a communication error: give the thread time to name the rank that failed (it exits then)."""
        self.suspicious = True  # stale beats now count after 3.5 intervals; the store's loss after 2
        self.thread.join(timeout=min(self.peer_timeout, 3.5 * self.interval) + 2 * self.interval + 1)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        last_seen = {r: (0, time.monotonic()) for r in range(self.world_size) if r != self.rank}
        store_down_since = None
        while not self.stopped.wait(self.interval):
            try:
                culprit = self._check(last_seen)
                store_down_since = None
            except Exception as exc:  # noqa: BLE001 - any store failure counts
                now = time.monotonic()
                store_down_since = store_down_since or now
                if now - store_down_since < 2 * self.interval:
                    continue
                culprit = (f"rank 0 ({self.describe(0)}) is unreachable: the rendezvous store at "
                           f"{self.host}:{self.port} stopped answering ({type(exc).__name__}: {exc})")
            if culprit and not self.stopped.is_set():
                self.exit_for(culprit)

    def _check(self, last_seen: dict[int, tuple[int, float]]) -> str | None:
        self._op(lambda s: s.add(self._key("beat", self.rank), 1))
        if int(self._op(lambda s: s.add(self._key("failures"), 0))):
            for _, culprit in self._reports():
                return culprit
        now = time.monotonic()
        limit = min(self.peer_timeout, 3.5 * self.interval) if self.suspicious else self.peer_timeout
        for r, (count, since) in last_seen.items():
            beat = int(self._op(lambda s: s.add(self._key("beat", r), 0)))
            if beat != count:
                last_seen[r] = (beat, now)
            elif now - since > limit and not self._op(lambda s: s.check([self._key("done", r)])):
                return (f"rank {r} ({self.describe(r)}) stopped responding: no heartbeat for "
                        f"{now - since:.0f} s (peer_timeout={self.peer_timeout:g}); its process died or hangs")
        return None

    def exit_for(self, culprit: str) -> None:
        """End this process because of `culprit` (another rank's failure), saying so unless it was bad input."""
        # Ctrl-C reached this rank too (its main thread may be blocked); a launcher's SIGTERM after a real failure
        # elsewhere is not an interruption: that failure is named below
        if interrupts.came() == "SIGINT" or (interrupts.came() and culprit.endswith("failed: interrupted")):
            self.report("interrupted")
            interrupts.say_once(interrupts.line(self.prog, f"rank {self.rank} ({self.describe(self.rank)})"))
            self.leave()
            os._exit(130)
        self.report(_RELAYED + culprit)  # ranks not yet aware learn it at their next beat
        if culprit.startswith(_BAD_INPUT):
            sys.stdout.flush()
            os._exit(2)
        print(f"{self.prog}: error: rank {self.rank} ({self.describe(self.rank)}) stopping: {culprit}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # the main thread may be blocked in a collective that never returns
