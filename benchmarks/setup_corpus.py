"""Set-up on a large corpus, as a user's own text file meets it: seconds, peak memory, and whether a bar shows.

    python -m benchmarks.setup_corpus [--mb 100] [--quick]

Writes an N MB text file (the built-in plays, repeated), then in a fresh process with an empty token cache builds
the causal-LM train split from it with the trainer's tokenizer (`lm_dataset`, what local rank 0 does at start), and
reports the wall time, that process's peak resident memory, the tokens, and whether a progress bar was printed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
from aqpipe import data
tok = data.load_tokenizer(None)
started = time.perf_counter()
train = data.lm_dataset(sys.argv[1], tok, 128, split="train")
print(json.dumps({"seconds": time.perf_counter() - started, "samples": len(train), "tokens": len(train) * 128}))
"""


def measure(corpus: Path, cache: Path) -> dict:
    """lm_dataset over `corpus` in a fresh process with an empty token cache; its peak RSS from wait4."""
    if (cache / "tokens").exists():
        shutil.rmtree(cache / "tokens")
    env = {**os.environ, "AQPIPE_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(corpus)], env=env, cwd=corpus.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"setup_corpus: the child failed:\n{err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["bar"] = "tokenizing" in err
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=100.0, help="corpus size in MB")
    p.add_argument("--quick", action="store_true", help="a 10 MB corpus")
    args = p.parse_args(argv)
    mb = 10.0 if args.quick else args.mb
    from aqpipe.data import cache_root, fetch_shakespeare

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        plays = fetch_shakespeare().read_text(encoding="utf-8")
        corpus = tmp_path / "corpus.txt"
        with corpus.open("w", encoding="utf-8") as f:
            written = 0
            while written < mb * 1e6:
                f.write(plays)
                written += len(plays.encode("utf-8"))
        cache = tmp_path / "cache"
        for part in ("data", "tokenizers"):  # the corpus and the trained tokenizer: not what is measured
            shutil.copytree(cache_root() / part, cache / part)
        result = measure(corpus, cache)
        result.update(corpus_mb=round(corpus.stat().st_size / 1e6, 1), peak_rss_mb=round(_children_peak(), 1))
    print(json.dumps(result))
    return result


def _children_peak() -> float:
    """Peak resident memory (MB) of the largest child this process has waited for: here, the one measured."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux reports kB


if __name__ == "__main__":
    main()
