"""--report_to: an unknown or missing reporter is one line, and several reporters take every record (every figure
read back from each is in tests/e2e/test_trl_command.py, where TRL's documented command reports to all three)."""
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
