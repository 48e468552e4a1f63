"""aqpipe.pipeline: HF models split into stages, schedules as data, codec-compressed transport, the engine.

The partitioner and the HF stage classes import transformers (about 6 s of CPU); they load on first
use, so a process that only runs the engine (every stage process of a test, a custom model) starts
in the time torch takes.
"""
from __future__ import annotations

import importlib
from typing import Any

from .compression_config import BUFFER_DTYPES, CompressionConfig
from .engine_settings import EngineSettings
from .engine import PipelineEngine, StepCounters, StepMetrics, followed_parameters, owned_parameters
from .step_run import LOSS_AVERAGES
from .schedule import SCHEDULES, Action, gpipe, in_flight, one_f_one_b, simulate, train_schedule
from .ties import TIE_MODES, Tie
from .topology import Grid, Groups, build_groups

_LAZY = {"merge_into": ".partitioning", "partition": ".partitioning", "tie_groups": ".partitioning",
         "PipelineStage": ".stages", "StageOutput": ".stages"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUFFER_DTYPES", "LOSS_AVERAGES", "SCHEDULES", "TIE_MODES", "Action", "CompressionConfig", "EngineSettings",
    "Grid", "Groups",
    "PipelineEngine",
    "PipelineStage", "StageOutput", "StepCounters", "StepMetrics", "Tie", "build_groups", "followed_parameters",
    "gpipe", "in_flight", "merge_into",
    "one_f_one_b", "owned_parameters", "partition", "simulate", "tie_groups", "train_schedule",
]
