"""The job strict_steps.py runs, shared by the GPU test and the suite's CPU run of the same harness (which checks
that it launches and wraps every action, so it cannot rot where no GPU runs it): a 2-stage GPT2 (a tied head,
AQ-SGD on its boundary and tie) over gloo, on conversations packed into rows, whose samples come back after the
first steps so that AQ-SGD sends changes against its buffers, not first visits alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STEPS, MICRO_BATCHES = 4, 4
STRICT_FROM_STEP = 1  # optimizer steps taken before the first strict one (the tie primed, buffers first filled)
REPLIES = ["hello how can i help", "see you later then", "i help you with that", "the weather is fine today"]


def write_chats(path: Path, rows: int = 96) -> Path:
    """Conversations of different lengths (packing puts several in a row), as a chat dataset's jsonl."""
    with path.open("w") as f:
        for i in range(rows):
            user = " ".join(["hi"] * (1 + i % 7)) + " there friend"
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": REPLIES[i % 4]}]}) + "\n")
    return path


def run_strict_job(work: Path, env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    """The job under torchrun in `work`: 16 packed samples, 8 a step, so steps 3 and 4 revisit steps 1 and 2's."""
    data = write_chats(work / "chats.jsonl")
    for stale in work.glob("strict_actions.*"):  # an earlier job's counts in the same directory
        stale.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), "-m",
           "tests.gpu.strict_steps", "gpt2", "--backend", "gloo", "--dataset", str(data), "--chat_template",
           "chatml", "--packing", "True", "--seq_len", "128", "--micro_batch_size", "2", "--num_micro_batches",
           str(MICRO_BATCHES), "--max_train_samples", "16", "--max_eval_samples", "8", "--max_steps", str(STEPS),
           "--output_dir", str(work / "strict")]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)


def strict_counts(work: Path) -> list[int]:
    """The actions each rank ran under the strict mode, as strict_steps.py wrote them in `work` (rank order)."""
    return [int(f.read_text()) for f in sorted(work.glob("strict_actions.*"))]
