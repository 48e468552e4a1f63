"""aqpipe.data_parallel: replicas of a pipeline stage kept in step over slow links.

`create(name, params, comm, **options)` builds an algorithm from the registry (or
`DataParallelConfig(...).create(params, comm, seed, total_steps)` from a run's data-parallel section); the engine calls
its `after_backward` and `after_step` around each optimizer step. Compression goes through the
`compression` package; nothing here knows about pipelines.
"""
from . import allreduce, cocktail, decentralized, qadam, qsparse  # noqa: F401  (they register themselves)
from .base import REGISTRY, Algorithm, create, register
from .comm import Comm
from .config import DataParallelConfig

__all__ = ["REGISTRY", "Algorithm", "Comm", "DataParallelConfig", "create", "register"]
