"""What a newcomer meets in a first hour: a hub out of reach, a data error found during set-up by one rank,
an output directory that holds an earlier run."""
import subprocess
import sys
import time

from tests.helpers.processes import ROOT, checkout_env, free_port

ENV = checkout_env()
TINY = ["--seq_len", "32", "--max_train_samples", "16", "--max_eval_samples", "8", "--micro_batch_size", "2",
        "--num_micro_batches", "2"]


def aqpipe(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aqpipe", *args], cwd=ROOT, env=env or ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_a_hub_model_with_the_hub_out_of_reach_is_one_line_within_seconds(tmp_path):
    """No cache, no hub: the run says so at once (the hub's clients would retry for a minute, then the run would
    train a BPE tokenizer in place of the model's and fail on something else)."""
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_ENDPOINT")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens on port 9
    started = time.monotonic()
    proc = aqpipe("gpt2", "--model", "gpt2", "--output_dir", str(tmp_path / "out"), env=env)
    assert proc.returncode == 2 and time.monotonic() - started < 30
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model='gpt2' is not in the local HuggingFace cache and the hub cannot give it" in proc.stderr
    assert "http://127.0.0.1:9 did not answer" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_data_error_found_in_set_up_is_one_line_from_the_rank_that_found_it(tmp_path):
    """Local rank 0 tokenizes for both; its error is said once, and rank 1, waiting for it, stops quietly with
    the same status instead of blaming the network after the collective timeout."""
    corpus = tmp_path / "short.txt"
    corpus.write_text("Too short to hold one sample.\n")
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-m", "aqpipe", "gpt2", *TINY, "--dataset", str(corpus),
                               "--output_dir", str(tmp_path / "out")], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    errors = outputs[0][1] + outputs[1][1]
    assert errors.count("error:") == 1 and "Traceback" not in errors, errors
    assert "none left for the 'train' split" in outputs[0][1] and "(found by rank 0 (stage 0, replica 0))" in errors
    assert outputs[1][1] == ""


def test_overwrite_output_dir_replaces_the_earlier_runs_checkpoints(tmp_path):
    out = tmp_path / "out"
    first = aqpipe("gpt2", *TINY, "--max_steps", "2", "--save_every", "1", "--output_dir", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]
    # without the flag the run is refused (tests/unit/test_config.py)
    replaced = aqpipe("gpt2", *TINY, "--max_steps", "1", "--output_dir", str(out), "--overwrite_output_dir")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert not (out / "checkpoints").exists()  # the earlier run's: a later --resume must not find them
    assert (out / "model").is_dir() and len((out / "metrics.jsonl").read_text().splitlines()) == 2  # 1 step, 1 eval
