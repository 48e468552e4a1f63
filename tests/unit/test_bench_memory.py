"""benchmarks/memory.py: the buffers the engine allocates are exactly the formula's bytes."""
import json

import torch


from benchmarks import memory  # noqa: E402



def test_quick_memory_table_measures_what_the_formula_says(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--json", str(out), "--buffer_dir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    assert {r["dtype"] for r in results["measured"]} == {"float16", "float32"}
    for r in results["measured"]:
        s = r["shape"]
        elements = s["samples"] * s["seq_len"] * s["hidden"]
        assert r["formula_bytes"] == elements * (2 if r["dtype"] == "float16" else 4)
        assert r["memory_bytes"] == r["formula_bytes"] + s["samples"]  # + one seen bool per sample
        assert r["file_bytes"] == r["file_allocated_full"] == r["formula_bytes"]
        assert r["file_allocated_empty"] < r["formula_bytes"] // 4  # created sparse
    assert "| yes |" in capsys.readouterr().out
    assert not list(tmp_path.glob("tmp*/*.buf"))  # the buffer files are removed


def test_formula_rows_for_the_papers_models():
    rows = {(r["shape"]["name"].split()[0], r["dtype"]): r for r in
            (memory.formula(s, d) for s in memory.FORMULA for d in memory.DTYPES.values())}
    gpt2 = rows[("GPT2-1.5B", "float16")]
    assert gpt2["formula_bytes"] == 2318 * 1024 * 1600 * 2
    assert gpt2["middle_stage_bytes"] == 2 * gpt2["end_stage_bytes"]
    assert gpt2["pipeline_bytes"] == 14 * gpt2["end_stage_bytes"]  # 8 stages: 7 boundaries x 2 sides
    assert rows[("DeBERTa-1.5B", "float32")]["formula_bytes"] == 2 * rows[("DeBERTa-1.5B", "float16")]["formula_bytes"]


def test_two_stage_shape_has_no_middle_stage():
    shape = memory.Shape("x", 8, 4, 2, 2, "test")
    assert shape.per_stage(torch.float16) == (8 * 4 * 2 * 2 + 8, 0)
