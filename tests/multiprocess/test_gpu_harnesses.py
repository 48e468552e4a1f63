"""The GPU tests' harnesses run on the CPU, so that they cannot rot unseen between the sessions a GPU is lent (the
strict job once asked for packing on a corpus that cannot pack, and a buffer's state under keys it no longer has):
AQ-SGD's sync-free messages with every check but the sync itself, and the strict job launched as on a GPU, every
action of its strict steps wrapped, its AQ-SGD boundary sending changes against its buffers in them."""
import json

from tests.gpu.aqsgd_sync_free import check
from tests.gpu.strict_job import MICRO_BATCHES, STEPS, STRICT_FROM_STEP, run_strict_job, strict_counts
from tests.helpers.processes import checkout_env, free_port


def test_aqsgd_messages_harness_runs_on_the_cpu():
    assert [check(None), check(8)] == [6, 6]  # 3 steps of 2 micro-batches each, both buffer kinds


def test_the_strict_job_launches_and_wraps_every_action(tmp_path):
    proc = run_strict_job(tmp_path, checkout_env(OMP_NUM_THREADS="1"), free_port())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    counts = strict_counts(tmp_path)
    assert len(counts) == 2 and min(counts) >= (STEPS - STRICT_FROM_STEP) * MICRO_BATCHES * 4, counts
    rows = [json.loads(line) for line in (tmp_path / "strict" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "lr" in row]
    assert len(steps) == STEPS
    first, again = [s["fwd_bytes"] for s in steps[:2]], [s["fwd_bytes"] for s in steps[2:]]
    assert max(again) < min(first) / 4, (first, again)  # revisits: changes against the buffers (10x less here)
