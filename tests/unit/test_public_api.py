"""`import cohort` is the whole public API: its names are listed once in each of three places
that must agree, every one of them loads, and every exception cohort has is a CohortError."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import cohort
from tests.helpers import require_torch

SOURCE = Path(cohort.__file__).read_text()


def _literal(tree: ast.Module, name: str) -> ast.expr:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            assert node.value is not None
            return node.value
    raise AssertionError(f"cohort/__init__.py has no {name}")


def listings(source: str) -> dict[str, dict[str, str]]:
    """Each place's public names, with the module each one comes from (`__all__` says none)."""
    tree = ast.parse(source)
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    for alias in stmt.names:
                        name = alias.asname or alias.name
                        module = stmt.module
                        if alias.asname:  # `from pkg import module as name`
                            module = f"{stmt.module}.{alias.name}"
                        typed[name] = module
    homes = ast.literal_eval(_literal(tree, "_HOMES"))
    modules = ast.literal_eval(_literal(tree, "_MODULES"))
    lazy = {name: module for module, names in homes.items() for name in names}
    lazy.update(modules)
    for name, module in typed.items():  # a class's module is its import's
        if name not in modules and not module.endswith(f".{name}"):
            continue
        typed[name] = modules.get(name, module)
    everything = ast.literal_eval(_literal(tree, "__all__"))
    return {"TYPE_CHECKING": typed, "__all__": dict.fromkeys(everything, ""), "lazy": lazy}


def disagreements(source: str) -> list[str]:
    """What the three listings of `source` do not agree on."""
    places = listings(source)
    found = []
    names = set().union(*places.values())
    for name in sorted(names):
        missing = [place for place, listed in places.items() if name not in listed]
        if missing:
            found.append(f"{name} is missing from {', '.join(missing)}")
    typed, lazy = places["TYPE_CHECKING"], places["lazy"]
    for name in sorted(typed.keys() & lazy.keys()):
        if typed[name] != lazy[name]:
            found.append(
                f"{name}: TYPE_CHECKING imports it from {typed[name]}, lazy from {lazy[name]}"
            )
    if len(places["__all__"]) != len(ast.literal_eval(_literal(ast.parse(source), "__all__"))):
        found.append("__all__ names a name twice")
    return found


def test_the_three_listings_name_the_same_public_names_from_the_same_modules() -> None:
    assert disagreements(SOURCE) == []


@pytest.mark.parametrize(
    ("dropped", "place"),
    [
        ("\n        Finished,", "TYPE_CHECKING"),
        ('\n    "Finished",', "__all__"),
        ('\n        "Finished",', "lazy"),
    ],
)
def test_a_name_dropped_from_any_one_place_is_caught(dropped: str, place: str) -> None:
    assert SOURCE.count(dropped) == 1
    assert disagreements(SOURCE.replace(dropped, "")) == [f"Finished is missing from {place}"]


def test_a_name_loaded_from_another_module_than_the_one_type_checkers_see_is_caught() -> None:
    moved = SOURCE.replace(
        '"cohort.worker.membership.client": ("Worker",)',
        '"cohort.worker.loop.elastic": ("Worker",)',
    )
    assert any(line.startswith("Worker:") for line in disagreements(moved))


def test_every_public_name_loads() -> None:
    require_torch()  # cohort.torch's names too
    for name in cohort.__all__:
        assert getattr(cohort, name) is not None, name
    assert cohort.torch.ElasticJob.__module__ == "cohort.worker.pytorch.elastic"


def test_every_public_exception_is_a_cohort_error() -> None:
    errors = [
        getattr(cohort, name)
        for name in cohort.__all__
        if isinstance(getattr(cohort, name), type)
        and issubclass(getattr(cohort, name), BaseException)
    ]
    assert len(errors) > 20
    assert [e.__name__ for e in errors if not issubclass(e, cohort.CohortError)] == []


def test_every_exception_cohort_defines_derives_from_the_one_root() -> None:
    """Not only the exported ones: a script may meet any of them through a public call."""
    require_torch()  # every module, cohort.torch's too
    defined = []
    for info in pkgutil.walk_packages(cohort.__path__, "cohort."):
        if info.name.endswith("__main__"):
            continue  # runs the command line
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                defined.append(value)
    assert len(defined) > 30
    assert (
        sorted(
            f"{e.__module__}.{e.__name__}" for e in defined if not issubclass(e, cohort.CohortError)
        )
        == []
    )


def test_a_bad_job_name_is_a_cohort_error_a_script_can_catch() -> None:
    with pytest.raises(cohort.CohortError, match="job name 'bad name' is not valid"):
        cohort.NumpyElasticJob("bad name")
    assert issubclass(cohort.JobNameError, ValueError)


def test_a_bad_value_given_to_cohort_is_a_cohort_error_and_a_value_error() -> None:
    from cohort.worker.collective.compressors import compressor

    with pytest.raises(cohort.InvalidValueError, match="'zip'") as raised:
        compressor("zip")  # type: ignore[arg-type]
    assert isinstance(raised.value, cohort.CohortError)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("ElasticJob", "NumpyElasticJob"),
        ("Rendezvous", "ElasticProcessGroup"),
        ("RedisUnreachable", "RedisUnreachableError"),
        ("WaitTimeout", "WaitTimeoutError"),
        ("Removed", "RemovedError"),
    ],
)
def test_an_old_name_still_works_and_says_its_new_name(old: str, new: str) -> None:
    if new == "ElasticProcessGroup":
        require_torch()  # a torch class
    with pytest.warns(DeprecationWarning, match=f"now named cohort.{new}"):
        value = getattr(cohort, old)
    assert value is getattr(cohort, new)
    assert old not in cohort.__all__


def test_the_new_names_say_nothing_deprecated() -> None:
    require_torch()  # ElasticProcessGroup is a torch class
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cohort.NumpyElasticJob.__name__ == "NumpyElasticJob"
        assert cohort.ElasticProcessGroup.__name__ == "ElasticProcessGroup"


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("cohort.worker.errors", "CollectiveTimeout", "CollectiveTimeoutError"),
        ("cohort.events.errors", "ForgedCommand", "ForgedCommandError"),
        ("cohort.coordinator.errors", "ConfigConflict", "ConfigConflictError"),
    ],
)
def test_a_module_answers_to_the_old_name_of_an_error_it_renamed(
    module: str, old: str, new: str
) -> None:
    errors = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is now named {module}.{new}"):
        value = getattr(errors, old)
    assert value is getattr(errors, new)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchError'"):
        errors.NoSuchError  # noqa: B018


def test_errors_are_named_error_and_the_rest_say_they_are_control_flow() -> None:
    require_torch()  # every module, cohort.torch's too
    for info in pkgutil.walk_packages(cohort.__path__, "cohort."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if not (isinstance(value, type) and issubclass(value, BaseException)):
                continue
            if value.__module__ != module.__name__ or value.__name__.endswith("Error"):
                continue
            assert "control flow" in " ".join((value.__doc__ or "").lower().split()), value


@pytest.mark.parametrize(
    "code",
    [
        "import cohort.torch as t, cohort; assert cohort.torch is t",
        "import cohort; t = cohort.torch; import cohort.torch as u; assert t is u",
        "from cohort.torch import ElasticJob as J; import cohort as c;"
        "assert c.torch.ElasticJob is J",
    ],
)
def test_cohort_torch_is_one_real_module_however_a_script_reaches_it(code: str) -> None:
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _without_torch(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by a Python that cannot import torch (a sitecustomize blocks it)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )


def test_star_import_works_without_torch_and_leaves_the_torch_names_out(tmp_path: Path) -> None:
    done = _without_torch(
        tmp_path, "from cohort import *\nprint(NumpyElasticJob.__name__, 'torch' in dir())"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["NumpyElasticJob", "False"]


@pytest.mark.parametrize(
    "code, what",
    [
        ("import cohort.torch", "cohort.torch"),
        ("from cohort.torch import ElasticJob", "cohort.torch"),
        ("import cohort; cohort.torch.ElasticJob", "cohort.torch"),
        ("import cohort; cohort.ElasticProcessGroup", "cohort.ElasticProcessGroup"),
    ],
)
def test_what_needs_torch_names_the_extra_that_installs_it(
    tmp_path: Path, code: str, what: str
) -> None:
    done = _without_torch(tmp_path, code)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ModuleNotFoundError: {what} needs PyTorch"), last
    assert last.endswith("pip install 'cohort-elastic[torch]'") and last.count("needs") == 1
