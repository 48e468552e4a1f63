"""The demo, the benchmark and the package boundaries, run as a user would."""
import json
import subprocess
import sys


from benchmarks import bench_codecs, bench_data_parallel, bench_quantize  # noqa: E402
from recipes import codec_demo  # noqa: E402

from tests.helpers.processes import ROOT, checkout_env


def test_codec_demo_aqsgd_tracks_fp32_where_directq_falls_behind(tmp_path):
    out = tmp_path / "demo.json"
    assert codec_demo.main(["--json", str(out)]) == 0
    r = {row["mode"]: row for row in json.loads(out.read_text())["results"]}
    fp32, direct, aq = r["none"], r["direct"], r["aqsgd"]
    epochs = 8
    # AQ-SGD: the first epoch in full precision, every later one as small as DirectQ's
    assert aq["forward_bytes"] == fp32["forward_bytes"] // epochs + direct["forward_bytes"] * (epochs - 1) // epochs
    gap_aq = aq["final_epoch_loss"] - fp32["final_epoch_loss"]
    gap_direct = direct["final_epoch_loss"] - fp32["final_epoch_loss"]
    assert gap_aq < gap_direct / 3


def test_bench_quantize_prints_and_records_every_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_quantize.main(["--shape", "2,8,64", "--repeats", "1", "--backends", "native,triton,torch",
                         "--group_sizes", "16", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["bits"]) for r in rows] == [(b, n) for b in ("native", "triton", "torch")
                                                         for n in (1, 2, 4, 8)]
    assert all(r["same_bytes_as_cpu"] for r in rows)  # triton in its interpreter here
    two = next(r for r in rows if r["bits"] == 2)
    assert abs(two["compression"] - 2 * 8 * 64 * 4 / (2 * 8 * 16 + 2 * 8 * 8)) < 1e-9
    c_q = [r["c_Q"] for r in rows[:4]]
    assert c_q == sorted(c_q, reverse=True) and c_q[-1] < 0.05
    assert "round/clone" in capsys.readouterr().out


def test_bench_codecs_times_every_setting_on_both_sides(capsys):
    assert bench_codecs.main(["--shape", "2,8,16", "--repeats", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == list(bench_codecs.SETTINGS)
    assert all(len(r) == 5 and all(float(v) > 0 for v in r[1:]) for r in rows)  # a time measured is never 0


def test_compression_imports_nothing_of_the_pipeline_or_hf():
    code = ("import sys, aqpipe.compression; "
            "bad = sorted({m for m in sys.modules if m.split('.')[0] in ('transformers', 'deepspeed', 'datasets') "
            "or m.startswith(('aqpipe.pipeline', 'aqpipe.data_parallel', 'aqpipe.train', 'aqpipe.config'))}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=checkout_env())


def test_bench_data_parallel_reads_a_run_and_times_only_the_steps_after_the_first_epoch(tmp_path):
    # 32 samples, 2 replicas, 2 x 2 samples a replica's step: 4 steps an epoch, each sample sent whole in them
    seconds = [9.0, 9.0, 9.0, 9.0, 1.0, 2.0, 6.0]
    rows = [{"step": t + 1, "loss": 8.0 - t, "seconds": sec, "dp_bytes": 100 * (t + 1), "fwd_bytes": 7}
            for t, sec in enumerate(seconds)] + [{"step": 7, "eval_loss": 2.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({
        "train_samples": 32, "eval_loss": 2.5, "seconds": 40.0,
        "config": {"micro_batch_size": 2, "num_micro_batches": 2}}))
    row = bench_data_parallel.figures(tmp_path, "cocktail_sgd", 2)
    assert row["seconds_per_step"] == 2.0 and row["seconds_per_step_mean"] == 3.0  # steps 5-7 only
    assert row["steps"] == 7 and row["dp_bytes_per_step"] == 400 and row["dp_bytes_last_step"] == 700
    assert row["loss_first_5"] == 6.0 and row["eval_loss"] == 2.5
    assert row["wire_bytes_last_step"] == {"fwd_bytes": 7, "bwd_bytes": 0, "tie_bytes": 0, "dp_bytes": 700}


def test_bench_auto_bits_verdict_names_what_beats_auto():
    from benchmarks import bench_auto_bits

    def row(method, seconds, loss, fwd):
        return {"method": method, "seconds_per_step": seconds, "eval_loss": loss, "bits": None,
                "bytes_per_step": {"fwd_bytes": fwd, "bwd_bytes": 0, "tie_bytes": 0, "dp_bytes": 0}}

    rows = [row("aqsgd_2_4", 0.50, 5.60, 100), row("aqsgd_8_8", 0.90, 5.40, 300), row("auto", 0.49, 5.45, 200)]
    v = bench_auto_bits.verdict(rows)
    assert v["fastest_fixed"] == "aqsgd_2_4" and v["auto_vs_fastest_speed"] == 0.50 / 0.49
    assert v["auto_better_loss_than_fastest"] and not v["auto_fewer_bytes_than_fastest"]
    assert v["fixed_better_on_both"] == []
    rows.append(row("aqsgd_4_8", 0.45, 5.44, 150))  # faster and better than auto: named
    assert bench_auto_bits.verdict(rows)["fixed_better_on_both"] == ["aqsgd_4_8"]
    assert "| auto | 0.490 | 5.4500 | 0.2 | 0.0 | 0.0 | - |" in bench_auto_bits.table(rows)
