"""deploy/kubernetes's Redis and pods, without a cluster: a real redis-server started with the
manifests' redis.conf and the ACL file their init script writes, a coordinator and a
`cohort run` node started with the argv and environment the manifests give their pods (only
paths and ports moved to this machine), and a job that runs to its end as the role users.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from cohort.events.connection import RedisSettings, connect
from cohort.localredis import free_port
from tests.helpers import require_redis_server, wait_until
from tests.unit.test_kubernetes import DEPLOY, ROOT, argv, environment

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

JOB = "kube"
ADMIN = "pwadmin"  # the password tests/unit/test_kubernetes.environment gives each key


def manifest(path: str, kind: str) -> dict[str, Any]:
    [doc] = [d for d in yaml.safe_load_all((DEPLOY / path).read_text()) if d["kind"] == kind]
    return doc


def redis_version(binary: str) -> str:
    """major.minor of `binary` (`Redis server v=7.0.15 ...`)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return ".".join(out.split("v=", 1)[1].split(".")[:2])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, tuple[dict[str, Any], ...]]]:
    """redis-server as the StatefulSet runs it; yields its address and the ConfigMap docs."""
    binary = require_redis_server()
    port = free_port()
    address = f"127.0.0.1:{port}/0"
    data = {"job": JOB, "redis-address": address, "redis-scheme": "redis"}
    docs = ({"kind": "ConfigMap", "metadata": {"name": "cohort-job"}, "data": data},)
    statefulset = manifest("redis/statefulset.yaml", "StatefulSet")
    [init] = statefulset["spec"]["template"]["spec"]["initContainers"]
    env = environment(init, docs) | {"REDIS_VERSION": redis_version(binary)}
    env |= {
        "ACL_FILE": str(tmp_path / "users.acl"),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
    }
    subprocess.run(["sh", str(DEPLOY / "redis" / "write-acl.sh")], env=env, check=True)
    conf = tmp_path / "redis.conf"  # the manifest's, its two paths moved here
    moved = {"dir": str(tmp_path), "aclfile": env["ACL_FILE"]}
    lines = (DEPLOY / "redis" / "redis.conf").read_text().splitlines()
    conf.write_text("\n".join(_moved(line, moved) for line in lines) + "\n")
    proc = subprocess.Popen(
        [binary, str(conf), "--port", str(port), "--save", ""], stdout=subprocess.DEVNULL
    )
    try:
        admin = redis.Redis(port=port, password=ADMIN)
        wait_until(lambda: proc.poll() is not None or _answers(admin), timeout=10, message="redis")
        assert proc.poll() is None, "redis-server refused the manifest's configuration"
        yield address, docs
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _moved(line: str, paths: dict[str, str]) -> str:
    name = line.split(" ", 1)[0]
    return f"{name} {paths[name]}" if name in paths else line


def _answers(conn: redis.Redis) -> bool:
    try:
        return bool(conn.ping())
    except redis.ConnectionError:
        return False


def test_the_manifests_redis_refuses_strangers_and_keeps_what_the_coordinator_needs(
    server: tuple[str, Any],
) -> None:
    address, _ = server
    port = int(address.split(":")[1].split("/")[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    admin = redis.Redis(port=port, password=ADMIN, decode_responses=True)
    assert admin.config_get("appendonly") == {"appendonly": "yes"}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    agent = connect(RedisSettings(url=f"redis://cohort-{JOB}-torchrun:pwtorchrun@{address}"))
    agent.hset(f"cohort:{{{JOB}}}:rdzv", "state", b"x")  # torchrun's keys, its job's only
    with pytest.raises(redis.exceptions.NoPermissionError):
        agent.set("cohort:{other}:rdzv", b"x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        agent.flushall()


def test_a_job_runs_to_its_end_with_the_pods_commands_and_role_users(
    server: tuple[str, Any], tmp_path: Path
) -> None:
    address, docs = server
    (tmp_path / "job.toml").write_text("max_steps = 30\n")
    metrics = free_port()
    deployment = manifest("coordinators/deployment.yaml", "Deployment")
    [coordinator] = deployment["spec"]["template"]["spec"]["containers"]
    env = environment(coordinator, docs)
    moved = {"--config=/etc/cohort/job.toml": f"--config={tmp_path / 'job.toml'}"}
    moved["--metrics-port=9108"] = f"--metrics-port={metrics}"
    args = [moved.get(arg, arg) for arg in argv(coordinator, env)]
    assert len(set(args) & set(moved.values())) == 2  # the manifest still has both flags
    leader = subprocess.Popen(
        [sys.executable, "-m", "cohort", *args], env=_with(env), stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: _ready(metrics), timeout=30, message="the readiness probe passes")
        job = manifest("cohort-run/job.yaml", "Job")
        [train] = job["spec"]["template"]["spec"]["containers"]
        env = environment(train, docs)
        args = [
            a if not a.startswith("--run-dir=") else f"--run-dir={tmp_path}/run"
            for a in argv(train, env)
        ]
        done = subprocess.run(
            [sys.executable, "-m", "cohort", *args],
            env=_with(env), cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "audit (every sample exactly once per epoch): passed" in done.stdout
        viewer = _with(
            {**env, "COHORT_REDIS_URL": f"redis://cohort-{JOB}-viewer:pwviewer@{address}"}
        )
        status = subprocess.run(
            [sys.executable, "-m", "cohort", "status", "--json"],
            env=viewer, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert '"finished"' in status.stdout
    finally:
        leader.terminate()
        leader.wait(timeout=30)


def _with(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env}


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False
