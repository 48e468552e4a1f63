"""Which rank says what every rank finds alike (a bad flag, --help), and how the others wait: a leaf every module
that reports bad input imports."""
import time

from .environment import launch

QUIET_EXIT_DELAY = 3.0  # seconds a rank other than 0 waits before saying what bad input it found


def speaks() -> bool:
    """Whether this process reports what every rank finds alike (a bad flag, --help): rank 0 alone, so a
    launcher's N processes print one line, not N copies."""
    return launch().rank == 0


def let_rank_0_speak() -> None:
    """Before a rank other than 0 reports bad input: wait, so rank 0 says it first and a launcher, seeing rank 0
    end, stops this rank meanwhile. A rank still there afterwards found what rank 0 did not (its own files)."""
    if not speaks():
        time.sleep(QUIET_EXIT_DELAY)
