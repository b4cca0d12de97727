"""The repository stands on its own: every page it names is in it, nothing points outside it,
and the design page keeps up with the code.

Paths are read from the text of code (`*.py`, `*.lua`, `*.toml`, `*.yml`, `.ci/run`,
`Dockerfile`) and of every Markdown page. A Markdown link is resolved from the folder of the
page that holds it, any other path from the repository's root; URLs are skipped. Each
failure names the offending file:line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

from cohort.events.models import Command, Fact
from tests.helpers import require_torch

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"

GENERATED = {"__pycache__", "build", "dist", "node_modules"}
"""Folders of build output and caches: what is in them is not the repository's own text."""
HIDDEN_KEPT = {".ci", ".github"}
"""Hidden folders that hold the repository's own files (the rest are caches, .git, venvs)."""
CODE_SUFFIXES = {".py", ".lua", ".toml", ".yml", ".yaml"}
SCRIPTS = {".ci/run", "Dockerfile"}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]*)\)")
"""A Markdown link or image: `[text](target)`."""
BARE_MD = re.compile(r"(?<![\w./:~-])((?:\.\./)*[\w][\w./-]*\.md)\b")
"""A path to a Markdown page outside a link: folders, a name, the suffix."""
LITERAL_JOIN = re.compile(r"""["']\s*/\s*["']""")
"""Two string literals joined by pathlib's `/`: read as one path."""
JOINED = re.compile(r"""(\w*)\s*/\s*["']$""")
"""What comes before a name joined onto a folder with `/`: the folder's variable."""
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
OUTSIDE = tuple(base + "/shared" for base in ("..", "/work"))
"""Where the design lived before it was the repository's own (spelled so this file does
not name it)."""


def repository_files() -> Iterator[Path]:
    """Every file of the working tree that is the repository's own, in a stable order."""
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder)
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in GENERATED
            and not d.endswith(".egg-info")
            and (not d.startswith(".") or d in HIDDEN_KEPT)
            and not (here / d / "pyvenv.cfg").exists()  # a virtual environment
        )
        for name in sorted(files):
            yield here / name


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def is_code(path: Path) -> bool:
    return path.suffix in CODE_SUFFIXES or relative(path) in SCRIPTS


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def named_paths(path: Path) -> Iterator[tuple[int, str, Path]]:
    """(line number, path as written, where it resolves to) for every page `path` names."""
    markdown = path.suffix == ".md"
    for number, line in enumerate(lines_of(path), start=1):
        rest = line
        if not markdown:
            rest = LITERAL_JOIN.sub("/", line)
        else:
            for target in LINK.findall(line):
                target = target.split("#", 1)[0]
                if target and not SCHEME.match(target):
                    yield number, target, path.parent / target
            rest = LINK.sub(" ", line)  # a link's text is resolved with its target, not alone
        for bare in BARE_MD.finditer(rest):
            folder = JOINED.search(rest[: bare.start()])
            if folder and folder.group(1) != "ROOT":
                continue  # a file name joined onto a folder the code makes (a temp dir)
            yield number, bare.group(1), ROOT / bare.group(1)


def missing_pages() -> list[str]:
    problems = []
    for path in repository_files():
        if path.suffix != ".md" and not is_code(path):
            continue
        for number, written, resolved in named_paths(path):
            target = resolved.resolve()
            if not target.is_relative_to(ROOT) or not target.exists():
                problems.append(f"{relative(path)}:{number}: {written} is not in the repository")
    return problems


def test_every_page_named_in_code_and_docs_is_in_the_repository() -> None:
    problems = missing_pages()
    assert not problems, "pages named but not in the repository:\n" + "\n".join(problems)


def test_no_file_points_at_the_design_outside_the_repository() -> None:
    problems = []
    for path in repository_files():
        raw = path.read_bytes()
        if b"\0" in raw[:8192]:  # binary
            continue
        for number, line in enumerate(raw.decode("utf-8", "replace").splitlines(), start=1):
            problems += [f"{relative(path)}:{number}: names {o}" for o in OUTSIDE if o in line]
    assert not problems, "files that point outside the repository:\n" + "\n".join(problems)


def event_types(union: object) -> list[str]:
    members = get_args(get_args(union)[0])  # Annotated[A | B | ..., Field(...)]
    return [model.model_fields["type"].default for model in members]


def test_the_design_names_every_command_and_fact() -> None:
    design = DESIGN.read_text(encoding="utf-8")
    missing = [t for t in event_types(Command) + event_types(Fact) if f"`{t}`" not in design]
    assert not missing, f"docs/design.md does not name these events of events/models.py: {missing}"


def test_every_invariant_names_test_files_that_exist() -> None:
    section = DESIGN.read_text(encoding="utf-8").split("\n## Invariants\n", 1)[1]
    invariants = re.split(r"\n(?=\d+\. )", section.strip())[1:]
    assert [int(text.split(".", 1)[0]) for text in invariants] == list(
        range(1, len(invariants) + 1)
    )
    problems = []
    for text in invariants:
        number = text.split(".", 1)[0]
        named = re.findall(r"tests/[\w/]+\.py", text)
        if not named:
            problems.append(f"invariant {number} names no test file")
        problems += [
            f"invariant {number}: {t} does not exist" for t in named if not (ROOT / t).exists()
        ]
    assert not problems, "docs/design.md, Invariants:\n" + "\n".join(problems)


CLASS_NAMED = re.compile(r"`(cohort\.(?:torch\.)?[A-Z]\w*)")
"""A class named in code quotes: `cohort.Name` or `cohort.torch.Name`."""


def test_the_pages_name_the_classes_cohort_exports_by_their_names() -> None:
    """A page names a class as a script imports it (`cohort.NumpyElasticJob`), not by a
    name that only a DeprecationWarning keeps alive (`cohort.ElasticJob`) or none at all;
    where it or the line before says it is an old name, it may name it."""
    require_torch()
    import cohort
    import cohort.torch

    exported = {f"cohort.{n}" for n in cohort.__all__} | {
        f"cohort.torch.{n}" for n in cohort.torch.__all__
    }
    problems = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        previous = ""
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for name in CLASS_NAMED.findall(line):
                if name not in exported and "old name" not in previous + line:
                    problems.append(f"{relative(path)}:{number}: {name}")
            previous = line
    assert not problems, "classes cohort does not export by these names:\n" + "\n".join(problems)


def test_the_elastic_api_page_is_titled_with_both_jobs_by_their_names() -> None:
    title = (ROOT / "docs" / "elastic-api.md").read_text().splitlines()[0]
    assert title == "# The elastic loop: `cohort.torch.ElasticJob` and `cohort.NumpyElasticJob`"
