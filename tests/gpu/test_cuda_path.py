"""The CUDA paths, run where a GPU is (`pytest -m gpu`; skipped elsewhere with the reason): Triton's compiled kernels
against the C kernels, staging through pinned host memory, AQ-SGD's messages without a host sync, and a 2-stage job
sharing one GPU over gloo, whose step losses equal the CPU run's once dropout is off (dropout masks are drawn by
each device's own generator), and that job's steps with every schedule action under sync debug mode "error"
(strict_steps.py), which fails where a sync is planted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqpipe.compression.staging import HostStaging
from aqpipe.pipeline.seeding import derive_seed, reseed
from tests.gpu.strict_job import MICRO_BATCHES, STEPS, STRICT_FROM_STEP, run_strict_job, strict_counts

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", **extra}


def test_compiled_triton_kernels_give_the_c_kernels_bytes():
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.compiled_kernels"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked 240, flags 24" in proc.stdout


def test_staging_round_trips_through_pinned_host_memory():
    staging = HostStaging("cpu")
    x = torch.randn(3, 1000, device="cuda")
    sent = staging.outgoing(x)
    assert sent.device.type == "cpu" and sent.is_pinned() and torch.equal(sent, x.cpu())
    landing = staging.landing(x.numel(), x.dtype, x.device)
    assert landing.is_pinned()
    landing.copy_(sent.reshape(-1))
    back = staging.arrived(landing, x.device)
    torch.cuda.synchronize()
    assert back.device.type == "cuda" and torch.equal(back.reshape(x.shape), x)
    assert staging.take_seconds() > 0


def test_reseed_seeds_the_gpus_generator_as_torch_manual_seed_does():
    torch.manual_seed(derive_seed(11, 3))
    expected = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5)
    torch.manual_seed(0)
    torch.rand(5, device="cuda")
    reseed(11, 3)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5), expected)


def test_aqsgd_messages_wait_for_no_host_sync():
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.aqsgd_sync_free"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no sync: float16-rows 6" in proc.stdout and "no sync: 8-bit-rows 6" in proc.stdout, proc.stdout


def _job(work: Path, device: str) -> list[dict]:
    out = work / device
    env = _env(**({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           "29671" if device == "cpu" else "29672", "-m", "aqpipe", "gpt2", "--backend", "gloo", "--dropout", "0",
           "--seq_len", "128", "--micro_batch_size", "2", "--num_micro_batches", "4", "--max_train_samples", "64",
           "--max_eval_samples", "8", "--max_steps", "3", "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]


def test_two_stages_on_one_gpu_match_the_cpu_run_without_dropout(tmp_path):
    gpu, cpu = _job(tmp_path, "cuda"), _job(tmp_path, "cpu")
    assert len(gpu) == len(cpu) == 3
    # with dropout on, step 1 differed by 2.7e-2 (masks drawn by the GPU's generator, not the CPU's)
    assert abs(gpu[0]["loss"] - cpu[0]["loss"]) < 1e-3, (gpu[0]["loss"], cpu[0]["loss"])
    # the same messages on the wire, entropy-coded (on by default under gloo): their coded sizes follow the codes,
    # which the last bits of the activations move, so within 2%, not to the byte
    assert [s["fwd_bytes"] for s in gpu] == pytest.approx([s["fwd_bytes"] for s in cpu], rel=0.02)
    assert gpu[-1]["loss"] < gpu[0]["loss"]


def test_a_steps_actions_sync_nowhere_and_a_planted_sync_is_caught(tmp_path):
    proc = run_strict_job(tmp_path, _env(), 29673)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    counts = strict_counts(tmp_path)  # the strict steps' micro-batches, 4 actions each on either stage at least
    assert len(counts) == 2 and min(counts) >= (STEPS - STRICT_FROM_STEP) * MICRO_BATCHES * 4, counts
    planted = run_strict_job(tmp_path, _env(PLANT_SYNC="1"), 29674)
    assert planted.returncode != 0 and "synchroniz" in planted.stderr.lower(), planted.stderr[-3000:]


@pytest.mark.parametrize("cap", [None, 30.0], ids=["plain", "softcap"])
def test_the_fused_liger_loss_is_hfs_on_the_gpu(cap):
    """--use_liger_kernel's loss compiled (the suite's CPU runs interpret it, which cannot soft-cap)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from aqpipe.pipeline.stages.lm_loss import causal_lm_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2, 64, 128, device="cuda", generator=g, requires_grad=True)
    head = torch.nn.Linear(128, 5000, bias=False, device="cuda")
    labels = torch.randint(0, 5000, (2, 64), device="cuda", generator=g)
    labels[0, :9] = -100
    logits = head(hidden)
    logits = torch.tanh(logits / cap) * cap if cap else logits
    want = ForCausalLMLoss(logits, labels, vocab_size=5000)
    want_grads = torch.autograd.grad(want, [hidden, head.weight])
    got = causal_lm_loss(head, hidden, labels, 5000, cap, fused="liger")[0]
    for a, b in zip(torch.autograd.grad(got, [hidden, head.weight]), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
