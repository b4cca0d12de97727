"""The arrows between cohort's packages and the worker's rooms, read from the sources (ast:
nothing is imported or executed).

- `cohort.events` imports neither `cohort.coordinator` nor `cohort.worker`;
- `cohort.coordinator` and `cohort.worker` never import each other;
- only the worker's `pytorch` room imports torch;
- the launcher (`cohort.launcher`) never imports the worker: the ranks are the user's scripts;
- a worker room imports only the rooms below it:
  telemetry <- membership <- collective <- loop <- pytorch (`worker/errors.py` is below them
  all). Imports under `if TYPE_CHECKING:` never run, so they are left out of this last rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "events": "cohort.events",
    "coordinator": "cohort.coordinator",
    "worker": "cohort.worker",
}
ROOMS = ("errors", "telemetry", "membership", "collective", "loop", "pytorch")


def module_name(path: Path) -> str:
    """`worker/membership/client.py` -> `cohort.worker.membership.client`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in FOLDERS:
        parts = [*FOLDERS[parts[0]].split("."), *parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_sources() -> dict[str, str]:
    """Every product module's source by module name (the real folders, not cohort/'s links)."""
    sources = {}
    for top in ("events", "coordinator", "worker", "cohort"):
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT).parts
            if relative[0] == "cohort" and relative[1] in FOLDERS:
                continue
            sources[module_name(path)] = path.read_text()
    return sources


def imports(source: str) -> list[tuple[str, int, bool]]:
    """(module imported, line, only under TYPE_CHECKING) for every import in `source`."""
    tree = ast.parse(source)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.extend((name, node.lineno, id(node) in typing_only) for name in names)
    return found


def room(module: str) -> str | None:
    """The worker room `module` belongs to (None outside cohort.worker's rooms)."""
    parts = module.split(".")
    if parts[:2] != ["cohort", "worker"] or len(parts) < 3 or parts[2] not in ROOMS:
        return None
    return parts[2]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(sources: dict[str, str]) -> list[str]:
    """Every import in `sources` that breaks one of the rules above, as `module:line -> name`."""
    found = []
    for module, source in sources.items():
        for name, line, typing_only in imports(source):
            where = f"{module}:{line} imports {name}"
            if (
                within(module, "cohort.events")
                and within(name, "cohort")
                and not within(name, "cohort.events")
            ):
                found.append(f"{where}: events imports no other part of cohort")
            if within(module, "cohort.coordinator") and within(name, "cohort.worker"):
                found.append(f"{where}: the coordinator never imports the worker")
            if within(module, "cohort.worker") and within(name, "cohort.coordinator"):
                found.append(f"{where}: the worker never imports the coordinator")
            if within(module, "cohort.launcher") and within(name, "cohort.worker"):
                found.append(f"{where}: the launcher runs scripts, it never imports the worker")
            if within(name, "torch") and room(module) != "pytorch":
                found.append(f"{where}: only cohort.worker.pytorch imports torch")
            mine, theirs = room(module), room(name)
            if mine and theirs and not typing_only and ROOMS.index(theirs) > ROOMS.index(mine):
                found.append(f"{where}: room {mine} may not import room {theirs}, above it")
    return found


# ---------------------------------------------------------------- the repository


def test_the_repository_keeps_every_arrow() -> None:
    assert violations(product_sources()) == []


def test_every_worker_room_says_what_it_holds_and_what_it_may_import() -> None:
    for folder in sorted(p for p in (ROOT / "worker").iterdir() if p.is_dir()):
        if folder.name == "__pycache__":
            continue
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.name}/ is a room without an __init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring, f"worker/{folder.name}/__init__.py has no docstring"
        assert "May import" in docstring, f"worker/{folder.name}/__init__.py names no arrows"


def test_the_worker_folder_is_a_handful_of_rooms() -> None:
    entries = [p for p in (ROOT / "worker").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 8, sorted(p.name for p in entries)


# ---------------------------------------------------------------- the rules fail when broken


def test_events_importing_the_coordinator_is_refused() -> None:
    found = violations({"cohort.events.keys": "from cohort.coordinator.state import JobState\n"})
    assert found == [
        "cohort.events.keys:1 imports cohort.coordinator.state: events imports no other part of "
        "cohort",
        "cohort.events.keys:1 imports cohort.coordinator.state.JobState: events imports no other "
        "part of cohort",
    ]


def test_the_coordinator_and_the_worker_importing_each_other_is_refused() -> None:
    found = violations(
        {
            "cohort.coordinator.decide": "import cohort.worker.errors\n",
            "cohort.worker.membership.view": "from cohort.coordinator import fold\n",
        }
    )
    assert [line.split(": ", 1)[1] for line in found] == [
        "the coordinator never imports the worker",
        "the worker never imports the coordinator",
        "the worker never imports the coordinator",
    ]


def test_torch_outside_the_pytorch_room_is_refused_even_inside_a_function() -> None:
    source = "def f():\n    import torch.nn\n"
    assert violations({"cohort.worker.pytorch.sync": source}) == []
    assert violations({"cohort.worker.loop.elastic": source}) == [
        "cohort.worker.loop.elastic:2 imports torch.nn: only cohort.worker.pytorch imports torch"
    ]


def test_a_room_importing_a_room_above_it_is_refused() -> None:
    source = "from cohort.worker.collective import tensors\n"
    assert violations({"cohort.worker.loop.checkpoints": source}) == []
    found = violations({"cohort.worker.membership.client": source})
    assert found and all("room membership may not import room collective" in f for f in found)


def test_a_type_only_import_of_a_higher_room_is_allowed() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from cohort.worker.membership.view import Assignment\n"
    )
    assert violations({"cohort.worker.errors": source}) == []
