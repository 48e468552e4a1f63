"""AQ-SGD's buffers at a user's dataset size: every rank's peak memory against the corpus and the run's length.

The job a user runs on their own text with the causal-lm defaults (AQ-SGD, 2-bit changes; the tiny tied Llama of
width 256): `torchrun --nproc_per_node 2 -m aqpipe causal-lm --dataset corpus.txt --max_train_samples 0 --seq_len
64`, on corpora of 30 kB to 600 MB (the plays cut or repeated), for four run lengths: `--max_steps 2` (the 3
default epochs planned, cut to 2 steps), `--epochs 2 --max_steps 2`, `--epochs 1` and `--epochs 2`. Corpora up to
`--full_up_to` MB run to the end; on larger ones a run longer than `--stop_after` steps is stopped there by SIGINT,
as Ctrl-C stops it (each rank exits, writing its peak): what it held by then is its start's and first steps'
memory, rows allocated up front included, while its plan (made at start for the whole run) is in its start line,
quoted in the results. Each corpus is tokenized once, into a cache its runs share.
Every rank's peak resident memory is read as it exits (rank_memory.py's hook); the buffer files' blocks on disk and
the newest checkpoint's bytes (one every 10 steps) are read when the run has stopped.

    python -m benchmarks.buffer_memory --json benchmarks/results/buffer_memory.json      # ~25 min
    python -m benchmarks.buffer_memory --sizes 0.03,60 --before <rev>   # the same jobs from another revision too
    python -m benchmarks.buffer_memory --time_places 3      # a step with rows in memory and on disk, interleaved
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.corpus_memory import write_corpus
from benchmarks.rank_memory import HOOK, ROOT, checkouts

JOB = ["--seq_len", "64", "--max_train_samples", "0", "--max_eval_samples", "8", "--eval_every", "0",
       "--save_every", "10"]
LENGTHS = {"max_steps 2": ["--max_steps", "2"], "2 epochs, max_steps 2": ["--epochs", "2", "--max_steps", "2"],
           "1 epoch": ["--epochs", "1"], "2 epochs": ["--epochs", "2"]}


def tokenize(checkout: Path, corpus: Path, cache: Path) -> None:
    """The corpus's token file, built once in `cache` with the job's tokenizer (the built-in BPE)."""
    code = ("import sys; from pathlib import Path; from aqpipe import data; from aqpipe.data.tokens import token_file; "
            "token_file(Path(sys.argv[1]), data.load_tokenizer(None))")
    env = {**os.environ, "AQPIPE_CACHE": str(cache), "PYTHONPATH": str(checkout)}
    subprocess.run([sys.executable, "-c", code, str(corpus)], env=env, check=True, capture_output=True)


def share_cache(cache: Path) -> None:
    """The plays and the trained tokenizer from the user's cache: not what is measured."""
    shared = Path(os.environ.get("AQPIPE_CACHE", Path.home() / ".cache" / "aqpipe"))
    cache.mkdir(parents=True, exist_ok=True)
    for sub in ("data", "tokenizers"):
        if (shared / sub).exists() and not (cache / sub).exists():
            os.symlink(shared / sub, cache / sub)


def steps_done(metrics: Path) -> int:
    try:
        return sum('"loss"' in line for line in metrics.read_text().splitlines())
    except OSError:
        return 0


def blocks(directory: Path) -> int:
    """Bytes allocated on disk by the files under `directory` (sparse files count only what was written)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


def run_job(checkout: Path, corpus: Path, cache: Path, work: Path, name: str, length: list[str],
            stop_after: int) -> dict[str, Any]:
    """The job from `checkout`, stopped after `stop_after` steps; every rank's peak MB and what it said."""
    peaks, hook, out = work / f"peaks_{name}", work / "hook", work / f"out_{name}"
    peaks.mkdir(parents=True)
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(checkout)]), "AQPIPE_PEAK_DIR": str(peaks),
           "OMP_NUM_THREADS": "1", "AQPIPE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29700 + abs(hash(name)) % 200), "-m", "aqpipe", "causal-lm", "--dataset", str(corpus), *JOB, *length,
           "--output_dir", str(out)]
    started = time.perf_counter()
    with open(work / f"{name}.err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        stopped = False
        while proc.poll() is None:
            if steps_done(out / "metrics.jsonl") >= stop_after:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: every process of the launch
                stopped = True
                break
            time.sleep(0.2)
        proc.wait()
    said = (work / f"{name}.err").read_text()
    if proc.returncode and not stopped:
        raise SystemExit(f"buffer_memory: {' '.join(cmd)} failed:\n{said[-3000:]}")
    lines = [line for line in said.splitlines() if line.startswith(("data:", "AQ-SGD buffers:"))]
    saved = sorted((out / "checkpoints").glob("step_*[0-9]"))
    return {"peak_mb": [int((peaks / f"rank{r}.kb").read_text()) / 1024 for r in range(2)],
            "steps": steps_done(out / "metrics.jsonl"), "stopped": stopped, "said": lines,
            "buffer_files_on_disk": blocks(out / "buffers"), "seconds": time.perf_counter() - started,
            "checkpoint": saved[-1].name if saved else None, "checkpoint_bytes": blocks(saved[-1]) if saved else 0}


def time_places(work: Path, megabytes: float, rounds: int) -> dict[str, list[float]]:
    """What rows on disk cost a step: the 2-epoch job on a corpus whose rows fit memory, with them in memory and on
    disk (`--buffer_memory_gb 0`), interleaved `rounds` times; each run's median seconds a step in epoch 2, where
    every step reads and writes its samples' rows."""
    import statistics

    corpus, cache = work / "timed.txt", work / "cache_timed"
    write_corpus(corpus, megabytes)
    share_cache(cache)
    tokenize(ROOT, corpus, cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AQPIPE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    out: dict[str, list[float]] = {"memory": [], "disk": []}  # JOB without its checkpoints (its last two flags)
    for r in range(rounds):
        for place, flags in (("memory", []), ("disk", ["--buffer_memory_gb", "0"])):
            run_dir = work / f"timed_{place}_{r}"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(29650 + r), "-m", "aqpipe", "causal-lm", "--dataset", str(corpus), *JOB[:-2],
                            "--epochs", "2", "--output_dir", str(run_dir), *flags], env=env, check=True,
                           capture_output=True)
            steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out[place].append(statistics.median(s["seconds"] for s in steps if s.get("epoch") == 1))
            print(f"{place}, round {r + 1}: {out[place][-1] * 1e3:.1f} ms a step in epoch 2", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.03,1,60,600", help="corpus sizes in MB, the first the tiny one")
    p.add_argument("--lengths", default=";".join(LENGTHS), help=f"run lengths, of: {'; '.join(LENGTHS)}")
    p.add_argument("--stop_after", type=int, default=20, help="steps after which a longer run is stopped")
    p.add_argument("--full_up_to", type=float, default=1.0, help="corpora up to this many MB run to the end")
    p.add_argument("--before", help="also run the jobs from this git revision of the checkout (a worktree)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--time_places", type=int, default=0, metavar="ROUNDS",
                   help="instead: time a 2-epoch job on a 1 MB corpus, its rows in memory and on disk, ROUNDS times")
    args = p.parse_args(argv)
    if args.time_places:
        with tempfile.TemporaryDirectory() as tmp:
            timed = time_places(Path(tmp), 1.0, args.time_places)
        ratios = [d / m for m, d in zip(timed["memory"], timed["disk"])]
        print(f"disk / memory, a step in epoch 2: {', '.join(f'{x:.3f}' for x in ratios)}")
        if args.json:
            Path(args.json).write_text(json.dumps({"job": JOB, "seconds_a_step": timed, "ratios": ratios}, indent=2))
        return 0
    sizes, lengths = [float(s) for s in args.sizes.split(",")], args.lengths.split(";")
    result: dict[str, Any] = {"job": JOB, "stop_after": args.stop_after, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with checkouts(work, args.before) as found:
            for size in sizes:
                corpus, cache = work / f"corpus_{size:g}MB.txt", work / f"cache_{size:g}"
                write_corpus(corpus, size)
                share_cache(cache)
                tokenize(found["now"], corpus, cache)
                for length in lengths:
                    stop = 10**9 if size <= args.full_up_to else args.stop_after
                    for label, checkout in found.items():
                        name = f"{label}_{size:g}_{length.replace(' ', '').replace(',', '')}"
                        row = run_job(checkout, corpus, cache, work, name, LENGTHS[length], stop)
                        result["runs"][f"{label} | {size:g} MB | {length}"] = row
                        print(f"{size:g} MB, {length}, {label}: peak MB by rank {[round(x) for x in row['peak_mb']]}, "
                              f"{row['steps']} steps, buffer files {row['buffer_files_on_disk'] / 1e6:.1f} MB on "
                              f"disk, {row['checkpoint']} {row['checkpoint_bytes'] / 1e6:.1f} MB\n  "
                              + "\n  ".join(row["said"]), flush=True)
                corpus.unlink()
    tiny = {}
    print("\n| corpus | run | code | largest rank's peak | over the tiny corpus | buffer files on disk | newest "
          "checkpoint | plan |")
    print("|---|---|---|---|---|---|---|---|")
    for key, row in result["runs"].items():
        label, size, length = key.split(" | ")
        peak = max(row["peak_mb"])
        tiny.setdefault((label, length), peak)
        plan = next((line for line in row["said"] if line.startswith("AQ-SGD")), "(no plan line)")
        print(f"| {size} | {length} | {label} | {peak:.0f} MB | {peak - tiny[(label, length)]:+.0f} MB | "
              f"{row['buffer_files_on_disk'] / 1e6:.1f} MB | {row['checkpoint'] or '-'}: "
              f"{row['checkpoint_bytes'] / 1e6:.1f} MB | {plan} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
