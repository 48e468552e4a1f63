"""QLoRA's memory: the largest rank's peak resident memory with the frozen base in bf16 and in 4 bits
(`--load_in_4bit`), at 2 and 4 stages, on a tied Llama of width 2048 (Llama-3.2-1B's width and MLP, 8 blocks,
GPT-2's 50257-token vocabulary), bf16 safetensors shards as checkpoints ship; LoRA rank 8 on PEFT's default targets.
Each run is the real job under torchrun (set-up, `--max_steps` steps, eval, export), every rank's peak read as it
exits (rank_memory.py's hook). Printed beside it: what one stage's bf16 block weights are, the bar a 4-bit base must
clear by half, and the step time of each run (on these CPUs, bitsandbytes' 4-bit layers dequantize in torch ops).
Then the extrapolation for a 70B Llama over 2 and 4 stages: the bytes a rank holds for its weights.

    python -m benchmarks.qlora_memory --json benchmarks/results/qlora_memory.json     # ~15 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.rank_memory import ROOT, run_job, write_model

WIDE = {"vocab_size": 50257, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 512,
        "tie_word_embeddings": True}
LLAMA_70B = {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}
JOB = ["--seq_len", "64", "--micro_batch_size", "1", "--num_micro_batches", "2", "--max_train_samples", "16",
       "--max_eval_samples", "2", "--lora_rank", "8"]
NESTED_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # NF4, an 8-bit scale per 64 weights, a float32 per 256 scales


def block_linear_parameters(config: dict[str, Any]) -> int:
    """A block's linear weights (attention and MLP), what a 4-bit base holds in 4 bits."""
    width, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head = width // heads
    return 2 * width * width + 2 * width * kv * head + 3 * width * config["intermediate_size"]


def extrapolate(config: dict[str, Any], stages: int) -> dict[str, float]:
    """The largest stage's weights in GB, in bf16 and with its blocks' linears in nested NF4 (the rest in bf16), as
    the partitioner splits the model (built on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe.pipeline.loading import meta_model
    from aqpipe.pipeline.partitioning import partition

    model = meta_model(LlamaForCausalLM, LlamaConfig(**config))
    rows = []
    for stage in partition(model, stages, copy_modules=False):
        total = sum(p.numel() for p in stage.parameters())
        linear = sum(m.weight.numel() for name, m in stage.named_modules()
                     if type(m) is torch.nn.Linear and not name.endswith("lm_head"))
        rows.append({"parameters": total, "bf16_gb": 2 * total / 1e9,
                     "four_bit_gb": (2 * (total - linear) + NESTED_BITS / 8 * linear) / 1e9})
    return max(rows, key=lambda r: r["four_bit_gb"]) | {"largest_bf16_gb": max(r["bf16_gb"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,4")
    p.add_argument("--max_steps", type=int, default=2)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"model": WIDE, "job": JOB, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result["parameters"] = write_model("llama", work / "model", WIDE)
        for stages in [int(s) for s in args.stages.split(",")]:
            for label, extra in (("bf16 base", []), ("4-bit base", ["--load_in_4bit", "--use_bnb_nested_quant"])):
                run_dir = work / f"{label.split()[0]}_{stages}"
                job = [*JOB, "--max_steps", str(args.max_steps), *extra]
                peaks = run_job(ROOT, "causal-lm", work / "model", stages, run_dir, job)
                summary = json.loads((run_dir / f"out{stages}" / "summary.json").read_text())
                row = {"peak_mb": peaks, "largest_mb": max(peaks), "seconds": summary.get("seconds"),
                       "eval_loss": summary.get("eval_loss")}
                result["runs"].setdefault(str(stages), {})[label] = row
                print(f"{stages} stages, {label}: peak MB by rank {[round(x) for x in peaks]}, "
                      f"{row['seconds']:.1f} s for {args.max_steps} steps", flush=True)
    linear = block_linear_parameters(WIDE)
    print(f"\ntied Llama, {result['parameters'] / 1e6:.0f}M parameters; a block's linears {linear / 1e6:.1f}M "
          f"({2 * linear / 2**20:.0f} MB in bf16)")
    print("| stages | largest rank, bf16 base MB | 4-bit base MB | saved MB | half a stage's bf16 block weights MB | "
          "s/step bf16 | s/step 4-bit |")
    print("|---|---|---|---|---|---|---|")
    for stages, runs in result["runs"].items():
        bf16, four = runs["bf16 base"], runs["4-bit base"]
        half = WIDE["num_hidden_layers"] / int(stages) * linear * 2 / 2 / 2**20
        print(f"| {stages} | {bf16['largest_mb']:.0f} | {four['largest_mb']:.0f} | "
              f"{bf16['largest_mb'] - four['largest_mb']:.0f} | {half:.0f} | "
              f"{bf16['seconds'] / args.max_steps:.1f} | {four['seconds'] / args.max_steps:.1f} |")
    result["llama_70b"] = {stages: extrapolate(LLAMA_70B, stages) for stages in (2, 4)}
    print("\nLlama 3.1 70B's shape, the largest rank's weights:")
    for stages, e in result["llama_70b"].items():
        print(f"  {stages} stages: bf16 {e['largest_bf16_gb']:.1f} GB, 4-bit base {e['four_bit_gb']:.1f} GB "
              f"({e['parameters'] / 1e9:.1f}B parameters on that rank)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
