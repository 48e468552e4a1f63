"""--report_to: an unknown or missing reporter is one line, and several reporters take every record (every figure
read back from each is in tests/e2e/test_trl_command.py, where TRL's documented command reports to all three)."""
import os

import pytest

from aqpipe import reporters


def test_a_reporter_unknown_or_not_installed_is_one_line(monkeypatch):
    with pytest.raises(ValueError, match="report_to='mlflow': expected one of none, tensorboard, wandb, trackio"):
        reporters.check("mlflow")
    with pytest.raises(ValueError, match="report_to='tensorboard,comet': expected one of"):
        reporters.check("tensorboard,comet")
    monkeypatch.setattr(reporters.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"the tensorboard package is not installed; expected pip install "
                                         r"'aqpipe\[tensorboard\]'"):
        reporters.check("tensorboard")
    reporters.check("none")


@pytest.mark.parametrize("wandb_dir", [True, False])
def test_wandb_writes_under_wandb_dir_where_set_else_under_the_output_dir(tmp_path, monkeypatch, wandb_dir):
    """As HF's callback leaves WANDB_DIR to W&B: a run goes under $WANDB_DIR/wandb when the user set it, and under
    <output_dir>/wandb otherwise (offline, so that nothing leaves the machine)."""
    out, chosen = tmp_path / "out", tmp_path / "chosen"
    out.mkdir()
    chosen.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if wandb_dir:
        monkeypatch.setenv("WANDB_DIR", str(chosen))
    else:
        monkeypatch.delenv("WANDB_DIR", raising=False)
    run = reporters.WandB(str(out))
    run.log({"step": 1, "loss": 2.5})
    run.close()
    import wandb

    wandb.teardown()  # its service, and the variable naming it, which later tests' subprocesses would inherit
    os.environ.pop("WANDB_SERVICE", None)
    expected, other = (chosen, out) if wandb_dir else (out, chosen)
    assert list((expected / "wandb").glob("offline-run-*")), sorted(p.name for p in expected.rglob("*"))[:10]
    assert not (other / "wandb").exists()


def test_the_reporters_take_their_project_and_run_names_as_hfs_callbacks_do(tmp_path, monkeypatch):
    """WANDB_PROJECT and WANDB_NAME for W&B, TRACKIO_PROJECT for Trackio; the project is aqpipe without them and
    the run is named by the output directory."""
    import sys
    from types import SimpleNamespace

    calls = []
    fake = SimpleNamespace(init=lambda **kw: calls.append(kw) or SimpleNamespace(log=None, finish=None),
                           log=None, finish=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setitem(sys.modules, "trackio", fake)
    for name in ("WANDB_PROJECT", "WANDB_NAME", "TRACKIO_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    reporters.WandB(str(tmp_path / "run1"))
    reporters.Trackio(str(tmp_path / "run1"))
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    monkeypatch.setenv("WANDB_NAME", "first try")
    monkeypatch.setenv("TRACKIO_PROJECT", "theirs")
    reporters.WandB(str(tmp_path / "run2"))
    reporters.Trackio(str(tmp_path / "run2"))
    assert [(c["project"], c["name"]) for c in calls] == [("aqpipe", "run1"), ("aqpipe", "run1"),
                                                            ("mine", "first try"), ("theirs", "run2")]
