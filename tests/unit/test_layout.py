"""The house rules a newcomer relies on, checked on the source: small rooms, no hidden environment reads in the
libraries, imports flowing one way (compression <- data_parallel, pipeline <- aqpipe)."""
import ast
import re

import pytest

from tests.helpers.processes import ROOT

LIBRARIES = ("compression", "pipeline", "data_parallel", "aqpipe")
LIMITS = {"file": 500, "class": 350, "function": 80}  # lines


def sources(*packages: str) -> list:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def test_every_file_class_and_function_of_the_libraries_is_small():
    too_large = []
    for path in sources(*LIBRARIES):
        text = path.read_text()
        name = path.relative_to(ROOT).as_posix()
        if text.count("\n") > LIMITS["file"]:
            too_large.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            kind = "class" if isinstance(node, ast.ClassDef) else \
                "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
                too_large.append(f"{name}:{node.lineno} {kind} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_large == [], f"over {LIMITS}: {too_large}"


@pytest.mark.parametrize("package", ["compression", "pipeline", "data_parallel"])
def test_the_libraries_read_no_environment(package):
    """The trainer reads the environment (aqpipe/environment.py, aqpipe/world.py) and passes values down."""
    reads = [f"{p.relative_to(ROOT)}:{i}" for p in sources(package)
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bos\.(environ|getenv|putenv)\b", line)]
    assert reads == []


@pytest.mark.parametrize("package,never", [("compression", ("pipeline", "data_parallel", "aqpipe")),
                                           ("data_parallel", ("pipeline", "aqpipe")), ("pipeline", ("aqpipe",))])
def test_imports_flow_one_way(package, never):
    found = []
    for path in sources(package):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in never]
    assert found == []
