"""The data-parallel section of a run's settings, checked as it is made, without building anything.

One object holds the replica count, the algorithm and every algorithm's options; `create` passes
each algorithm the options it takes (`Algorithm.OPTIONS`), so a trainer forwards the section as is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from aqpipe.compression.fields import KEPT, RESHAPES, check_choices, check_int, setting

from .base import REGISTRY, Algorithm
from .comm import Comm
from .decentralized import PEER_SELECTIONS, TOPOLOGIES



@dataclass(frozen=True)
class DataParallelConfig:
    replicas: int | str = setting(1, "data-parallel replicas of the pipeline (world size = stages x replicas), or auto "
                                     "= world size / pipeline_stages (an elastic launch: as many as the machines "
                                     "that came hold); a resume may change it (the rest of the epoch is dealt over "
                                     "the new count, the global batch kept)", "replicas", resume=RESHAPES)
    shares: list[int] | str = setting("auto", "micro-batches each replica takes a step, comma-separated (their sum "
                                            "replicas x num_micro_batches: the global batch), so that a faster "
                                            "replica takes more and the average weighs each by its share; equal, or "
                                            "auto (the plan's under --placement auto or a plan file, else equal); "
                                            "an algorithm that averages models keeps equal shares; a resume on as "
                                            "many replicas keeps the checkpoint's", "micro_batch_shares",
                                      resume=KEPT, older="equal")
    algorithm: str = setting("allreduce", "replica sync: allreduce, decentralized, low_precision_decentralized, qadam, "
                                        "qsparse_local_sgd, cocktail_sgd", "dp_algorithm",
                                  choices=REGISTRY)
    bits: int = setting(8, "bits of compressed data-parallel traffic (1-8)", "dp_bits")
    warmup_steps: int | str = setting("auto", "qadam: full-precision Adam steps before compressed momentum (auto: a "
                                            "tenth of the run's steps)", "dp_warmup_steps",
                                      resume=KEPT)
    local_steps: int = setting(4, "qsparse_local_sgd: local steps between synchronizations", "dp_local_steps")
    topk_ratio: float = setting(0.01, "qsparse_local_sgd, cocktail_sgd: fraction of entries sent (0, 1]",
                              "dp_topk_ratio")
    random_ratio: float = setting(0.1, "cocktail_sgd: fraction of entries considered a step, top-k among them (0, 1]",
                                "dp_random_ratio")
    topology: str = setting("directed_ring", "low_precision_decentralized: directed_ring (one neighbour) or ring (two)",
                          "dp_topology", choices=TOPOLOGIES)
    peer_selection: str = setting("shift_one", "decentralized: shift_one or all", "dp_peer_selection",
                                   choices=PEER_SELECTIONS)
    interval: int = setting(1, "decentralized: communicate every N steps", "dp_interval")

    def __post_init__(self) -> None:
        """Every value against its range as the section is made (one line naming it); no I/O."""
        if self.replicas != "auto":
            check_int("replicas", self.replicas, 1, what="an int >= 1 or auto")
        check_choices(self)
        if self.shares not in ("auto", "equal") and not (
                isinstance(self.shares, list) and self.shares and all(isinstance(v, int) and not isinstance(v, bool)
                                                                      and v >= 1 for v in self.shares)):
            raise ValueError(f"micro_batch_shares={self.shares!r}: expected auto, equal, or micro-batch counts >= 1 "
                             "like 5,3")
        if self.unequal_shares() and not REGISTRY[self.algorithm].WEIGHTS:
            raise ValueError(f"micro_batch_shares={','.join(map(str, self.shares))} with dp_algorithm="
                             f"{self.algorithm}: it averages the replicas' models (or their changes) with equal "
                             "weights, so unequal shares would bias the run; expected equal (or auto) shares, or "
                             "dp_algorithm allreduce or qadam")
        check_int("dp_bits", self.bits, 1, 8)
        check_int("dp_local_steps", self.local_steps, 1)
        check_int("dp_interval", self.interval, 1)
        if self.warmup_steps != "auto":
            check_int("dp_warmup_steps", self.warmup_steps, 0)
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)) \
                or not 0 < self.topk_ratio <= 1:
            raise ValueError(f"dp_topk_ratio={self.topk_ratio!r}: expected a fraction in (0, 1]")
        if isinstance(self.random_ratio, bool) or not isinstance(self.random_ratio, (int, float)) \
                or not 0 < self.random_ratio <= 1:
            raise ValueError(f"dp_random_ratio={self.random_ratio!r}: expected a fraction in (0, 1]")
        if self.algorithm == "cocktail_sgd" and self.topk_ratio > self.random_ratio:
            raise ValueError(f"dp_topk_ratio={self.topk_ratio!r}: expected at most "
                             f"dp_random_ratio={self.random_ratio!r} (cocktail_sgd takes the top among the random)")
        pairs = self.algorithm == "decentralized" and self.peer_selection == "shift_one"
        if pairs and self.replicas != "auto" and self.replicas > 1 and self.replicas % 2:
            raise ValueError(f"replicas={self.replicas}: decentralized with shift_one pairs replicas, "
                             "expected an even count")

    def unequal_shares(self) -> list[int] | None:
        """Every replica's micro-batches a step where the shares are unequal; None where they are equal (or not yet
        resolved: auto)."""
        if not isinstance(self.shares, list) or len(set(self.shares)) == 1:
            return None
        return list(self.shares)

    def warmup_for(self, total_steps: int) -> int:
        """QAdam's warm-up in steps: as given, or for "auto" a tenth of the run (at least 1), like the LR
        schedule's warm-up, so that a run of any length compresses most of its steps."""
        return max(1, -(-total_steps // 10)) if self.warmup_steps == "auto" else self.warmup_steps

    def options(self, seed: int, total_steps: int) -> dict[str, Any]:
        """The keyword options the chosen algorithm takes, from this section (and the run's seed and length)."""
        values = {"bits": self.bits, "warmup_steps": self.warmup_for(total_steps), "local_steps": self.local_steps,
                  "topk_ratio": self.topk_ratio, "peer_selection": self.peer_selection, "interval": self.interval,
                  "random_ratio": self.random_ratio, "topology": self.topology, "seed": seed}
        return {name: values[name] for name in REGISTRY[self.algorithm].OPTIONS}

    def plan(self, total_steps: int) -> str | None:
        """One line for the user where the algorithm spends steps uncompressed (QAdam's warm-up); None elsewhere."""
        if self.replicas < 2 or self.algorithm != "qadam":
            return None
        warmup = self.warmup_for(total_steps)
        if warmup >= total_steps:
            return (f"qadam: dp_warmup_steps={warmup} covers all {total_steps} steps of this run, so every step sends "
                    "full-precision gradients; a smaller --dp_warmup_steps (or auto) compresses")
        return (f"qadam: full-precision gradients for the first {warmup} of {total_steps} steps (dp_warmup_steps), "
                f"then {self.bits}-bit momentum")

    def create(self, params: list[torch.nn.Parameter], comm: Comm, seed: int, total_steps: int) -> Algorithm:
        return REGISTRY[self.algorithm](params, comm, **self.options(seed, total_steps))
