"""aqpipe.pipeline: the stage-partitioned engine (HF models split into stages, GPipe and 1F1B
schedules, point-to-point transport). Not built yet: see the pipeline issue."""
