"""The house rules a newcomer relies on, checked on the source: small rooms, no hidden environment reads in the
libraries, imports flowing one way (aqpipe.compression <- aqpipe.data_parallel, aqpipe.pipeline <- the trainer)."""
import ast

import pytest

from tests.helpers.processes import ROOT

LIBRARIES = ("aqpipe.compression", "aqpipe.pipeline", "aqpipe.data_parallel")  # the trainer is the rest of aqpipe
LIMITS = {"file": 500, "class": 350, "function": 80}  # lines


def sources(*packages: str) -> list:
    return sorted(p for package in packages for p in (ROOT / package.replace(".", "/")).rglob("*.py"))


def within(name: str, package: str) -> bool:
    """Whether module `name` is `package` or inside it; "trainer": aqpipe's own modules, outside the libraries."""
    if package == "trainer":
        return within(name, "aqpipe") and not any(within(name, lib) for lib in LIBRARIES)
    return name == package or name.startswith(package + ".")


def test_every_file_class_and_function_of_the_libraries_is_small():
    too_large = []
    for path in sources("aqpipe"):
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


ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(text: str) -> list[int]:
    """The lines of `text` that reach the environment through `os`: `os.environ`, `from os import getenv`,
    `getattr(os, "environ")`."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ENVIRONMENT:
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENVIRONMENT:
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENVIRONMENT:
            found.append(node.lineno)
    return sorted(found)


@pytest.mark.parametrize("package", LIBRARIES)
def test_the_libraries_read_no_environment(package):
    """The trainer reads the environment (aqpipe/environment.py, aqpipe/world.py) and passes values down."""
    reads = [f"{p.relative_to(ROOT)}:{line}" for p in sources(package) for line in environment_reads(p.read_text())]
    assert reads == []


def test_the_environment_check_sees_each_way_in():
    text = "import os\nfrom os import environ as e\nx = os.getenv('A')\ny = getattr(os, 'environ')\nz = os.path.sep\n"
    assert environment_reads(text) == [2, 3, 4]


@pytest.mark.parametrize("package,never", [
    ("aqpipe.compression", ("aqpipe.pipeline", "aqpipe.data_parallel", "trainer")),
    ("aqpipe.data_parallel", ("aqpipe.pipeline", "trainer")), ("aqpipe.pipeline", ("trainer",))])
def test_imports_flow_one_way(package, never):
    graph = import_graph("aqpipe")
    found = [f"{module}: {name}" for module, names in graph.items() if within(module, package)
             for name in names if any(within(name, other) for other in never)]
    assert found == []


def test_the_one_way_check_sees_a_wrong_way_import():
    assert within("aqpipe.train", "trainer") and not within("aqpipe.pipeline.engine", "trainer")
    assert within("aqpipe", "trainer") and not within("aqpipe.compression", "trainer")


def _module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for part in node.body for n in ast.walk(part)}


def _imported(module: str, is_package: bool, node: ast.AST, modules: set[str]) -> set[str]:
    """The project's modules an import statement loads (`from . import x` loads x, not the package's names)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
            if node.level else node.module
        subs = [f"{base}.{a.name}" for a in node.names]
        names = [s for s in subs if s in modules] + ([base] if any(s not in modules for s in subs) else [])
    else:
        return set()
    found = set()
    for name in names:  # the longest prefix that is a module of the project (`pipeline.lora.x` -> pipeline.lora)
        parts = name.split(".")
        found |= next(({".".join(parts[:k])} for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules),
                      set())
    return found - {module}


def import_graph(*packages: str) -> dict[str, set[str]]:
    """Each module of the packages -> the project modules it imports, at its top or inside a function."""
    paths = {_module_name(p): p for p in sources(*packages)}
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        graph[module] = set().union(*(_imported(module, path.name == "__init__.py", node, set(paths))
                                      for node in ast.walk(tree) if id(node) not in skip))
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_loops_inside_or_across_the_packages():
    """Counting imports inside functions too: a loop closed by a deferred import is still a loop."""
    assert loops(import_graph("aqpipe")) == []


def test_the_loop_finder_finds_a_loop():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_an_import_inside_a_function_says_why():
    """An in-function import of the project's own modules hides a dependency; one is kept only for start-up time,
    and its line says so (`# deferred: <why>`)."""
    unstated = []
    for path in sources("aqpipe"):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        skip = _type_only(tree)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = isinstance(node, ast.ImportFrom) and (node.level > 0 or within(node.module or "", "aqpipe")) \
                    or isinstance(node, ast.Import) and any(within(a.name, "aqpipe") for a in node.names)
                if own and id(node) not in skip and "# deferred:" not in lines[node.lineno - 1]:
                    unstated.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert unstated == []
