"""aqpipe.pipeline: HF models split into stages, schedules as data, codec-compressed transport, the engine."""
from .engine import CompressionConfig, PipelineEngine, StepCounters, owned_parameters
from .partition import merge_into, partition, tie_groups
from .stages import PipelineStage, StageOutput
from .schedule import SCHEDULES, Action, gpipe, in_flight, one_f_one_b, simulate, train_schedule
from .topology import Grid, Groups, build_groups

__all__ = [
    "SCHEDULES", "Action", "CompressionConfig", "Grid", "Groups", "PipelineEngine", "PipelineStage", "StageOutput",
    "StepCounters", "build_groups", "gpipe", "in_flight", "merge_into", "one_f_one_b", "owned_parameters", "partition", "simulate",
    "tie_groups", "train_schedule",
]
