"""benchmarks/memory.py: the buffers the engine allocates are exactly the formula's bytes."""
import json



from benchmarks import memory  # noqa: E402



def test_quick_memory_table_measures_what_the_formula_says(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--json", str(out), "--buffer_dir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    assert {r["dtype"] for r in results["measured"]} == {"float16", "float32", "8-bit", "4-bit"}
    for r in results["measured"]:
        s = r["shape"]
        elements = s["samples"] * s["seq_len"] * s["hidden"]
        per_element = {"float16": 2, "float32": 4, "8-bit": 1, "4-bit": 0.5}[r["dtype"]]
        scales = 8 * s["samples"] * s["seq_len"] if r["dtype"].endswith("bit") else 0  # min and step per token
        assert r["formula_bytes"] == elements * per_element + scales
        assert r["memory_bytes_new"] == 0  # a row takes memory when it is first written
        assert r["memory_bytes"] == r["formula_bytes"] + 4 * s["samples"]  # + a 4-byte slot per sample
        assert r["file_bytes"] == r["file_allocated_full"] == r["formula_bytes"]
        assert r["file_allocated_empty"] == r["formula_bytes"]  # the blocks reserved when the file is made
    assert "| yes |" in capsys.readouterr().out
    assert not list(tmp_path.glob("tmp*/*.buf"))  # the buffer files are removed


def test_formula_rows_for_the_papers_models():
    rows = {(r["shape"]["name"].split()[0], r["dtype"]): r for r in
            (memory.formula(s, kind) for s in memory.FORMULA for kind in memory.BUFFERS)}
    gpt2 = rows[("GPT2-1.5B", "float16")]
    assert gpt2["formula_bytes"] == 2318 * 1024 * 1600 * 2
    assert gpt2["middle_stage_bytes"] == 2 * gpt2["end_stage_bytes"]
    assert gpt2["pipeline_bytes"] == 14 * gpt2["end_stage_bytes"]  # 8 stages: 7 boundaries x 2 sides
    assert rows[("DeBERTa-1.5B", "float32")]["formula_bytes"] == 2 * rows[("DeBERTa-1.5B", "float16")]["formula_bytes"]
    # 8 bits: half of float16 plus 8 bytes per 1600-value token (0.5025); 4 bits a quarter plus the same
    assert rows[("GPT2-1.5B", "8-bit")]["vs_float16"] == (1600 + 8) / 3200
    assert rows[("GPT2-1.5B", "4-bit")]["formula_bytes"] == 2318 * 1024 * (800 + 8)


def test_two_stage_shape_has_no_middle_stage():
    shape = memory.Shape("x", 8, 4, 2, 2, "test")
    assert shape.per_stage("float16") == (8 * 4 * 2 * 2 + 4 * 8, 0)  # rows + a 4-byte slot a sample
