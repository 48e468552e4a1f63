"""Every process a test starts imports the checkout under test, not another copy on the machine."""
import os
import subprocess
import sys

from tests.helpers.processes import ROOT, checkout_env


def test_a_launched_process_imports_the_checkout_even_with_another_copy_on_its_path(tmp_path):
    decoy = tmp_path / "decoy"
    for package in ("aqpipe", "aqpipe/pipeline", "aqpipe/compression", "aqpipe/data_parallel"):  # an older install
        (decoy / package).mkdir(parents=True)
        (decoy / package / "__init__.py").write_text("")
    elsewhere = tmp_path / "elsewhere"  # not the checkout: the working directory gives nothing away
    elsewhere.mkdir()
    code = "import aqpipe; from aqpipe import pipeline, compression, data_parallel as d; print(aqpipe.__file__, " \
           "pipeline.__file__, compression.__file__, d.__file__)"
    env = checkout_env({**os.environ, "PYTHONPATH": str(decoy)})
    where = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    assert len(where) == 4 and all(path.startswith(str(ROOT) + os.sep) for path in where), where
