"""AQ-SGD buffer memory per pipeline stage: measured for the benchmark shapes, by formula for 1.5B models.

AQ-SGD keeps m[ξ] (seq_len x hidden values) for every training sample a run reads back, on both sides
of every boundary, so a first or last stage holds one buffer and a middle stage two. This is the price
of its convergence, and it grows with the dataset, not the batch: the table says when it fits in RAM
and when it needs a file (the trainer plans this at start: aqpipe/buffer_plan.py).

The measured rows build the buffers exactly as the engine does (`forward_codec("aqsgd", ...)`), write one
epoch's rows and read what they hold: the rows' bytes in memory (a row takes memory when first written:
none before); the file's size and the blocks the file system allocated before and after every row was
written, on disk (reserved when the file is made). Each must equal the formula num_samples x seq_len x
hidden x bytes per element (plus a 4-byte slot per sample); for quantized buffers (--buffer_bits 8 or 4)
num_samples x seq_len x (hidden x bits/8 + 8), each token's hidden vector carrying its float32 min and step.

    python -m benchmarks.memory                  # benchmark shapes measured + 1.5B models by formula
    python -m benchmarks.memory --quick --json /tmp/memory.json   # tiny shape, for the tests
    python -m benchmarks.memory --per_rank      # the trainer's peak host memory per rank at 1, 2, 4 stages
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

from aqpipe.compression import forward_codec  # noqa: E402

BUFFERS = {"float16": (torch.float16, None), "float32": (torch.float32, None),  # name: (buffer_dtype, buffer_bits)
           "8-bit": (torch.float16, 8), "4-bit": (torch.float16, 4)}
ROOT = Path(__file__).resolve().parents[1]
SLOT_BYTES = 4  # a buffer's slot table: each sample's row, or none


@dataclass(frozen=True)
class Shape:
    """What sizes one boundary buffer: a dataset, its padded sequence length, the model width, the stages."""

    name: str
    samples: int
    seq_len: int
    hidden: int
    stages: int
    source: str  # where the numbers come from

    def buffer_bytes(self, kind: str) -> int:
        """Bytes of m[ξ] for one side of one boundary: samples x seq_len x hidden x element size, or for a
        quantized buffer samples x seq_len x (hidden x bits / 8 + 8: a float32 min and step per token)."""
        dtype, bits = BUFFERS[kind]
        per_token = self.hidden * dtype.itemsize if bits is None else self.hidden * bits // 8 + 8
        return self.samples * self.seq_len * per_token

    def per_stage(self, kind: str) -> tuple[int, int]:
        """(first or last stage, middle stage): one buffer on an end stage, two on a middle one."""
        one = self.buffer_bytes(kind) + SLOT_BYTES * self.samples  # + the slot table, 4 bytes a sample
        return one, (2 * one if self.stages > 2 else 0)

    def pipeline_total(self, kind: str) -> int:
        """All stages together: two sides of each of the stages - 1 boundaries."""
        return 2 * (self.stages - 1) * (self.buffer_bytes(kind) + SLOT_BYTES * self.samples)


MEASURED = [  # the shapes the benchmarks and the default recipe actually run (2 stages, width 128)
    Shape("GPT2 tiny, convergence study", 512, 128, 128, 2, "benchmarks/convergence.py"),
    Shape("DeBERTa tiny, convergence study", 1024, 64, 128, 2, "benchmarks/convergence.py"),
    Shape("GPT2 tiny, default recipe", 1024, 128, 128, 2, "aqpipe gpt2 (its defaults)"),
]
QUICK = [Shape("tiny (test)", 64, 32, 64, 2, "--quick")]
FORMULA = [  # the paper's fine-tuning setups (AQ-SGD, 004): 1.5B models, 8 pipeline stages
    Shape("GPT2-1.5B (gpt2-xl) on WikiText-2", 2318, 1024, 1600, 8,
          "wikitext-2-raw-v1 train as GPT-2 BPE (~2.37M tokens) in blocks of 1024 (HF run_clm)"),
    Shape("DeBERTa-1.5B (deberta-v2-xxlarge) on QNLI", 104743, 256, 1536, 8,
          "GLUE QNLI train set, question + sentence padded to 256 tokens"),
]


def measure(shape: Shape, kind: str, workdir: Path) -> dict[str, Any]:
    """Allocate one boundary side's buffer as the engine does, in memory and as a file; read its real size."""
    dtype, bits = BUFFERS[kind]
    kw = {"num_samples": shape.samples, "sample_shape": (shape.seq_len, shape.hidden), "buffer_dtype": dtype,
          "buffer_bits": bits}
    in_memory = forward_codec("aqsgd", 2, **kw).buffer
    memory_new = in_memory.nbytes
    path = workdir / f"{shape.samples}x{shape.seq_len}x{shape.hidden}_{kind}.buf"
    on_disk = forward_codec("aqsgd", 2, buffer_path=path, **kw).buffer
    reserved = os.stat(path).st_blocks * 512  # made with its blocks reserved (no write can meet a full disk)
    ids = torch.arange(shape.samples)
    for start in range(0, shape.samples, 64):  # one epoch's first visits: every row written once
        chunk = ids[start:start + 64]
        rows = torch.ones(chunk.numel(), shape.seq_len, shape.hidden)
        for buffer in (in_memory, on_disk):
            buffer.store(chunk, buffer.prepare(chunk, rows)[0])
    st = os.stat(path)
    row = {
        "shape": asdict(shape), "dtype": kind,
        "formula_bytes": shape.buffer_bytes(kind), "slot_bytes": in_memory.index_nbytes,
        "memory_bytes_new": memory_new, "memory_bytes": in_memory.nbytes + in_memory.index_nbytes,
        "file_bytes": st.st_size, "file_allocated_empty": reserved, "file_allocated_full": st.st_blocks * 512,
    }
    del in_memory, on_disk
    path.unlink()
    return row


def formula(shape: Shape, kind: str) -> dict[str, Any]:
    end, middle = shape.per_stage(kind)
    return {"shape": asdict(shape), "dtype": kind,
            "formula_bytes": shape.buffer_bytes(kind), "slot_bytes": SLOT_BYTES * shape.samples,
            "vs_float16": shape.buffer_bytes(kind) / shape.buffer_bytes("float16"),
            "end_stage_bytes": end, "middle_stage_bytes": middle, "pipeline_bytes": shape.pipeline_total(kind)}


def human(n: float) -> str:
    """Bytes in the unit a reader compares against RAM and disks (MB, GB: powers of 10)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if n < 100 * size else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def measured_table(rows: list[dict[str, Any]]) -> str:
    """Exact bytes, so the reader sees measured == formula; the slot table is counted apart."""
    lines = ["| shape (samples x seq x hidden) | buffer | formula bytes | vs float16 | in memory, new | in memory, "
             "after one epoch | file size | file blocks, new (reserved) | file blocks, after one epoch | = formula | "
             "per stage (2 stages) |", "|" + "---|" * 11]
    for r in rows:
        s = r["shape"]
        ok = r["memory_bytes"] - r["slot_bytes"] == r["file_bytes"] == r["file_allocated_full"] == r["formula_bytes"]
        half = Shape(**s).buffer_bytes("float16")
        lines.append(f"| {s['name']} ({s['samples']} x {s['seq_len']} x {s['hidden']}) | {r['dtype']} "
                     f"| {r['formula_bytes']:,} | {r['formula_bytes'] / half:.3f} | {r['memory_bytes_new']:,} "
                     f"| {r['memory_bytes'] - r['slot_bytes']:,} + {r['slot_bytes']:,} slots "
                     f"| {r['file_bytes']:,} | {r['file_allocated_empty']:,} | {r['file_allocated_full']:,} "
                     f"| {'yes' if ok else '**no**'} | {human(r['formula_bytes'] + r['slot_bytes'])} |")
    return "\n".join(lines)


def formula_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model and data (samples x seq x hidden, stages) | buffer | one boundary side | vs float16 "
             "| first / last stage | middle stage | whole pipeline |", "|" + "---|" * 7]
    for r in rows:
        s = r["shape"]
        lines.append(f"| {s['name']} ({s['samples']} x {s['seq_len']} x {s['hidden']}, {s['stages']}) "
                     f"| {r['dtype']} | {human(r['formula_bytes'])} | {r['vs_float16']:.3f} "
                     f"| {human(r['end_stage_bytes'])} "
                     f"| {human(r['middle_stage_bytes'])} | {human(r['pipeline_bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--per_rank" in argv:  # the trainer's peak host memory per rank (benchmarks/rank_memory.py)
        from benchmarks import rank_memory

        return rank_memory.main([a for a in argv if a != "--per_rank"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="measure only a tiny shape (for the tests)")
    p.add_argument("--json", default=None, help="results file (default: benchmarks/results/memory.json; "
                                                 "none with --quick unless given)")
    p.add_argument("--buffer_dir", default=None, help="where the file-backed buffers are made (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.buffer_dir) as tmp:
        measured = [measure(s, kind, Path(tmp)) for s in (QUICK if args.quick else MEASURED) for kind in BUFFERS]
    by_formula = [formula(s, kind) for s in FORMULA for kind in BUFFERS]
    print("Measured (one boundary side; a 2-stage pipeline keeps one per stage):\n")
    print(measured_table(measured))
    print("\nBy formula (samples x seq_len x hidden x bytes, or x (hidden x bits/8 + 8) quantized; + a 4-byte slot "
          "per sample; a middle stage keeps two buffers):\n")
    print(formula_table(by_formula))
    mismatched = [r for r in measured if not r["memory_bytes"] - r["slot_bytes"] == r["file_bytes"]
                  == r["formula_bytes"] or r["memory_bytes_new"]]
    if mismatched:
        print(f"\nmeasured != formula for {len(mismatched)} rows", file=sys.stderr)
    json_path = args.json or (None if args.quick else str(ROOT / "benchmarks" / "results" / "memory.json"))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"measured": measured, "formula": by_formula}, indent=1))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
