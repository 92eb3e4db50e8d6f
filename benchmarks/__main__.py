"""List the benchmarks, one line each: group, module and the first line of its docstring.

    python -m benchmarks [--list]       # what `make bench` prints

Reads the scripts' docstrings without importing them (no torch): each group is a folder of
benchmarks/ with an __init__.py, each benchmark a module in it, run as `python -m MODULE`.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent


def groups() -> list[Path]:
    """The group folders of benchmarks/, by name."""
    return sorted(p.parent for p in HERE.glob("*/__init__.py"))


def summary(path: Path) -> str:
    """The first line of a module's docstring ("" when it has none)."""
    return (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]


def benchmarks() -> list[tuple[str, str, str]]:
    """(group, module, summary) of every benchmark, by group then module."""
    return [(group.name, f"{HERE.name}.{group.name}.{path.stem}", summary(path))
            for group in groups() for path in sorted(group.glob("*.py")) if path.name != "__init__.py"]


def listing() -> str:
    rows = benchmarks()
    group_width, module_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    return "\n".join(f"{group:<{group_width}}  {module:<{module_width}}  {text}" for group, module, text in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the benchmarks (the default)")
    parser.parse_args(argv)
    print(listing())
    print("\nRun one: python -m MODULE --help. Results: benchmarks/results/NAME.json; docs: docs/BENCHMARKS.md.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
