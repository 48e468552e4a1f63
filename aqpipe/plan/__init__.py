"""A plan from measured speeds and links: which rank holds which (stage, replica), and the blocks of each stage.

    cluster = read("cluster.yaml")                     # or profile.measure(...) at a run's start
    work = workload.build(cfg, model_class, config, first_share)
    chosen = plan(cluster, work, stages, replicas)     # chosen.placement, chosen.partition, chosen.predicted

Everything here is a pure function of the table and the settings (the profile aside), so every rank reaches the
same plan, and tests can hold the search to brute force without processes.
"""
from .cluster import Cluster, Machine, parse, read
from .cost import CostModel, Prediction
from .search import Plan, plan
from .workload import Workload

__all__ = ["Cluster", "CostModel", "Machine", "Plan", "Prediction", "Workload", "parse", "plan", "read"]
