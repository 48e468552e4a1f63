"""AQ-SGD buffer memory per pipeline stage: measured for the benchmark shapes, by formula for 1.5B models.

AQ-SGD keeps m[ξ] (seq_len x hidden values) for every training sample on both sides of every
boundary, so a first or last stage holds one buffer and a middle stage two. This is the price of
its convergence, and it grows with the dataset, not the batch: the table says when it fits in RAM
and when it needs --buffer_dir (a sparse memory-mapped file).

The measured rows build the buffers exactly as the engine does (`ForwardCodec("aqsgd", ...)`) and
read the real allocation: the tensor's storage in memory; the file's size and the blocks the file
system allocated after every row was written, on disk. Each must equal the formula
num_samples x seq_len x hidden x bytes per element (plus one "seen" byte per sample).

    python -m benchmarks.memory                  # benchmark shapes measured + 1.5B models by formula
    python -m benchmarks.memory --quick --json /tmp/memory.json   # tiny shape, for the tests
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from compression import ForwardCodec  # noqa: E402

DTYPES = {"float16": torch.float16, "float32": torch.float32}
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """What sizes one boundary buffer: a dataset, its padded sequence length, the model width, the stages."""

    name: str
    samples: int
    seq_len: int
    hidden: int
    stages: int
    source: str  # where the numbers come from

    def buffer_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of m[ξ] for one side of one boundary: samples x seq_len x hidden x element size."""
        return self.samples * self.seq_len * self.hidden * dtype.itemsize

    def per_stage(self, dtype: torch.dtype) -> tuple[int, int]:
        """(first or last stage, middle stage): one buffer on an end stage, two on a middle one."""
        one = self.buffer_bytes(dtype) + self.samples  # + the seen bits, one bool per sample
        return one, (2 * one if self.stages > 2 else 0)

    def pipeline_total(self, dtype: torch.dtype) -> int:
        """All stages together: two sides of each of the stages - 1 boundaries."""
        return 2 * (self.stages - 1) * (self.buffer_bytes(dtype) + self.samples)


MEASURED = [  # the shapes the benchmarks and the default recipe actually run (2 stages, width 128)
    Shape("GPT2 tiny, convergence study", 512, 128, 128, 2, "benchmarks/convergence.py"),
    Shape("DeBERTa tiny, convergence study", 1024, 64, 128, 2, "benchmarks/convergence.py"),
    Shape("GPT2 tiny, default recipe", 1024, 128, 128, 2, "recipes/configs/gpt2.json"),
]
QUICK = [Shape("tiny (test)", 64, 32, 64, 2, "--quick")]
FORMULA = [  # the paper's fine-tuning setups (AQ-SGD, 004): 1.5B models, 8 pipeline stages
    Shape("GPT2-1.5B (gpt2-xl) on WikiText-2", 2318, 1024, 1600, 8,
          "wikitext-2-raw-v1 train as GPT-2 BPE (~2.37M tokens) in blocks of 1024 (HF run_clm)"),
    Shape("DeBERTa-1.5B (deberta-v2-xxlarge) on QNLI", 104743, 256, 1536, 8,
          "GLUE QNLI train set, question + sentence padded to 256 tokens"),
]


def measure(shape: Shape, dtype: torch.dtype, workdir: Path) -> dict[str, Any]:
    """Allocate one boundary side's buffer as the engine does, in memory and as a file; read its real size."""
    kw = {"num_samples": shape.samples, "sample_shape": (shape.seq_len, shape.hidden), "buffer_dtype": dtype}
    in_memory = ForwardCodec("aqsgd", 2, **kw).buffer
    memory_bytes = in_memory.values.untyped_storage().nbytes() + in_memory.seen.untyped_storage().nbytes()
    del in_memory
    path = workdir / f"{shape.samples}x{shape.seq_len}x{shape.hidden}_{dtype}.buf"
    on_disk = ForwardCodec("aqsgd", 2, buffer_path=path, **kw).buffer
    sparse_blocks = os.stat(path).st_blocks * 512  # created sparse: nothing allocated before a row is written
    ids = torch.arange(shape.samples)
    for start in range(0, shape.samples, 64):  # one epoch's first visits: every row written once
        chunk = ids[start:start + 64]
        on_disk.store(chunk, torch.ones(chunk.numel(), shape.seq_len, shape.hidden))
    st = os.stat(path)
    row = {
        "shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."),
        "formula_bytes": shape.buffer_bytes(dtype), "seen_bytes": shape.samples,
        "memory_bytes": memory_bytes, "file_bytes": st.st_size, "file_allocated_empty": sparse_blocks,
        "file_allocated_full": st.st_blocks * 512,
    }
    del on_disk
    path.unlink()
    return row


def formula(shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    end, middle = shape.per_stage(dtype)
    return {"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."),
            "formula_bytes": shape.buffer_bytes(dtype), "seen_bytes": shape.samples,
            "end_stage_bytes": end, "middle_stage_bytes": middle, "pipeline_bytes": shape.pipeline_total(dtype)}


def human(n: float) -> str:
    """Bytes in the unit a reader compares against RAM and disks (MB, GB: powers of 10)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if n < 100 * size else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def measured_table(rows: list[dict[str, Any]]) -> str:
    """Exact bytes, so the reader sees measured == formula; the seen bits are counted apart."""
    lines = ["| shape (samples x seq x hidden) | buffer | formula bytes | in memory, measured | file size "
             "| file blocks, new (sparse) | file blocks, after one epoch | = formula | per stage (2 stages) |",
             "|" + "---|" * 9]
    for r in rows:
        s = r["shape"]
        ok = r["memory_bytes"] - r["seen_bytes"] == r["file_bytes"] == r["file_allocated_full"] == r["formula_bytes"]
        lines.append(f"| {s['name']} ({s['samples']} x {s['seq_len']} x {s['hidden']}) | {r['dtype']} "
                     f"| {r['formula_bytes']:,} | {r['memory_bytes'] - r['seen_bytes']:,} + {r['seen_bytes']:,} seen "
                     f"| {r['file_bytes']:,} | {r['file_allocated_empty']:,} | {r['file_allocated_full']:,} "
                     f"| {'yes' if ok else '**no**'} | {human(r['formula_bytes'] + r['seen_bytes'])} |")
    return "\n".join(lines)


def formula_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model and data (samples x seq x hidden, stages) | buffer | one boundary side | first / last stage "
             "| middle stage | whole pipeline |", "|" + "---|" * 6]
    for r in rows:
        s = r["shape"]
        lines.append(f"| {s['name']} ({s['samples']} x {s['seq_len']} x {s['hidden']}, {s['stages']}) "
                     f"| {r['dtype']} | {human(r['formula_bytes'])} | {human(r['end_stage_bytes'])} "
                     f"| {human(r['middle_stage_bytes'])} | {human(r['pipeline_bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="measure only a tiny shape (for the tests)")
    p.add_argument("--json", default=None, help="results file (default: benchmarks/results/memory.json; "
                                                 "none with --quick unless given)")
    p.add_argument("--buffer_dir", default=None, help="where the file-backed buffers are made (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.buffer_dir) as tmp:
        measured = [measure(s, d, Path(tmp)) for s in (QUICK if args.quick else MEASURED) for d in DTYPES.values()]
    by_formula = [formula(s, d) for s in FORMULA for d in DTYPES.values()]
    print("Measured (one boundary side; a 2-stage pipeline keeps one per stage):\n")
    print(measured_table(measured))
    print("\nBy formula (samples x seq_len x hidden x bytes, + 1 seen byte per sample; "
          "a middle stage keeps two buffers):\n")
    print(formula_table(by_formula))
    mismatched = [r for r in measured if not r["memory_bytes"] - r["seen_bytes"] == r["file_bytes"]
                  == r["formula_bytes"]]
    if mismatched:
        print(f"\nmeasured != formula for {len(mismatched)} rows", file=sys.stderr)
    json_path = args.json or (None if args.quick else str(ROOT / "benchmarks" / "results" / "memory.json"))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"measured": measured, "formula": by_formula}, indent=1))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
