"""A run trains on all of its data unless capped, takes a held-out eval set or fraction, and says its split and
any cap in one line at the start."""
import re

import pytest

from tests.helpers.processes import launch_aqpipe

WORDS = "the quick brown fox jumps over the lazy dog and then it rests by the river bank in the sun "


def run(tmp_path, *argv):
    """`aqpipe *argv` in one process, forked (launch_aqpipe): what it said and its status."""
    return launch_aqpipe(list(argv), 1, tmp_path / f"logs{len(list(tmp_path.glob('logs*')))}")


def aqpipe(tmp_path, *flags):
    return run(tmp_path, "causal-lm", "--seq_len", "16", "--micro_batch_size", "2", "--num_micro_batches", "1",
               "--max_steps", "1", "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir", *flags)


def data_line(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("data: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    where = tmp_path_factory.mktemp("texts")
    (where / "train.txt").write_text(WORDS * 60)
    (where / "held_out.txt").write_text(WORDS * 12)
    return where


IDLE = ("--forward_compress aqsgd, --backward_compress direct: one stage has no boundary to compress, so they send "
        "nothing in this run (--pipeline_stages 2 or more to use them)")


def test_all_of_the_data_and_a_held_out_eval_set(tmp_path, texts):
    """Also: one stage says once that the codecs it was given (causal-lm's AQ-SGD and DirectQ) have no boundary."""
    proc = aqpipe(tmp_path, "--dataset", str(texts / "train.txt"), "--eval_dataset", str(texts / "held_out.txt"))
    whole = data_line(proc)
    assert proc.stderr.count(IDLE) == 1, proc.stderr[-2000:]
    m = re.fullmatch(r"data: train (\d+) samples, eval (\d+) samples from --eval_dataset .*held_out\.txt", whole)
    assert m, whole
    train, held = int(m.group(1)), int(m.group(2))
    proc = aqpipe(tmp_path, "--dataset", str(texts / "train.txt"), "--eval_fraction", "0.25", "--max_train_samples",
                  "8", "--forward_compress", "none", "--backward_compress", "none")
    split = data_line(proc)
    assert "no boundary to compress" not in proc.stderr
    m = re.fullmatch(r"data: train 8 of (\d+) samples \(--max_train_samples 8\), eval (\d+) samples from the last "
                     r"0.25 of it", split)
    assert m, split
    assert int(m.group(1)) + int(m.group(2)) == train and int(m.group(2)) == -(-train // 4)
    assert 0 < held < int(m.group(2))  # the held-out file is a fifth of the training text's length


def test_a_bad_eval_fraction_is_one_line(tmp_path, texts):
    proc = aqpipe(tmp_path, "--dataset", str(texts / "train.txt"), "--eval_fraction", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("eval_fraction=1.0: expected a fraction in (0, 1)"), proc.stderr


def test_a_run_refused_in_set_up_leaves_no_folder_it_created(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short\n")
    out = tmp_path / "new" / "deeper" / "out"
    proc = run(tmp_path, "causal-lm", "--dataset", str(short), "--output_dir", str(out))
    assert proc.returncode == 2 and "none left for the 'train' split" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "new").exists()


def test_a_misspelt_flag_is_answered_with_the_nearest_one(tmp_path):
    proc = run(tmp_path, "gpt2", "--forward_bitz", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("aqpipe gpt2: error: unrecognized arguments: --forward_bitz 2; did you mean "
                                   "--forward_bits? (aqpipe gpt2 --help lists the flags)")

