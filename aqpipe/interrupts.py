"""Ctrl-C (SIGINT to the launcher's process group) and a launcher's SIGTERM, as one interruption that every rank
says in one line and ends with status 130; or, with `--save_on_signal` (the default), SIGTERM and SIGUSR1 as a spot
warning: the run saves the step in flight and stops (`save_asked`, `SavedOnSignal`).

A rank blocked in a collective runs no Python signal handler until the call returns, which may be never (its peer
lingers to leave its last word in the store) or only once the peer's connection closes, and the handler would then
raise inside the failure handling (a traceback). So the signal is known at once, from any thread, through
`signal.set_wakeup_fd` (written by the C handler when the signal lands) read by a small thread; the handler raises
KeyboardInterrupt only into training, once, never into the handling of another failure; and the first of the
main thread and the watchdog to say so says it (`say_once`).
"""
from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAVE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a cloud's spot warning, SLURM's --signal: save, then stop
_state: dict[str, Any] = {"signal": None, "handling": False, "raised": False, "active": False, "insisting": False,
                          "save": None, "saving": (), "granted": False, "saved": False, "grace": 25.0, "who": ""}


class SavedOnSignal(Exception):
    """The run saved the step in flight on a spot warning and stops (every rank alike)."""

    def __init__(self, signame: str, step: int, where: str, grace: float) -> None:
        super().__init__(f"{signame}: the step in flight, step {step}, saved in {where} within the {grace:g} s a save "
                         "on a signal may take (--signal_grace)")
        self.signame, self.step, self.where = signame, step, where

    @property
    def status(self) -> int:
        """143 after SIGTERM (what a process it ends reports), 0 after SIGUSR1 (a request to save and stop)."""
        return 128 + signal.SIGTERM if self.signame == "SIGTERM" else 0
_said = threading.Lock()


def _on_signal(signum: int, frame: Any) -> None:
    if signum in _state["saving"]:  # saved at the end of the step in flight (train.py): nothing raised
        _state["save"] = _state["save"] or signum
        return
    _state["signal"] = _state["signal"] or signum
    # raised once, and never into the handling of another failure (a peer's closed connection it caused)
    if not _state["raised"] and not _state["handling"] and sys.exc_info()[0] is None:
        _state["raised"] = True
        raise KeyboardInterrupt


def _listen(fd: int) -> None:
    """The wakeup fd's bytes: each is a signal's number, written the moment it landed. Closes `fd` at the pipe's
    end (the write end closed), so its number is never read after another file took it."""
    try:
        while data := os.read(fd, 64):
            for signum in data:
                if signum in _state["saving"]:
                    if _state["save"] is None or not _state["granted"]:
                        _state["save"] = _state["save"] or signum
                        _grant()
                    continue
                if signum not in SIGNALS:
                    continue
                _state["signal"] = _state["signal"] or signum
                if not _state["insisting"]:  # one thread, however many signals (its own re-raises among them)
                    _state["insisting"] = True
                    threading.Thread(target=_insist, name="aqpipe-interrupt", daemon=True).start()
    except OSError:
        pass
    finally:
        os.close(fd)


def _grant() -> None:
    """The first save signal: stop the run without the save if that takes more than the grace period (a launcher
    kills its workers soon after; the last checkpoint continues the run), unless the run is handling a failure by
    then (a launcher's SIGTERM to the survivors of a peer's failure: that failure is what they say)."""
    _state["granted"] = True
    name, grace, who = signal.Signals(_state["save"]).name, _state["grace"], _state["who"]

    def expire() -> None:
        time.sleep(grace)
        if _state["active"] and not _state["saved"] and not _state["handling"]:
            say(f"{who}: the save on {name} took more than {grace:g} s (--signal_grace): stopping without it; the "
                "last checkpoint written continues the run with --resume")
            os._exit(128 + signal.SIGTERM)

    threading.Thread(target=expire, name="aqpipe-grace", daemon=True).start()


def say(line: str) -> None:
    """One line on stderr, in one write."""
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def stop_after_save(step: int, where: Any) -> None:
    """The save a signal asked for is written (the grace period no longer ends the run): stop, every rank alike."""
    _state["saved"] = True
    raise SavedOnSignal(save_asked() or "a peer's signal", step, str(where), _state["grace"])


def _insist() -> None:
    """A signal the handler could not raise (it landed while the main thread handled another exception) is
    raised again until it is, or until the run handles its failure."""
    while True:
        time.sleep(0.5)
        if _state["raised"] or _state["handling"] or not _state["active"]:
            return
        _thread.interrupt_main(signal.SIGINT)


@contextmanager
def caught(save_on_signal: bool = False, grace: float = 25.0, who: str = "aqpipe") -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (the main thread only), once, and are known to
    every thread at once (`came`); with `save_on_signal`, SIGTERM and SIGUSR1 raise nothing and are asked for by
    `save_asked` instead (the run saves the step in flight and stops, within `grace` seconds, `who` saying so in
    a line). The handlers before it are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (*SIGNALS, signal.SIGUSR1) if save_on_signal else SIGNALS
    before = {sig: signal.getsignal(sig) for sig in handled}
    _state.update(signal=None, handling=False, raised=False, active=True, insisting=False, save=None,
                  saving=SAVE_SIGNALS if save_on_signal else (), granted=False, saved=False, grace=grace, who=who)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_listen, args=(read_fd,), name="aqpipe-signals", daemon=True).start()
    for sig in handled:
        signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        _state["active"] = False
        signal.set_wakeup_fd(old_fd)
        os.close(write_fd)  # the listener reads the pipe's end, closes its side and stops


def save_asked() -> str | None:
    """The name of the signal that asked the run to save and stop (None: none came)."""
    return None if _state["save"] is None else signal.Signals(_state["save"]).name


def came() -> str | None:
    """The signal's name if one came (any thread may ask; nothing changes)."""
    return None if _state["signal"] is None else signal.Signals(_state["signal"]).name


def received(settle_s: float = 0.05) -> str | None:
    """From a failure's handling on: the signal's name if one came (waiting `settle_s` for the listener to hear
    one that landed with the failure), else None. Later signals are recorded, not raised."""
    _state["handling"] = True
    if came() is None and settle_s > 0:
        time.sleep(settle_s)
    return came()


def line(prog: str, who: str | None = None) -> str:
    """What an interrupted process says: `who` (a rank and its stage) and the signal, where there are several."""
    about = f"{who} interrupted ({came() or 'SIGINT'})" if who else "interrupted"
    return f"{prog}: error: {about}; a checkpoint it wrote earlier continues the run with --resume"


def say_once(line: str) -> bool:
    """Write `line` to stderr in one write, if no thread of this process said its interruption yet."""
    if not _said.acquire(blocking=False):
        return False
    say(line)
    return True
