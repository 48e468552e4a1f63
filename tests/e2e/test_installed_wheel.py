"""The package as a user installs it: a wheel built from the checkout, in a fresh virtual environment, runs the main
job under torchrun and the classification job in one process, from a directory that is not the checkout (the
deepspeed launcher's runs, from the checkout, are test_recipes' and test_interrupts')."""
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers.processes import ROOT, free_port

PACKAGES = ("aqpipe", "compression", "data_parallel", "pipeline")
QUICK = ["--seq_len", "32", "--max_train_samples", "16", "--max_eval_samples", "4", "--micro_batch_size", "2",
         "--num_micro_batches", "2", "--max_steps", "2"]


def build_wheel(out: Path) -> Path:
    """From a copy of the checkout's sources: a stale egg-info or build/ here would add files a fresh clone lacks."""
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "runs", ".git",
                                                                "__pycache__"))
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation, "-w", str(out),
                    str(source)], check=True, capture_output=True)
    return next(out.glob("aqpipe-*.whl"))


def test_the_wheel_holds_every_package_and_runs_both_fine_tunes_from_elsewhere(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert shipped - names == set()  # every module, subpackages too (pipeline.stages was once left out)
    assert "aqpipe/compression/native/quant.c" in names
    assert not any(n.startswith(("tests/", "recipes/", "benchmarks/")) for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # it sees the packages of the interpreter running the tests (torch, transformers, deepspeed: in a user's venv,
    # that venv's), appended after its own: the wheel it installs comes first, and those directories' own .pth
    # files (an editable install of the checkout) are not read
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    ours = {p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)}
    Path(own, "running_interpreter.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def run(*cmd: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc

    where = run(str(python), "-c", "import aqpipe; print(aqpipe.__file__)").stdout
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout's
    assert "usage: aqpipe {causal-lm,classify,gpt2,deberta}" in run(str(venv / "bin" / "aqpipe"), "--help").stdout

    run(str(python), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        "-m", "aqpipe", "gpt2", *QUICK, "--output_dir", "gpt2")
    run(str(venv / "bin" / "aqpipe"), "deberta", *QUICK, "--output_dir", "deberta")
    for name, metric, world in (("gpt2", "eval_perplexity", 2), ("deberta", "eval_accuracy", 1)):
        summary = json.loads((elsewhere / name / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["world_size"] == world and metric in summary
        assert (elsewhere / name / "model" / "config.json").is_file()
