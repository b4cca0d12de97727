"""Rooms stay small enough to read: no function over 60 lines in the product and the
benchmarks (but the two fact dispatchers, one branch per fact type), and the `Worker` client
under 500 lines. ruff holds complexity (mccabe, at most 12: pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("events", "coordinator", "worker", "cohort", "bench")
LINKS = {"events", "coordinator", "worker"}  # cohort/events etc. point at the real folders
LONGEST = 60
DISPATCHERS = {"coordinator/fold.py:_changes", "worker/membership/view.py:evolve"}
"""A fold's dispatcher reads best as one `match` with a branch per fact type."""


def sources() -> list[Path]:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).parts
            if relative[0] == "cohort" and relative[1] in LINKS:
                continue
            found.append(path)
    return found


def lengths(source: str) -> list[tuple[str, int, int]]:
    """(function name, first line, lines from its `def` to its last line) in `source`."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def too_long(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        where = path.relative_to(ROOT).as_posix()
        for name, line, length in lengths(path.read_text()):
            if length > LONGEST and f"{where}:{name}" not in DISPATCHERS:
                found.append(f"{where}:{line} {name} is {length} lines")
    return found


def test_no_function_is_over_sixty_lines_but_the_two_fact_dispatchers() -> None:
    assert too_long(sources()) == []


def test_the_rule_counts_from_def_to_the_last_line(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text(f"def fits():\n{body}")
    long.write_text(f"def does_not():\n{body}    x = 1\n")
    assert lengths(short.read_text()) == [("fits", 1, 60)]
    assert lengths(long.read_text()) == [("does_not", 1, 61)]


def test_the_worker_client_class_is_under_five_hundred_lines() -> None:
    tree = ast.parse((ROOT / "worker" / "membership" / "client.py").read_text())
    (worker,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Worker")
    assert worker.end_lineno is not None
    assert worker.end_lineno - worker.lineno + 1 < 500
