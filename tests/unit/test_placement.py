"""--backend: which backend and devices a process gets on a machine's GPUs (placement.place), refused in one line
where it cannot run."""
import re

import pytest
import torch

from aqpipe.placement import place


@pytest.mark.parametrize("backend, local_world, gpus, expected", [
    ("auto", 2, 0, "gloo"),  # CPUs
    ("auto", 2, 2, "nccl"),  # a GPU each
    ("auto", 4, 1, "gloo"),  # stages share the GPU
    ("gloo", 2, 2, "gloo"),  # asked for, though NCCL could run
    ("nccl", 2, 4, "nccl"),
])
def test_the_backend_each_machine_gets(backend, local_world, gpus, expected):
    assert place(backend, 0, local_world, gpus).backend == expected


def test_gloo_on_one_gpu_puts_every_stage_on_it_and_moves_tensors_through_the_host():
    placed = [place("gloo", r, 4, 1) for r in range(4)]
    assert [p.device for p in placed] == [torch.device("cuda", 0)] * 4
    assert {p.transport for p in placed} == {torch.device("cpu")}


def test_processes_spread_over_the_gpus_there_are():
    assert [place("gloo", r, 4, 2).device.index for r in range(4)] == [0, 1, 0, 1]
    nccl = place("nccl", 1, 2, 2)
    assert nccl.device == nccl.transport == torch.device("cuda", 1)  # NCCL moves the GPU's own tensors


def test_cpus_compute_and_move_on_the_cpu():
    p = place("auto", 1, 2, 0)
    assert p.device == p.transport == torch.device("cpu")


@pytest.mark.parametrize("backend, local_world, gpus, words", [
    ("nccl", 2, 0, "no CUDA GPU"),
    ("nccl", 4, 1, "4 processes on this machine but 1 GPU(s)"),
    ("mpi", 1, 0, "expected one of auto, gloo, nccl"),
])
def test_a_backend_that_cannot_run_here_is_one_line(backend, local_world, gpus, words):
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        place(backend, 0, local_world, gpus)
    assert "\n" not in str(err.value)
