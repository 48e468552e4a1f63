"""Peak host memory per rank of the trainer, at 1, 2 and 4 stages, on a Llama-shaped model as users have it.

The model: a tied Llama of >100M parameters (width 768, 12 layers, GPT-2's 50257-token BPE as its vocabulary),
saved as bf16 safetensors shards with its tokenizer, as a downloaded checkpoint is; or GPT-2 small's shape in
fp32. Each stage count runs the real job (`python -m aqpipe causal-lm` on one process,
`torchrun -m aqpipe causal-lm` on several: set-up, 3 training steps,
eval, export) and every rank's peak resident memory is read when it exits (its `ru_maxrss`, recorded by a
sitecustomize hook on the rank's path, the same for any version of the code). `--before REV` runs the same job
from another revision of the checkout (a git worktree), for the figures before per-stage loading.

    python -m benchmarks.memory --per_rank                      # tied Llama, 1, 2, 4 stages; ~3 min
    python -m benchmarks.memory --per_rank --family gpt2 --before ce8c654   # GPT-2 small's shape, this code and
                                                                            # the release before it, side by side
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
# the models: a tied Llama in bf16 (as Llama 3.2 and Qwen2.5 ship), and GPT-2 small's shape in fp32 (as GPT2
# ships; the release before per-stage loading can run it, so the two can be compared)
FAMILIES = {
    "llama": {"task": "causal-lm", "dtype": "bfloat16", "config": {
        "vocab_size": 50257, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 512,
        "tie_word_embeddings": True}},
    "gpt2": {"task": "gpt2", "dtype": "float32", "config": {
        "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 512}},
}
JOB = ["--seq_len", "128", "--micro_batch_size", "2", "--num_micro_batches", "4", "--max_steps", "3",
       "--max_train_samples", "64", "--max_eval_samples", "8"]
# every rank's peak resident memory, written as it exits (not the launcher's: it has no RANK)
# a finished command leaves by os._exit (aqpipe.cli.leave), which runs no atexit hook: that exit writes it too, in the
# process that imported the hook only (a forked child leaves by os._exit as well)
HOOK = """import atexit, os, resource
_PID = os.getpid()
def _peak():
    path = os.environ.get("AQPIPE_PEAK_DIR")
    if path and os.getpid() == _PID and ("RANK" in os.environ or os.environ.get("AQPIPE_PEAK_ALONE")):
        with open(os.path.join(path, "rank" + os.environ.get("RANK", "0") + ".kb"), "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
atexit.register(_peak)
_exit = os._exit
def _peak_then_exit(code):
    _peak()
    _exit(code)
os._exit = _peak_then_exit
"""
# Published configurations, for the extrapolation (hub config.json values)
PUBLISHED = {
    "Llama-3.2-1B": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "Llama-3.1-8B": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
}
STATE_BYTES = 16  # per trained parameter: fp32 weight, fp32 gradient, Adam's two fp32 moments


def write_model(family: str, path: Path, config: dict[str, Any] | None = None) -> int:
    """The family's checkpoint (safetensors shards, tokenizer), random weights; returns its parameter count.
    `config`: another shape of the family (its config's values) than the published one."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from benchmarks.gpt2_bpe import gpt2_bpe_tokenizer

    spec = FAMILIES[family]
    tokenizer = gpt2_bpe_tokenizer()  # a real vocabulary: the head and the logits are as large as a user's
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (GPT2Config, GPT2LMHeadModel)
    config = config_class(**(config or spec["config"]), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = model_class(config).to(getattr(torch, spec["dtype"]))
    model.save_pretrained(path, max_shard_size="60MB")
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run_job(checkout: Path, task: str, model: Path, stages: int, work: Path,
            job: list[str] | None = None) -> list[float]:
    """The job (`job`: its flags, default JOB) at `stages` stages from `checkout`; every rank's peak resident MB."""
    job = JOB if job is None else job
    peaks, hook = work / f"peaks{stages}", work / "hook"
    peaks.mkdir(parents=True)
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(checkout)]), "AQPIPE_PEAK_DIR": str(peaks),
           "OMP_NUM_THREADS": "1", "AQPIPE_PEAK_ALONE": "1" if stages == 1 else ""}
    out = ["--output_dir", str(work / f"out{stages}")]
    if stages == 1:
        cmd = [sys.executable, "-m", "aqpipe", task, "--model", str(model), *job, *out]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(stages), "--master_port",
               str(29500 + stages), "-m", "aqpipe", task, "--model", str(model), *job, *out]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"memory --per_rank: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [int((peaks / f"rank{r}.kb").read_text()) / 1024 for r in range(stages)]


def stage_parameters(config: dict[str, Any], stages: int) -> list[int]:
    """Each stage's parameters as the partitioner splits the published model (built on the meta device): stage 0
    its embeddings, the last its norm and head (a tied head: its own copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from aqpipe.pipeline.loading import meta_model
    from aqpipe.pipeline.partitioning import partition

    model = meta_model(LlamaForCausalLM, LlamaConfig(**config))
    return [sum(p.numel() for p in s.parameters()) for s in partition(model, stages, copy_modules=False)]


@contextlib.contextmanager
def checkouts(work: Path, before: str | None) -> Iterator[dict[str, Path]]:
    """{"now": this checkout}, and with `before` {"before": that git revision, as a worktree under `work`} too,
    removed on the way out."""
    found = {"now": ROOT}
    if before:
        subprocess.run(["git", "worktree", "add", "--detach", str(work / "before"), before], cwd=ROOT, check=True,
                       capture_output=True)
        found["before"] = work / "before"
    try:
        yield found
    finally:
        if before:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / "before")], cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--stages", default="1,2,4")
    p.add_argument("--before", help="also run the job from this git revision of the checkout (a worktree)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    counts = [int(s) for s in args.stages.split(",")]
    spec = FAMILIES[args.family]
    result: dict[str, Any] = {"family": args.family, "model": spec, "job": JOB, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = write_model(args.family, work / "model")
        result["parameters"] = params
        with checkouts(work, args.before) as found:
            for label, checkout in found.items():
                for stages in counts:
                    peaks = run_job(checkout, spec["task"], work / "model", stages, work / label)
                    result["runs"].setdefault(label, {})[stages] = peaks
                    print(f"{label:>6} {stages} stage(s): peak MB by rank {[round(x) for x in peaks]}", flush=True)
    one = max(result["runs"]["now"][counts[0]])
    print(f"\n{args.family}, {params / 1e6:.1f}M parameters, {spec['dtype']} checkpoint; largest rank's peak:")
    for label, runs in result["runs"].items():
        for stages, peaks in runs.items():
            print(f"  {label:>6} {stages} stage(s): {max(peaks):7.0f} MB, {max(peaks) / one:.2f}x one stage now")
    base = max(result["runs"]["now"][counts[0]]) - STATE_BYTES * params / 2**20  # what is not training state
    result["fixed_mb"] = base
    result["published"] = {}
    print(f"\nExtrapolated largest rank (training state {STATE_BYTES} B/parameter + {base:.0f} MB measured besides it; "
          "activations and AQ-SGD buffers not included):")
    for name, config in PUBLISHED.items():
        for stages in (1, 4, 8):
            per = stage_parameters(config, stages)
            gb = (STATE_BYTES * max(per) / 2**20 + base) / 1024
            result["published"].setdefault(name, {})[stages] = {"largest_stage_parameters": max(per), "gb": gb}
            print(f"  {name:>13} {stages} stage(s): largest stage {max(per) / 1e6:7.1f}M parameters, {gb:6.1f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
