"""The README's training script runs as it is written, against a real coordinator."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.cluster import ROOT, Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


def quick_start_run() -> list[str]:
    """The README's main command, after its install: `cohort run ... examples/x.py`."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", readme, re.S)
    assert block, "README has no quick start block"
    first = block.group(1).splitlines()[0].split("#")[0].strip()
    return first.split(" && ")[1].split()


def readme_script() -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(
        r"a training script uses the worker client.*?```python\n(.*?)```", readme, re.S
    )
    assert block, "README has no training script"
    return block.group(1)


def test_the_readme_training_script_trains_to_its_last_step(server: object, tmp_path: Path) -> None:
    cluster_url = server.url  # type: ignore[attr-defined]
    cluster = Cluster(url=cluster_url, conn=server.client(), job="mnist", tmp=tmp_path)  # type: ignore[attr-defined]
    try:
        coordinator = cluster.coordinator(
            "c1", "--min-workers", "1", "--dataset-size", "5000", "--max-steps", "100"
        )
        script = tmp_path / "train.py"
        script.write_text(readme_script())
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,  # outside the repository: only the installed package
            env={**os.environ, "COHORT_REDIS_URL": server.url},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert cluster.finished(coordinator, 60) == 0  # the job finished, its worker left
        cluster.pull()
        assert cluster.state.last_committed == 99 and cluster.state.finished
        assert cluster.state.counters.left == 1 and not cluster.state.members
    finally:
        cluster.stop()


def test_the_quick_start_run_kills_a_rank_replaces_it_and_ends_audited(tmp_path: Path) -> None:
    """The main command as the README writes it, on the embedded default (no Redis
    configured), in a folder of its own holding the example it names."""
    command = quick_start_run()
    script = Path(command[-1])
    (tmp_path / script.parent).mkdir(parents=True)
    (tmp_path / script).write_text((ROOT / script).read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("COHORT_REDIS_URL", "COHORT_JOB")}
    result = subprocess.run(
        [sys.executable, "-m", "cohort", *command[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "chaos: SIGKILL" in result.stdout and "replacing it in 0 s" in result.stdout
    assert "finished" in result.stdout
    assert "audit (every sample exactly once per epoch): passed" in result.stdout
