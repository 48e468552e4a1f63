"""A slower device emulated by waiting (the trainer's AQPIPE_COMPUTE_SLOWDOWN): each compute action takes `factor`
times its own time.

Its own time is its CPU time on a CPU with one compute thread (what other processes sharing the host's cores do not
inflate, so eight ranks on two cores each keep their emulated pace), its wall time otherwise (a GPU's, synchronized
by the caller; a CPU's with several threads, whose CPU time is spread over them).
"""
from __future__ import annotations

import time

import torch

Began = tuple[float, float]  # (wall clock, this thread's CPU clock) when an action began


def began() -> Began:
    return time.perf_counter(), time.thread_time()


def own_seconds(start: Began, device: torch.device) -> float:
    """The action's own time since `start`."""
    wall = time.perf_counter() - start[0]
    if device.type == "cuda" or torch.get_num_threads() > 1:
        return wall
    return time.thread_time() - start[1]


def stretch(start: Began, factor: float, device: torch.device) -> None:
    """Wait until the action begun at `start` has taken `factor` times its own time."""
    wait = factor * own_seconds(start, device) - (time.perf_counter() - start[0])
    if wait > 0:
        time.sleep(wait)
