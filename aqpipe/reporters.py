"""Where a run's figures go besides metrics.jsonl: `--report_to none` (the default) or `tensorboard`, as HF's
Trainer says it. Each step's numbers (loss, lr, grad norm, throughput, the bytes of every wire, bubble, bits) and
each evaluation's, under their metrics.jsonl names, in "train/" and "eval/"."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

REPORT_TO = ("none", "tensorboard")
EXTRAS = {"tensorboard": "tensorboard"}  # the package a reporter needs -> the pip extra that brings it


def check(report_to: str) -> None:
    """One line when a reporter is unknown or its package is missing, before any process group starts."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to={report_to!r}: expected one of {', '.join(REPORT_TO)}")
    package = EXTRAS.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise ValueError(f"report_to={report_to}: the {package} package is not installed; expected "
                         f"pip install 'aqpipe[{EXTRAS[report_to]}]' (or pip install {package})")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers, nested ones (bits per boundary) by dotted name; step and epoch are axes, not figures."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in scalars(value).items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "epoch"):
            out[key] = float(value)
    return out


class TensorBoard:
    """Event files under <output_dir>/tensorboard, read by `tensorboard --logdir <output_dir>/tensorboard`."""

    def __init__(self, output_dir: str, purge_step: int | None = None) -> None:
        """`purge_step`: a resumed run's first step; what an earlier run logged from it on is dropped."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():  # a step's record may carry that step's evaluation too
            self.writer.add_scalar(f"{'eval' if name.startswith('eval_') else 'train'}/{name}", value, record["step"])

    def close(self) -> None:
        self.writer.close()


class Nothing:
    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


REPORTERS: dict[str, Callable[..., Any]] = {"none": lambda output_dir, purge_step=None: Nothing(),
                                           "tensorboard": TensorBoard}


def reporter(report_to: str, output_dir: str, purge_step: int | None = None) -> Any:
    return REPORTERS[report_to](output_dir, purge_step)
