"""The GPT2 recipe's short job that the fault tests kill and resume (a rank killed by hand, a machine without a
shared filesystem), and the one uninterrupted run of it they both compare with: each launch costs seconds of
imports, so the reference runs once a session (`tests/e2e/conftest.py`)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.processes import ROOT, checkout_env, free_port

RECIPE = str(ROOT / "recipes" / "finetune_gpt2.py")
# 6 steps of 2 x 2 samples on 16: steps 5-6 send AQ-SGD changes of samples seen before a kill at step 5
FLAGS = ["--seq_len", "32", "--max_train_samples", "16", "--max_eval_samples", "8", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--max_steps", "6", "--forward_compress", "aqsgd", "--forward_bits", "2",
         "--backward_compress", "direct", "--backward_bits", "4", "--peer_timeout", "20"]


def run_on_one_machine(out: Path, *flags: str) -> None:
    """The job under torchrun, 2 processes, writing to `out`; asserts it ended well."""
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), RECIPE, *FLAGS,
           "--output_dir", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
