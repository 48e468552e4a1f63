"""What several end-to-end tests share: the uninterrupted run of the job the fault tests kill and resume."""
import pytest

from tests.helpers.killed_recipe import run_on_one_machine


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The killed recipe's job run through on one machine: its output directory (metrics.jsonl, model/)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_on_one_machine(out)
    return out
