"""The model a run exported, scored without the pipeline: plain transformers on the held-out text.

A codec may train a model that only works with the codec inside it (a boundary subspace: the stage after learns
from projected activations). What a user keeps is the export, so each run's `<output_dir>/model` is loaded with
`AutoModelForCausalLM.from_pretrained`, in float32, and scored on the trainer's eval split of the corpus (the last
5% of its blocks, the first --max_eval_samples of them): the mean loss a token, and its distance from the first
model given (the reference: the bf16 run's export).

    python -m benchmarks.export_score --dataset runs/wan/docstrings.txt runs/front/bf16/model runs/front/sub/model
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aqpipe.data.lm import lm_dataset


def score(model_dir: str, dataset: str, seq_len: int, samples: int, batch: int = 16) -> float:
    """Mean next-token loss a token of the eval split's first `samples` blocks."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    blocks = lm_dataset(dataset, tokenizer, seq_len, split="eval").limited(samples)
    ids = torch.stack([torch.as_tensor(blocks[i]["input_ids"]) for i in range(len(blocks))])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for chunk in ids.split(batch):
            loss = model(input_ids=chunk, labels=chunk).loss  # a mean over chunk x (seq_len - 1) predictions
            n = chunk.shape[0] * (chunk.shape[1] - 1)
            total, tokens = total + float(loss) * n, tokens + n
    return total / tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="exported model directories; the first is the reference")
    p.add_argument("--dataset", required=True, help="the corpus the runs fine-tuned on (its eval split is scored)")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--max_eval_samples", type=int, default=64)
    p.add_argument("--output", help="also write the scores here (json)")
    args = p.parse_args(argv)
    missing = [m for m in args.models if not (Path(m) / "config.json").is_file()]
    if missing:
        print(f"export_score: no exported model (config.json) in {', '.join(missing)}", file=sys.stderr)
        return 2
    scores = {m: score(m, args.dataset, args.seq_len, args.max_eval_samples) for m in args.models}
    reference = scores[args.models[0]]
    for m, loss in scores.items():
        print(f"{loss:.4f}  {100 * (loss / reference - 1):+.2f}%  {m}")
    if args.output:
        Path(args.output).write_text(json.dumps(scores, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
