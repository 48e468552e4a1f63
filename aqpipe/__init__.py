"""aqpipe's trainer: configuration, data, checkpoints, failure handling and the training loop.

The three libraries it drives sit beside it: `pipeline` (stages, schedules, the engine),
`compression` (the boundary codecs) and `data_parallel` (replica sync). The launchable
scripts in the checkout's `recipes/` are thin wrappers around this package; `aqpipe.finetune(...)` runs a job
from a user's script (api.py).
"""
import time as _time

from .environment import launch as _launch

QUIET_EXIT_DELAY = 3.0  # seconds a rank other than 0 waits before saying what bad input it found


def speaks() -> bool:
    """Whether this process reports what every rank finds alike (a bad flag, --help): rank 0 alone, so a
    launcher's N processes print one line, not N copies."""
    return _launch().rank == 0


def let_rank_0_speak() -> None:
    """Before a rank other than 0 reports bad input: wait, so rank 0 says it first and a launcher, seeing rank 0
    end, stops this rank meanwhile. A rank still there afterwards found what rank 0 did not (its own files)."""
    if not speaks():
        _time.sleep(QUIET_EXIT_DELAY)


def __getattr__(name: str):  # noqa: ANN202 - `aqpipe.finetune` loads torch only when asked for
    if name == "finetune":
        from .api import finetune

        return finetune
    raise AttributeError(f"module 'aqpipe' has no attribute {name!r}")
