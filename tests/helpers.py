"""Small test tools shared by every suite. Waiting polls a condition; it never sleeps blind."""

from __future__ import annotations

import importlib
import os
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NoReturn, TypeVar

import pytest

from cohort.localredis import find_redis_server

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 5.0,
    interval: float = 0.01,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message}: not true within {timeout}s (last value {value!r})")
        pause.wait(interval)


def require_redis_server() -> str:
    """The redis-server binary; without one, skip locally but fail in CI (CI=true), where a
    missing server would mean the real-server tests proved nothing."""
    binary = find_redis_server()
    if binary is None:
        reason = "no redis-server binary on PATH (or $COHORT_REDIS_SERVER)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must run the real-server tests")
        pytest.skip(reason)
    return binary


def require_package(name: str) -> ModuleType:
    """The module `name`; without it, skip locally but fail where COHORT_REQUIRE_ECOSYSTEM=1
    (.ci/run installs the `ecosystem` extra and sets it), where a skip would hide that
    Lightning or Accelerate no longer runs on cohort."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        reason = f"{name} is not installed (pip install -e '.[ecosystem]'): {exc}"
        if os.environ.get("COHORT_REQUIRE_ECOSYSTEM") == "1":
            pytest.fail(f"{reason}; COHORT_REQUIRE_ECOSYSTEM=1 asks for these tests")
        pytest.skip(reason)


def require_torch() -> None:
    """Skip without torch locally (the README's `pip install -e '.[dev]'` brings none), but
    fail in CI (CI=true), where .ci/run installs it and a skip would prove nothing."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")


def processes_mentioning(text: str, parent: int | None = None) -> list[str]:
    """Processes whose command line holds `text` (only children of `parent`, if given:
    other test runs on this machine may run demos too)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if text in cmdline and (parent is None or ppid == parent):
            found.append(f"{pid}: {cmdline}")
    return found


def entry_point_path(tmp: Path, root: Path) -> Path:
    """A directory holding `root`'s pyproject.toml entry points as `cohort-elastic`'s
    metadata: ahead of site-packages on PYTHONPATH, a subprocess finds this checkout's entry
    points, not those of whatever copy is installed."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = tmp / "meta" / f"cohort_elastic-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: cohort-elastic\nVersion: {project['version']}\n"
    )
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
            for group, points in groups.items()
        )
    )
    return info.parent


def require_netsim() -> None:
    """Skip (with bench.netsim's one line) where network namespaces cannot be made; fail
    instead where COHORT_REQUIRE_NETSIM=1 (.ci/run sets it when it runs as root)."""
    from bench import netsim

    reason = netsim.available()
    if reason is None:
        return
    if os.environ.get("COHORT_REQUIRE_NETSIM") == "1":
        pytest.fail(f"{reason}; COHORT_REQUIRE_NETSIM=1 asks for the simulated-network tests")
    pytest.skip(reason)


def spawned_done() -> NoReturn:
    """End a process `torch.multiprocessing` spawned, its work done and written: at once,
    without the interpreter's teardown, where gloo's threads now and then abort the process
    ("terminate called without an active exception"), which the parent takes for a crash."""
    os._exit(0)
