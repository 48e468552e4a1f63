"""The fine-tunes aqpipe runs, by what the model does: what differs between them is data, not code.

`causal-lm` and `classify` take any supported model (the family comes from its config.json); `gpt2` and `deberta`
are presets of them. Each task's `defaults` hold only where it differs from RunConfig's own defaults (config.py),
so every default has one home; `aqpipe TASK --print_config` prints them all as a config file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """A fine-tune: what the model does (its head), the built-in shape and data it runs without flags, and its
    default settings."""

    name: str
    kind: str  # "causal_lm" or "classification"
    shape: str  # the built-in tiny model without --model (gpt2, deberta, llama, bert); with one, its config.json says
    default_dataset: str | None
    summary: str
    defaults: dict[str, Any] = field(default_factory=dict)


_CLASSIFY = {"micro_batch_size": 8, "num_micro_batches": 2, "lr": 5e-4, "seq_len": 64}
# the recipes' presets keep the caps their figures in benchmarks/RESULTS.md were measured with; the general tasks
# train on all of a user's data
_MAIN_JOB_CAPS = {"max_train_samples": 1024, "max_eval_samples": 128}

TASKS: dict[str, Task] = {
    "causal-lm": Task(
        name="causal-lm", kind="causal_lm", shape="llama", default_dataset=None,
        summary="causal LM fine-tuning of any supported model (--model); default: a tiny tied Llama shape on the "
                "Shakespeare plays",
        defaults={"output_dir": "runs/causal-lm"},
    ),
    "classify": Task(
        name="classify", kind="classification", shape="bert", default_dataset="acceptability",
        summary="sequence classification with any supported model (--model); default: a tiny BERT shape on the "
                "built-in acceptability task (--dataset next_line: the pair task)",
        defaults={**_CLASSIFY, "output_dir": "runs/classify"},
    ),
    "gpt2": Task(
        name="gpt2", kind="causal_lm", shape="gpt2", default_dataset=None,
        summary="GPT2 causal LM; default: a tiny GPT2 shape on the Shakespeare plays",
        defaults={**_MAIN_JOB_CAPS, "output_dir": "runs/gpt2"},
    ),
    "deberta": Task(
        name="deberta", kind="classification", shape="deberta", default_dataset="acceptability",
        summary="DeBERTa sequence classification; default: a tiny DeBERTa-v2 shape on the built-in "
                "acceptability task (--dataset next_line: the pair task)",
        defaults={**_CLASSIFY, "max_train_samples": 2048, "max_eval_samples": 256, "output_dir": "runs/deberta"},
    ),
}
