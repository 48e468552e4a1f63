"""The last stage's peak memory with the causal-LM loss whole (today's: a micro-batch's float32 logits and their
gradient at once) against chunked over the sequence (aqpipe/pipeline/stages/lm_loss.py), on CPU.

A Llama last stage (one block, hidden 256, tied head) with Llama 3's vocabulary (128,256 tokens), a micro-batch of
4 x 1024 tokens: whole logits are 4 * 1024 * 128256 * 4 bytes = 2.1 GB. Each mode runs forward and backward in a
process of its own; printed: the peak resident memory it added over the built stage, the seconds, and the loss
(the same in both).

    python -m benchmarks.loss_memory                 # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

VOCAB, HIDDEN = 128256, 256


def one(mode: str, rows: int, seq: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe.pipeline.loading import build_stage
    from aqpipe.pipeline.stages import lm_loss

    if mode == "whole":
        lm_loss.CHUNK_BYTES = 1 << 62
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    stage, _, _ = build_stage(LlamaForCausalLM, config, 0, 1, seed=0)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(0))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loss = stage(None, {"input_ids": ids, "labels": ids}).loss
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"added_mb": (peak - before) / 1024, "seconds": seconds, "loss": float(loss)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: one mode, in this process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.rows, args.seq_len)))
        return 0
    logits_gb = args.rows * args.seq_len * VOCAB * 4 / 1e9
    print(f"vocabulary {VOCAB}, {args.rows} x {args.seq_len} tokens: whole float32 logits {logits_gb:.2f} GB")
    print("| loss | peak MB added | seconds | loss value |\n|---|---|---|---|")
    result = {"rows": args.rows, "seq_len": args.seq_len, "vocab": VOCAB, "modes": {}}
    for mode in ("whole", "chunked"):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.loss_memory", "--one", mode, "--rows", str(args.rows),
                               "--seq_len", str(args.seq_len)], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"loss_memory: {mode} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        result["modes"][mode] = r
        print(f"| {mode} | {r['added_mb']:.0f} | {r['seconds']:.1f} | {r['loss']:.6f} |", flush=True)
    w, c = result["modes"]["whole"], result["modes"]["chunked"]
    print(f"chunked / whole: memory {c['added_mb'] / w['added_mb']:.2f}x, time {c['seconds'] / w['seconds']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
