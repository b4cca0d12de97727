"""The two commands of the README, the CI script and the compose file stay true to each other."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", readme, re.S)
    assert block, "README has no quick start block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_quick_start_is_exactly_two_commands_demo_and_tests() -> None:
    first, second = quick_start()
    assert first.endswith("cohort demo")
    assert second.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command_unchanged() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick_start()[1] in ci.splitlines()
    assert "apt-get install -y -q redis-server" in ci


def test_compose_runs_redis_with_aof_two_coordinators_and_workers() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "--appendonly" in services["redis"]["command"]
    assert (
        services["redis"]["command"][services["redis"]["command"].index("--appendonly") + 1]
        == "yes"
    )
    coordinators = [s for s in services.values() if "coordinator" in s.get("command", [])]
    assert len(coordinators) == 2
    assert services["worker"]["command"][0] == "example-worker"
    for name in ("coordinator-1", "coordinator-2", "worker"):
        assert services[name]["environment"]["COHORT_REDIS_URL"] == "redis://redis:6379/0"


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
