"""metrics.jsonl (one JSON object per step, kept across a resume), the progress bar and the reporter (reporters.py),
on rank 0; and the rows they write: a step's (`step_record`) and an evaluation's (`evaluate`)."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from .config import RunConfig
from .pipeline.step_table import TOKEN_METRICS
from .reporters import reporter
from .world import World

if TYPE_CHECKING:
    from aqpipe.pipeline import PipelineEngine, StepMetrics

    from .progress import Progress
    from .tasks import Task


class MetricsWriter:
    """metrics.jsonl (one object per step) and a progress bar, on rank 0 only."""

    def __init__(self, cfg: RunConfig, world: World, total_steps: int, resumed_step: int | None = None,
                 elapsed: float = 0.0) -> None:
        """`resumed_step`: keep the records up to that step (a resumed run appends from there)."""
        self.active = world.rank == 0
        self.start = time.perf_counter() - elapsed  # times continue across a resume
        self.path = Path(cfg.checkpointing.output_dir) / "metrics.jsonl"
        if self.active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._records_until(resumed_step) if resumed_step is not None else []
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
            # TensorBoard forgets what a crashed run logged past the checkpoint, as metrics.jsonl does
            self.reporter = reporter(cfg.report_to, cfg.checkpointing.output_dir,
                                     None if resumed_step is None else resumed_step + 1)
            self.bar = tqdm(total=total_steps, initial=resumed_step or 0, desc="train", unit="step",
                            dynamic_ncols=True)

    def _records_until(self, step: int) -> list[str]:
        """The records of steps <= step (the checkpoint's): no duplicates once the resumed run writes its own."""
        if not self.path.is_file():
            return []
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash
                continue
            if record.get("step", 0) <= step:  # a step's records, its evaluation's too, come before its checkpoint
                kept.append(line)
        return kept

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        record = {**record, "time": round(time.perf_counter() - self.start, 3)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.reporter.log(record)
        if "lr" in record:  # a training step (eval-only records have no lr)
            self.bar.update(1)
            if "loss" in record:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", fwd_MB=f"{record['fwd_bytes'] / 1e6:.2f}")

    def close(self) -> None:
        if self.active:
            self.bar.close()
            self.reporter.close()


def step_record(m: StepMetrics, samples: int, num_tokens: int) -> dict[str, Any]:
    """A step's metrics.jsonl row: the engine's record and its rates (`samples`: the step's over every replica,
    fewer in an epoch's kept partial step); for a causal LM, TRL's `num_tokens`, the input tokens so far."""
    record = {**m.record(), "samples_per_s": samples / m.seconds}
    if m.target_tokens:  # what the loss fell on: padding and prompts are not trained on
        record["target_tokens_per_s"] = m.target_tokens / m.seconds
    if m.input_tokens:
        record["num_tokens"] = num_tokens
    return record


def evaluate(engine: PipelineEngine, batches: list[list[dict]], task: Task, progress: Progress) -> dict[str, float]:
    """The evaluation's row; a causal LM's with TRL's token metrics, `eval_num_tokens` being, as TRL's, the input
    tokens trained on so far (the progress's), so that eval curves plot against them."""
    results = [engine.eval_batch(mbs) for mbs in batches]
    scored = [r for r in results if r.get("target_tokens", 1)]  # a causal LM's batch with no targets has no loss
    loss = sum(r["loss"] for r in scored) / len(scored) if scored else float("nan")
    out = {"eval_loss": loss}
    if task.kind == "causal_lm":
        out["eval_perplexity"] = math.exp(min(loss, 50.0))
        targets = sum(r.get("target_tokens", 0) for r in results)
        if targets:  # TRL's, over every token the loss falls on
            counted = [r for r in results if r.get("target_tokens")]
            for name in (m.name for m in TOKEN_METRICS if any(m.name in r for r in counted)):  # in all, or raise
                out[f"eval_{name}"] = sum(r[name] * r["target_tokens"] for r in counted) / targets
            out["eval_num_tokens"] = progress.num_tokens
    else:
        out["eval_accuracy"] = sum(r.get("accuracy", 0.0) for r in results) / len(results)
    return out
