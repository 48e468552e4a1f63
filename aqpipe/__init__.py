"""aqpipe's trainer: configuration, data, checkpoints, failure handling and the training loop.

The three libraries it drives are its subpackages: `aqpipe.pipeline` (stages, schedules, the engine),
`aqpipe.compression` (the boundary codecs) and `aqpipe.data_parallel` (replica sync), each importing only the ones
before it in that order's reverse (compression <- data_parallel <- pipeline) and none of the trainer. The launchable
scripts in the checkout's `recipes/` are thin wrappers around this package; `aqpipe.finetune(...)` runs a job
from a user's script (api.py).
"""
from .speech import QUIET_EXIT_DELAY, let_rank_0_speak, speaks  # noqa: F401 - the package's own names


def __getattr__(name: str):  # noqa: ANN202 - `aqpipe.finetune` loads torch only when asked for
    if name == "finetune":
        from .api import finetune  # deferred: `import aqpipe` (the launcher, --help) starts without torch

        return finetune
    raise AttributeError(f"module 'aqpipe' has no attribute {name!r}")
