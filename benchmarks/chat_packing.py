"""Chat fine-tuning packed against padded, on 2 stages with the preset's AQ-SGD: assistant tokens trained a second
and forward bytes per assistant token; and the per-token loss against the micro-batches' mean, on the same data.

The job is the user's: `torchrun --nproc_per_node 2 -m aqpipe causal-lm --chat_template chatml` on a JSONL of
conversations, a tied Llama with GPT-2's 50257-token vocabulary whose tokenizer has no chat template (a base model's),
bf16 shards. The conversations are generated (no hub here): a user turn and an assistant reply, each of words drawn
from the built-in plays, their lengths log-normal (sigma 0.9: a long right tail, as instruction sets have), with
medians of 12 and 35 words: means of 18 and 53 words, about 360 characters of text a conversation, Alpaca's scale
(its card: 33.4 MB over 36,401 training rows of instruction, input, output and their templated text, which puts
instruction, input and output near 360 characters a row). The figures depend on the padding share, which this
spread and --seq_len set.

    python -m benchmarks.chat_packing --json benchmarks/results/chat_packing.json   # ~12 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.rank_memory import write_model

ROWS = {  # name: the flags that differ
    "padded": [],
    "packed": ["--packing"],
    "packed, mean of micro-batch means": ["--packing", "--loss_average", "micro_batches"],
}
MODEL = {"vocab_size": 50257, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "tie_word_embeddings": True}


def conversations(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` two-turn conversations with log-normal prompt and reply lengths (words from the built-in plays)."""
    from aqpipe.data import fetch_shakespeare

    words = Path(fetch_shakespeare()).read_text(encoding="utf-8").split()
    rng = random.Random(seed)

    def text(median: float) -> str:
        n = max(1, min(700, round(rng.lognormvariate(math.log(median), 0.9))))
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])

    return [{"messages": [{"role": "user", "content": text(12)}, {"role": "assistant", "content": text(35)}]}
            for _ in range(count)]


def run(name: str, model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = out / name.replace(" ", "_").replace(",", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29641",
           "-m", "aqpipe", "causal-lm", "--model", str(model), "--dataset", str(data), "--chat_template", "chatml",
           "--seq_len", str(args.seq_len), "--micro_batch_size", "2", "--num_micro_batches", "4",
           "--max_steps", str(args.steps), "--max_eval_samples", "0", "--lr", "1e-3", "--dropout", "0",
           "--output_dir", str(run_dir), "--overwrite_output_dir", *ROWS[name]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "lr" in r]
    timed = steps[2:]  # the first steps build caches and receive buffers
    tokens = sum(r["target_tokens"] for r in steps)
    data_line = next((line for line in proc.stderr.splitlines() if line.startswith("data:")), "")
    return {"name": name, "steps": len(steps), "target_tokens": tokens,
            "target_tokens_per_s": sum(r["target_tokens"] for r in timed) / sum(r["seconds"] for r in timed),
            "fwd_bytes_per_target_token": sum(r["fwd_bytes"] for r in steps) / tokens,
            "all_bytes_per_target_token": sum(r["fwd_bytes"] + r["bwd_bytes"] + r["tie_bytes"] for r in steps) / tokens,
            "seconds_per_step": sum(r["seconds"] for r in timed) / len(timed),
            "eval_loss": next(r["eval_loss"] for r in reversed(records) if "eval_loss" in r), "data": data_line}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=1200)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default="runs/chat_packing")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data = out / "model", out / "chats.jsonl"
    if not (model / "config.json").is_file():
        write_model("llama", model, MODEL)
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(args.conversations, seed=0)))
    rows = [run(name, model, data, out, args) for name in ROWS]
    for r in rows:
        print(f"{r['name']:<36} {r['target_tokens_per_s']:8.1f} assistant tokens/s  "
              f"{r['fwd_bytes_per_target_token']:8.1f} fwd B/token  "
              f"{r['all_bytes_per_target_token']:8.1f} all B/token  "
              f"{r['seconds_per_step']:6.2f} s/step  eval {r['eval_loss']:.4f}  ({r['steps']} steps, "
              f"{r['target_tokens']} tokens)\n    {r['data']}")
    padded, packed, means = rows
    print(f"packed / padded: {packed['target_tokens_per_s'] / padded['target_tokens_per_s']:.2f}x assistant tokens/s, "
          f"{padded['fwd_bytes_per_target_token'] / packed['fwd_bytes_per_target_token']:.2f}x fewer forward bytes "
          f"a token (goal >= 2x on both)")
    print(f"per-token loss vs mean of micro-batch means, final eval loss: {packed['eval_loss']:.4f} vs "
          f"{means['eval_loss']:.4f} ({packed['eval_loss'] - means['eval_loss']:+.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
