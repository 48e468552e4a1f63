"""aqpipe's trainer: configuration, data, checkpoints, failure handling and the training loop.

The three libraries it drives sit beside it: `pipeline` (stages, schedules, the engine),
`compression` (the boundary codecs) and `data_parallel` (replica sync). The launchable
scripts in the checkout's `recipes/` are thin wrappers around this package.
"""
import os as _os


def speaks() -> bool:
    """Whether this process reports what every rank finds alike (a bad flag, --help): rank 0 alone, so a
    launcher's N processes print one line, not N copies."""
    return _os.environ.get("RANK", "0") == "0"
