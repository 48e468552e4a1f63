"""The test suite's markers: the tests are laid out by what they start: `unit/` (one process, seconds),
`multiprocess/` (gloo process groups spawned in-process), `e2e/` (the launchers, recipes, benchmarks and an installed
wheel as users run them), `gpu/` (the CUDA paths: skipped, with the reason, where no GPU is). Each folder's tests
carry its name as a marker: `pytest -m unit` runs the quick ones, `pytest -m gpu` the GPU's.
Shared helpers live in `tests/helpers/` (processes, the toy pipeline, the data-parallel toy, files, the reference,
the built-in corpus's fixtures).
"""
from __future__ import annotations

import os

import pytest

# the quantizer's Triton kernels run in Triton's interpreter, on CPU tensors: set before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

LAYERS = ("unit", "multiprocess", "e2e", "gpu")
pytest_plugins = ("tests.helpers.shakespeare",)  # the built-in corpus's fixtures, for the data tests


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its folder's name (unit, multiprocess, e2e, gpu); a gpu test skips without a GPU."""
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        layer = item.path.parent.name
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
        if layer == "gpu" and not torch.cuda.is_available():
            item.add_marker(no_gpu)
