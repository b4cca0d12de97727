"""The two commands of the README, the CI script and the compose file stay true to each other."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", readme, re.S)
    assert block, "README has no quick start block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_quick_start_is_exactly_two_commands_a_run_and_the_tests() -> None:
    first, second = quick_start()
    install, run = first.split(" && ")
    assert install == "pip install -e '.[dev]'"
    assert run.startswith("cohort run ") and "--chaos" in run  # a rank is killed on the way
    assert (ROOT / run.split()[-1]).is_file()  # the example script it runs
    assert second.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command_unchanged() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick_start()[1] in ci.splitlines()
    assert "apt-get install -y -q redis-server" in ci


def test_ci_checks_lint_format_and_types_in_a_fresh_venv_before_the_tests() -> None:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    order = [
        "rm -rf .venv",
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        "ruff check .",
        "ruff format --check .",
        "mypy",
        quick_start()[1],
    ]
    assert [line for line in lines if line in order] == order


def test_ci_installs_lightning_and_accelerate_and_fails_their_tests_instead_of_skipping() -> None:
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "python -m pip install -q -e '.[dev,ecosystem]'" in ci
    assert "export COHORT_REQUIRE_ECOSYSTEM=1" in ci
    extra = _pyproject()["project"]["optional-dependencies"]["ecosystem"]
    assert {re.split(r"[<>=!~ ]", spec)[0] for spec in extra} == {"lightning", "accelerate"}


def test_readme_installs_the_cpu_build_of_torch_before_the_torch_extra() -> None:
    """The extra alone pulls a CUDA build (GBs) on a machine without a GPU."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### PyTorch") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the PyTorch section has no install commands"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands[:2] == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        "pip install -e '.[torch]'",
    ]


def test_compose_runs_redis_with_aof_and_two_nodes_under_the_launcher() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes"
    nodes = {name: s for name, s in services.items() if s.get("command", [""])[0] == "run"}
    assert len(nodes) == 2
    named = [s["command"][s["command"].index("--node") + 1] for s in nodes.values()]
    assert len(set(named)) == 2  # two launchers of one job need two node names
    for service in nodes.values():
        assert service["environment"]["COHORT_REDIS_URL"] == "redis://redis:6379/0"
        assert (ROOT / service["command"][-1]).is_file()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY examples ./examples" in dockerfile


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the docker compose plugin is not installed here",
)
def test_docker_compose_config_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker", "compose", "config", "--quiet"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- one namespace

PRODUCT_FOLDERS = {
    "events": "cohort.events",
    "coordinator": "cohort.coordinator",
    "worker": "cohort.worker",
}


def _pyproject() -> dict:  # type: ignore[type-arg]
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_product_folders_install_under_the_cohort_namespace_only() -> None:
    setup = _pyproject()["tool"]["setuptools"]
    mapping = setup["package-dir"]
    assert mapping == {"cohort": "cohort", **{v: k for k, v in PRODUCT_FOLDERS.items()}}
    installed = set()
    for folder, package in {"cohort": "cohort", **PRODUCT_FOLDERS}.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            inner = init.parent.relative_to(ROOT / folder).parts
            installed.add(".".join((package, *inner)))
    assert set(setup["packages"]) == installed, "pyproject.toml lists every package folder"


def test_no_module_imports_the_product_folders_as_top_level_packages() -> None:
    import ast

    offenders = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") or part in ("build", "dist") for part in path.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in PRODUCT_FOLDERS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert offenders == []


def test_the_distribution_name_is_not_the_unrelated_pypi_cohort() -> None:
    project = _pyproject()["project"]
    assert project["name"] == "cohort-elastic"
    assert project["scripts"] == {"cohort": "cohort.cli:main"}


def test_outside_the_repository_only_cohort_imports_and_it_exposes_the_api(tmp_path: Path) -> None:
    """Run where the repository is not on sys.path: the installed package is all there is."""
    probe = (
        "import importlib, sys\n"
        "for name in ('events', 'worker', 'coordinator'):\n"
        "    try:\n"
        "        found = importlib.import_module(name).__file__ or ''\n"
        "    except ImportError:\n"
        "        continue\n"
        "    if found.startswith(sys.argv[1]):  # another project's `events` is not ours\n"
        "        sys.exit(f'{name} imported from {found}')\n"
        "import cohort\n"
        "lazy = ('torch', 'ElasticProcessGroup')  # need the torch extra\n"
        "missing = [n for n in cohort.__all__ if n not in lazy and not hasattr(cohort, n)]\n"
        "assert not missing, missing\n"
        "print(' '.join(sorted(cohort.__all__)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe, str(ROOT)], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    exported = set(result.stdout.split())
    assert {"Worker", "Collective", "RedisSettings", "connect", "WorldChangedError"} <= exported


@pytest.mark.parametrize("folder", ["bench", "examples", "tests/integration"])
def test_no_folder_torchrun_runs_scripts_from_shadows_the_standard_library(folder: str) -> None:
    """torchrun runs a script with the script's folder first on sys.path: a module there named
    like one of the standard library's (bench/profile.py once) replaces it for every import
    of it, torch's own included (torch._dynamo imports cProfile, which imports profile)."""
    shadows = [p.name for p in (ROOT / folder).glob("*.py") if p.stem in sys.stdlib_module_names]
    assert shadows == []
