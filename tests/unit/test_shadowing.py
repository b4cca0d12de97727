"""A folder named `cohort` beside a script (a clone of cohort's repository, by git's
default name) shadows the installed package: `cohort run` finds it before it starts a rank,
and names it when a rank failed that way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cohort.launcher.shadowing import first_on_path, hint, shadow, shadowing_said

PY = sys.executable


def clone(where: Path, package: bool = False) -> Path:
    """A clone of cohort's repository at `where/cohort` (or, `package`, a folder with an
    `__init__.py` of its own)."""
    top = where / "cohort"
    (top / "cohort").mkdir(parents=True)
    (top / "cohort" / "__init__.py").write_text("")
    if package:
        (top / "__init__.py").write_text("")
    return top


@pytest.mark.parametrize(
    "argv, first",
    [
        ((PY, "-u", "train.py", "--lr", "0.1"), "."),
        ((PY, "-X", "dev", "jobs/train.py"), "jobs"),
        ((PY, "-m", "train"), "."),
        (("jobs/train.py",), "jobs"),
        (("./run.sh",), None),
    ],
)
def test_the_folder_a_ranks_python_looks_in_first_is_its_scripts_or_the_working_one(
    tmp_path: Path, argv: tuple[str, ...], first: str | None
) -> None:
    found = first_on_path(argv, tmp_path)
    assert found == (None if first is None else tmp_path / first)


def test_a_clone_beside_the_script_shadows_a_package_found_only_by_an_editable_finder(
    tmp_path: Path,
) -> None:
    folder = clone(tmp_path)
    package = tmp_path / "site" / "cohort"
    argv = (PY, "-u", "train.py")
    assert shadow(argv, tmp_path, package, search=[str(tmp_path)]) == folder
    assert shadow(argv, tmp_path / "elsewhere", package, search=[]) is None  # run elsewhere
    said = shadowing_said(folder, package, argv)
    assert str(folder) in said and str(package) in said and "mv cohort cohort-src" in said


def test_a_clone_does_not_shadow_a_regular_install_but_a_package_folder_does(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    (site / "cohort").mkdir(parents=True)
    (site / "cohort" / "__init__.py").write_text("")
    here = tmp_path / "here"
    here.mkdir()
    clone(here)
    argv = (PY, "train.py")
    assert shadow(argv, here, site / "cohort", search=[str(here), str(site)]) is None
    other = tmp_path / "other"
    other.mkdir()
    folder = clone(other, package=True)
    assert shadow(argv, other, site / "cohort", search=[str(other), str(site)]) == folder


def test_the_installed_package_itself_shadows_nothing(tmp_path: Path) -> None:
    folder = clone(tmp_path, package=True)
    assert shadow((PY, "-m", "train"), tmp_path, folder, search=[]) is None


def test_a_rank_given_up_after_failing_at_import_cohort_is_told_what_may_shadow_it() -> None:
    assert "shadows the installed package" in hint(
        "AttributeError: module 'cohort' has no attribute 'torch'"
    )
    assert "shadows the installed package" in hint(
        "ModuleNotFoundError: No module named 'cohort.torch'"
    )
    assert hint("ModuleNotFoundError: No module named 'no_such_module'") == ""
