"""The WAN score's arithmetic (benchmarks/wan.py): steps and time to the bf16 row's final eval loss, each step at
its epoch's time on the link; the micro-batches that cover a round trip."""
import json

import pytest

from benchmarks import wan


def test_time_to_target_counts_each_step_at_its_epochs_time():
    evals = [(2, 5.0), (4, 4.6), (6, 4.4), (8, 4.3)]
    assert wan.time_to_target(evals, 4.5, steps_per_epoch=4, first_s=2.0, later_s=1.0) == (6, 4 * 2.0 + 2 * 1.0)
    assert wan.time_to_target(evals, 4.6, 4, 2.0, 1.0) == (4, 8.0)  # at or below the target
    assert wan.time_to_target(evals, 4.0, 4, 2.0, 1.0) == (None, None)  # never reached
    assert wan.time_to_target(evals, 4.3, 8, 3.0, None) == (8, 24.0)  # one epoch: no later steps


def test_score_sets_the_target_from_the_bf16_row_and_compares_times():
    def row(evals, first_s, later_s=None, fwd=1000.0):
        return {"evals": evals, "final_eval_loss": evals[-1][1], "steps_per_epoch": 4, "first_epoch_s": first_s,
                "later_s": later_s, "steps": 4, "bytes_later": None, "first_epoch_bubble": 0.1,
                "bytes_first_epoch": {"fwd_bytes": fwd, "bwd_bytes": fwd, "tie_bytes": 0, "dp_bytes": 0}}

    job = {"epochs": 1, "rows": {"bf16": row([(2, 5.0), (4, 4.5)], 4.0),
                                 "hadamard_4": row([(2, 4.9), (4, 4.5)], 2.0),
                                 "aqsgd_first_visit": row([(2, 4.5), (4, 4.4)], 1.0),
                                 "direct_4": row([(2, 5.0), (4, 4.6)], 1.0)}}
    wan.score(job, rate=8000.0, latency_ms=50, micro_batches=4, h100_compute_s=0.01)
    rows = job["rows"]
    assert rows["hadamard_4"]["time_to_near_target_s"] == 8.0 and rows["direct_4"]["steps_to_near_target"] is None
    # beside an H100 on 200 Mb/s with 50 ms: compute, a round trip, and 2000 bytes a step at the rate
    step = 0.01 + 0.1 + 2000 * 8 / 200e6
    assert rows["bf16"]["projected_h100_s"] == pytest.approx(4 * step)
    assert rows["aqsgd_first_visit"]["projected_speedup_vs_bf16"] == pytest.approx(2.0)
    assert job["target_eval_loss"] == 4.5
    assert rows["bf16"]["time_to_target_s"] == 16.0 and rows["hadamard_4"]["time_to_target_s"] == 8.0
    assert rows["aqsgd_first_visit"]["steps_to_target"] == 2 and rows["aqsgd_first_visit"]["time_to_target_s"] == 2.0
    fastest = rows["aqsgd_first_visit"]
    assert fastest["speedup_vs_bf16"] == 8.0 and fastest["speedup_vs_hadamard_4"] == 4.0
    assert rows["direct_4"]["time_to_target_s"] is None and rows["direct_4"]["speedup_vs_bf16"] is None
    assert rows["direct_4"]["vs_bf16_eval"] == pytest.approx(4.6 / 4.5 - 1)
    # a message of 500 bytes at 8000 bit/s takes 0.5 s: a 0.1 s round trip needs one in flight
    assert rows["bf16"]["latency_cover_micro_batches"] == 1
    assert "| aqsgd_first_visit |" in wan.table(job)


def test_latency_cover_grows_as_messages_shrink():
    assert wan.latency_cover(4 * 125_000, 4, 1e6, 50) == 1  # 1 s a message
    assert wan.latency_cover(4 * 1_250, 4, 1e6, 50) == 10  # 10 ms a message, 100 ms round trip


def test_curve_reads_bytes_by_epoch_and_the_eval_curve(tmp_path):
    rows = [{"step": s, "epoch": (s - 1) // 2, "loss": 5.0, "seconds": 1.0 + s, "fwd_bytes": 100 if s <= 2 else 10,
             "bwd_bytes": 5, "tie_bytes": 1, "dp_bytes": 0} for s in range(1, 5)]
    rows.insert(2, {"step": 2, "eval_loss": 4.8})
    rows.append({"step": 4, "eval_loss": 4.7})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    c = wan.curve(tmp_path)
    assert c["evals"] == [(2, 4.8), (4, 4.7)] and c["final_eval_loss"] == 4.7
    assert c["steps_per_epoch"] == 2 and c["bytes_first_epoch"]["fwd_bytes"] == 100
    assert c["bytes_later"]["fwd_bytes"] == 10 and c["compute_s"] == 4.0
