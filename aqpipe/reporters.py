"""Where a run's figures go besides metrics.jsonl, as HF's Trainer and TRL say it: `--report_to none` (the default),
`tensorboard`, `wandb`, `trackio`, or several comma-separated. Each step's numbers (loss, lr, grad norm, throughput,
the bytes of every wire, bubble, bits, token accuracy) and each evaluation's, under their metrics.jsonl names, in
"train/" and "eval/". Only the rank that writes metrics.jsonl reports (metrics.py).

W&B and Trackio take their own variables as a user sets them for HF: WANDB_PROJECT, WANDB_MODE=offline (the run
under <output_dir>/wandb, or WANDB_DIR's), TRACKIO_PROJECT, TRACKIO_DIR; the project is "aqpipe" where none is set."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

REPORT_TO = ("none", "tensorboard", "wandb", "trackio")
EXTRAS = {name: name for name in REPORT_TO[1:]}  # the package a reporter needs -> the pip extra that brings it


def names(report_to: str) -> list[str]:
    """The reporters a `--report_to` value names (comma-separated; none alone: no reporter)."""
    return [n.strip() for n in str(report_to).split(",") if n.strip() and n.strip() != "none"]


def check(report_to: str) -> None:
    """One line when a reporter is unknown or its package is missing, before any process group starts."""
    for name in names(report_to):
        if name not in REPORT_TO:
            raise ValueError(f"report_to={report_to!r}: expected one of {', '.join(REPORT_TO)}, or several "
                             "comma-separated")
        package = EXTRAS[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"report_to={report_to}: the {package} package is not installed; expected "
                             f"pip install 'aqpipe[{EXTRAS[name]}]' (or pip install {package})")


def tagged(record: dict[str, Any]) -> dict[str, float]:
    """The record's figures under "train/" and "eval/" (a step's record may carry that step's evaluation too)."""
    return {f"{'eval' if name.startswith('eval_') else 'train'}/{name}": value
            for name, value in scalars(record).items()}


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
        for name, value in tagged(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run (project from WANDB_PROJECT, else "aqpipe"), its files under $WANDB_DIR/wandb where the user set
    it (as HF's callback leaves it to W&B), else under <output_dir>/wandb; with WANDB_MODE=offline it is written
    there alone, for `wandb sync`."""

    def __init__(self, output_dir: str, purge_step: int | None = None) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "aqpipe"),
                              dir=os.environ.get("WANDB_DIR") or str(Path(output_dir).resolve()),
                              name=os.environ.get("WANDB_NAME") or Path(output_dir).resolve().name)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(tagged(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A Trackio run (project from TRACKIO_PROJECT, else "aqpipe"), kept where Trackio keeps its runs (TRACKIO_DIR),
    locally unless the user points it at a Space."""

    def __init__(self, output_dir: str, purge_step: int | None = None) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "aqpipe"), name=Path(output_dir).resolve().name)

    def log(self, record: dict[str, Any]) -> None:
        self.trackio.log(tagged(record), step=record["step"])

    def close(self) -> None:
        self.trackio.finish()


class Several:
    """Every reporter `--report_to` names (none, one or more), each given every record."""

    def __init__(self, reporters: list[Any]) -> None:
        self.reporters = reporters

    def log(self, record: dict[str, Any]) -> None:
        for r in self.reporters:
            r.log(record)

    def close(self) -> None:
        for r in self.reporters:
            r.close()


REPORTERS: dict[str, Callable[..., Any]] = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}


def reporter(report_to: str, output_dir: str, purge_step: int | None = None) -> Any:
    return Several([REPORTERS[name](output_dir, purge_step) for name in names(report_to)])
