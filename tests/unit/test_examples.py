"""The elastic twin of a plain PyTorch script differs from it in at most five lines of code."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def code_lines(path: Path) -> list[str]:
    """The script's lines without its module docstring and blank lines."""
    text = path.read_text()
    tree = ast.parse(text)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc is not None else set()  # type: ignore[arg-type]
    return [line for n, line in enumerate(text.splitlines(), 1) if n not in skip and line.strip()]


def test_the_elastic_twin_changes_at_most_five_lines_of_the_plain_script() -> None:
    plain = code_lines(ROOT / "examples" / "plain_train.py")
    elastic = code_lines(ROOT / "examples" / "elastic_train.py")
    diff = [
        line
        for line in difflib.unified_diff(plain, elastic, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    added = [line for line in diff if line.startswith("+")]
    removed = [line for line in diff if line.startswith("-")]
    assert len(added) <= 5, added
    assert len(removed) <= 3, removed  # the loops and the model's construction, rewritten
    assert any("import cohort" in line for line in added)
