"""The model a run exported, scored without the pipeline: plain transformers on the held-out text.

A codec may train a model that only works with the codec inside it (a boundary subspace: the stage after learns
from projected activations). What a user keeps is the export, so each run's `<output_dir>/model` is loaded with
`AutoModelForCausalLM.from_pretrained` (an adapter directory on its base with PEFT's `PeftModel.from_pretrained`),
in float32, and scored on the trainer's eval split of the corpus (the last
5% of its blocks, the first --max_eval_samples of them): the mean loss a token, and its distance from the first
model given (the reference: the bf16 run's export).

    python -m benchmarks.export_score --dataset runs/wan/docstrings.txt runs/front/bf16/model runs/front/sub/model
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aqpipe.data.lm import lm_dataset


def load(model_dir: str, base: str | None = None) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) as a user loads the export, in float32: a model directory with `from_pretrained`; an adapter
    directory (adapter_config.json, as `<output_dir>/adapter`) on its base with PEFT's `PeftModel.from_pretrained`,
    the base being `base` or the one the adapter names (a QLoRA run's adapter on the bf16 base, as PEFT users do)."""
    adapter = Path(model_dir) / "adapter_config.json"
    if not adapter.is_file():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(
            model_dir)
    from peft import PeftModel  # deferred: only adapters need it

    base = base or json.loads(adapter.read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), model_dir)
    has_tokenizer = (Path(model_dir) / "tokenizer_config.json").is_file()
    return model, AutoTokenizer.from_pretrained(model_dir if has_tokenizer else base)


def score(model_dir: str, dataset: str | None, seq_len: int, samples: int, batch: int = 16,
          base: str | None = None) -> float:
    """Mean next-token loss a token of the eval split's first `samples` blocks (None: the built-in corpus)."""
    model, tokenizer = load(model_dir, base)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # plain transformers either way, in float32
    model.to(device).eval()
    blocks = lm_dataset(dataset, tokenizer, seq_len, split="eval").limited(samples)
    ids = torch.stack([torch.as_tensor(blocks[i]["input_ids"]) for i in range(len(blocks))])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for chunk in ids.split(batch):
            chunk = chunk.to(device)
            loss = model(input_ids=chunk, labels=chunk).loss  # a mean over chunk x (seq_len - 1) predictions
            n = chunk.shape[0] * (chunk.shape[1] - 1)
            total, tokens = total + float(loss) * n, tokens + n
    return total / tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="exported model or adapter directories; the first is the reference")
    p.add_argument("--base", help="the base model an adapter directory is loaded on (default: the one it names)")
    p.add_argument("--dataset", required=True, help="the corpus the runs fine-tuned on (its eval split is scored)")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--max_eval_samples", type=int, default=64)
    p.add_argument("--output", help="also write the scores here (json)")
    args = p.parse_args(argv)
    missing = [m for m in args.models if not any((Path(m) / f).is_file() for f in ("config.json",
                                                                                  "adapter_config.json"))]
    if missing:
        print(f"export_score: no exported model (config.json) or adapter (adapter_config.json) in "
              f"{', '.join(missing)}", file=sys.stderr)
        return 2
    scores = {m: score(m, args.dataset, args.seq_len, args.max_eval_samples, base=args.base) for m in args.models}
    reference = scores[args.models[0]]
    for m, loss in scores.items():
        print(f"{loss:.4f}  {100 * (loss / reference - 1):+.2f}%  {m}")
    if args.output:
        Path(args.output).write_text(json.dumps(scores, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
