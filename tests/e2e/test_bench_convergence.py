"""benchmarks/convergence.py --quick: two real 2-stage runs, their table, JSON and plot.

One quick study (FP32 and AQ-SGD fw2/bw4 on a tiny GPT2, 2 epochs) is shared by the checks, since
each torchrun launch costs seconds of imports.
"""
import json
import math

import pytest


from benchmarks import convergence  # noqa: E402
from benchmarks.convergence_plot import smooth  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    assert convergence.main(["--quick", "--output_dir", str(out)]) == 0
    return out, json.loads((out / "convergence.json").read_text())


def test_quick_study_records_every_method_with_finite_figures(quick):
    _, results = quick
    block = results["models"]["gpt2"]
    runs = {r["method"]: r for r in block["runs"]}
    assert list(runs) == ["fp32", "aqsgd_2_4"]
    for r in runs.values():
        assert r["steps"] == len(r["loss"]) == 16 and r["steps_per_epoch"] == 8  # 32 samples / (2 x 2), 2 epochs
        for key in ("train_loss", "eval_loss", "eval_perplexity", "train_loss_ratio", "eval_loss_ratio"):
            assert math.isfinite(r[key]), key
        assert r["train_loss"] == pytest.approx(sum(r["loss"][-8:]) / 8, abs=1e-4)
        assert [step for step, _, _ in r["eval_curve"]] == [8, 16]  # once an epoch
        assert r["eval_curve"][-1][1] == pytest.approx(r["eval_loss"])
    assert runs["fp32"]["eval_loss_ratio"] == 1.0
    # same seed and data order: before any update both compute the same batch, AQ-SGD's boundary through a
    # full-precision first visit, so the first losses are equal to the bit
    assert runs["aqsgd_2_4"]["loss"][0] == runs["fp32"]["loss"][0]
    # AQ-SGD's second epoch sends 2-bit deltas: fewer forward bytes than FP32 in all
    assert runs["aqsgd_2_4"]["fwd_bytes"] < runs["fp32"]["fwd_bytes"]
    assert block["goal"]["aqsgd_2_4_eval_ratio"] == runs["aqsgd_2_4"]["eval_loss_ratio"]


def test_quick_study_writes_a_png_per_model_and_can_redraw_it(quick):
    out, _ = quick
    png = out / "convergence_gpt2.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    png.unlink()
    assert convergence.main(["--quick", "--output_dir", str(out), "--replot"]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_reuse_reads_finished_runs_instead_of_launching_them(quick):
    out, results = quick
    metrics = out / "gpt2" / "fp32" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    assert convergence.main(["--quick", "--output_dir", str(out), "--reuse", "--json", str(out / "again.json")]) == 0
    assert metrics.stat().st_mtime_ns == before
    again = json.loads((out / "again.json").read_text())["models"]["gpt2"]["runs"]
    assert [r["eval_loss"] for r in again] == [r["eval_loss"] for r in results["models"]["gpt2"]["runs"]]


def test_table_has_one_row_per_method_with_ratios(quick):
    _, results = quick
    table = convergence.markdown_table("gpt2", results["models"]["gpt2"]["runs"], "perplexity").splitlines()
    assert len(table) == 4 and table[2].startswith("| FP32 | ") and "| 1.000 |" in table[2]


def test_methods_cover_fp32_and_both_codecs_at_each_bit_pair():
    names = [m.name for m in convergence.METHODS]
    assert names[0] == "fp32" and len(names) == 7
    for fw, bw in convergence.BIT_PAIRS:
        assert {f"directq_{fw}_{bw}", f"aqsgd_{fw}_{bw}"} <= set(names)
    assert "--forward_bits" not in convergence.METHODS[0].flags()  # FP32 sends no bits
    ablation = {m.name: m for m in convergence.ABLATIONS}["aqsgd_2_fp32bw"].flags()
    assert ablation == ["--forward_compress", "aqsgd", "--backward_compress", "none", "--forward_bits", "2"]


def test_smooth_is_a_trailing_mean():
    assert smooth([4.0, 2.0, 0.0, 2.0], 2) == [4.0, 3.0, 1.0, 1.0]
