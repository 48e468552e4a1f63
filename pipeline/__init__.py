"""aqpipe.pipeline: HF models split into stages, schedules as data, codec-compressed transport, the engine."""
from .engine import CompressionConfig, PipelineEngine, StepCounters
from .schedule import SCHEDULES, Action, gpipe, in_flight, one_f_one_b, simulate, train_schedule
from .topology import Grid, Groups, build_groups

__all__ = [
    "SCHEDULES", "Action", "CompressionConfig", "Grid", "Groups", "PipelineEngine", "StepCounters",
    "build_groups", "gpipe", "in_flight", "one_f_one_b", "simulate", "train_schedule",
]
