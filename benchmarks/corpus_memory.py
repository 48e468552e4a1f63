"""Host memory against the corpus's size: the largest rank's peak for a tiny, a 60 MB and a 1 GB text corpus.

Each corpus is a local .txt file (the built-in plays, cut or repeated to the size), trained on by the real job:
`torchrun --nproc_per_node 2 -m aqpipe causal-lm --dataset corpus.txt --max_train_samples 0` (every sample), 2
steps, a fresh token cache each time, so local rank 0 tokenizes the corpus during the run and rank 1 maps what it
wrote. The boundary runs uncompressed: AQ-SGD's per-sample buffers grow with the sample count by design
(benchmarks/memory.py), and this measures the data layer. Every rank's peak resident memory is read as it exits
(rank_memory.py's hook); the tokenizing time is the token file's build, timed alone in this process first.
`--before REV` runs the same jobs from another revision (a git worktree), for the figures before memory-mapped
token files.

    python -m benchmarks.corpus_memory                           # tiny, 60 MB, 1 GB
    python -m benchmarks.corpus_memory --sizes 0.5,60 --before HEAD~1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.rank_memory import HOOK, checkouts

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--seq_len", "128", "--micro_batch_size", "2", "--num_micro_batches", "2", "--max_steps", "2",
       "--max_train_samples", "0", "--max_eval_samples", "8", "--forward_compress", "none", "--backward_compress",
       "none"]


def write_corpus(path: Path, megabytes: float) -> int:
    """The plays cut or repeated to `megabytes` (decimal); returns the bytes written."""
    from aqpipe.data import fetch_shakespeare

    plays = fetch_shakespeare().read_bytes()
    target = int(megabytes * 1e6)
    with open(path, "wb") as f:
        written = 0
        while written < target:
            piece = plays[: target - written]
            f.write(piece)
            written += len(piece)
    return written


def tokenize_seconds(corpus: Path, cache: Path) -> float:
    """The time to build the corpus's token file with the job's tokenizer (the built-in BPE), in a fresh cache."""
    code = ("import time, sys; from pathlib import Path; from aqpipe import data; from aqpipe.data.tokens import "
            "token_file; tok = data.load_tokenizer(None); t = time.perf_counter(); token_file(Path(sys.argv[1]), tok);"
            " print(time.perf_counter() - t)")
    env = {**os.environ, "AQPIPE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(corpus)], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"corpus_memory: tokenizing {corpus} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def run_job(checkout: Path, corpus: Path, work: Path, name: str) -> list[float]:
    """The job from `checkout` on `corpus` with a fresh token cache; every rank's peak MB."""
    peaks, hook, cache = work / f"peaks_{name}", work / "hook", work / f"cache_{name}"
    peaks.mkdir(parents=True)
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    cache.mkdir()
    shared = Path(os.environ.get("AQPIPE_CACHE", Path.home() / ".cache" / "aqpipe"))
    for sub in ("data", "tokenizers"):  # the plays and the trained tokenizer: not what is measured
        if (shared / sub).exists():
            os.symlink(shared / sub, cache / sub)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(checkout)]), "AQPIPE_PEAK_DIR": str(peaks),
           "OMP_NUM_THREADS": "1", "AQPIPE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29700 + hash(name) % 200), "-m", "aqpipe", "causal-lm", "--dataset", str(corpus), *JOB,
           "--output_dir", str(work / f"out_{name}")]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"corpus_memory: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [int((peaks / f"rank{r}.kb").read_text()) / 1024 for r in range(2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5,60,1000", help="corpus sizes in MB, the first the tiny one")
    p.add_argument("--before", help="also run the jobs from this git revision of the checkout (a worktree)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    result: dict[str, Any] = {"job": JOB, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with checkouts(work, args.before) as found:
            for size in sizes:
                corpus = work / f"corpus_{size:g}MB.txt"
                nbytes = write_corpus(corpus, size)
                seconds = tokenize_seconds(corpus, work / f"tokenize_{size:g}")
                row = {"bytes": nbytes, "tokenize_s": seconds, "peak_mb": {}}
                for label, checkout in found.items():
                    row["peak_mb"][label] = run_job(checkout, corpus, work, f"{label}_{size:g}")
                    print(f"{size:g} MB corpus, {label}: peak MB by rank "
                          f"{[round(x) for x in row['peak_mb'][label]]} (tokenized in {seconds:.1f} s)", flush=True)
                result["runs"][f"{size:g}"] = row
                corpus.unlink()
    tiny = {label: max(peaks) for label, peaks in result["runs"][f"{sizes[0]:g}"]["peak_mb"].items()}
    print("\n| corpus | tokenizing | " + " | ".join(f"largest rank, {label} | over the tiny corpus"
                                                  for label in tiny) + " |")
    print("|---|---|" + "---|---|" * len(tiny))
    for size, row in result["runs"].items():
        cells = [f"{max(row['peak_mb'][label]):.0f} MB | {max(row['peak_mb'][label]) - tiny[label]:+.0f} MB"
                 for label in tiny if label in row["peak_mb"]]
        print(f"| {float(size):g} MB | {row['tokenize_s']:.1f} s | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
