"""A second English corpus, unlike the plays, for fine-tuning after pretraining on them: the docstrings of Python's
standard library (technical prose; present wherever Python is, no download).

    python -m benchmarks.docstring_corpus runs/docstrings.txt [--mb 4]

Every module, class and function docstring of the standard library's `.py` files (tests left out), in sorted file
order, one blank line apart, cut at --mb megabytes.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path


def docstrings(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "idle_test", "site-packages"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) > 80:  # sentences, not one-word notes
                    out.append(text.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="the text file to write")
    p.add_argument("--mb", type=float, default=4.0, help="cut the corpus at this many megabytes")
    args = p.parse_args(argv)
    text = "\n\n".join(docstrings(Path(os.__file__).parent))[: int(args.mb * 1e6)]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text + "\n", encoding="utf-8")
    print(f"wrote {args.output}: {len(text) / 1e6:.2f} MB of docstrings", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
