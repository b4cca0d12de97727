"""`cohort run` started as a user starts it, for tests: its output, its run directory, its
journal and the processes it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from cohort.coordinator.replay import JournalWatch
from cohort.events.connection import RedisSettings, connect
from tests.helpers import processes_mentioning, wait_until


class Launch:
    """A `cohort run` process started as a user would, its output collected as it comes.
    Every one started is ended after its test (`end_all`, the integration conftest), a test
    that failed before its launcher exited included."""

    started: list[Launch] = []

    def __init__(self, *args: str, cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("COHORT_REDIS_URL", "COHORT_JOB")}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "cohort", "run", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a terminal gives a job
        )
        self.lines: list[str] = []
        self.seen: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        Launch.started.append(self)

    @classmethod
    def end_all(cls) -> None:
        """SIGKILL the process group of every launch still running (its reaper then ends
        what the launcher started), and forget them."""
        for launch in cls.started:
            if launch.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(launch.popen.pid, signal.SIGKILL)
                launch.popen.wait(30)
        cls.started.clear()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float = 180) -> int:
        code = self.popen.wait(timeout)
        self._reader.join(10)
        return code

    def run_json(self) -> dict[str, Any]:
        line = wait_until(
            lambda: next((x for x in self.lines if "logs in " in x), None), 30, message="run dir"
        )
        run_json = Path(line.split("logs in ")[1].strip()) / "run.json"
        wait_until(run_json.exists, 30, message="run.json")
        return json.loads(run_json.read_text())  # type: ignore[no-any-return]

    def journal(self) -> JournalWatch:
        body = self.run_json()
        conn = connect(RedisSettings.resolve(body["redis_url"]))
        return JournalWatch.of(conn, body["job"])

    def children(self, text: str = "") -> dict[int, str]:
        """The launcher's own processes now (ranks, coordinators, Redis, reaper), remembered
        so that `left` can later check each one is gone."""
        found = {}
        for line in processes_mentioning(text, parent=self.popen.pid):
            pid, cmdline = line.split(": ", 1)
            found[int(pid)] = cmdline
        self.seen.update(found)
        return found

    def ranks(self, script: str) -> set[int]:
        return set(self.children(script))

    def left(self) -> list[int]:
        """Processes it started that still run."""
        return [pid for pid in self.seen if running(pid)]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def training(watch: JournalWatch, ranks: int, steps: int = 5) -> bool:
    """Whether a world of `ranks` trains: `steps` committed, the last of them in this world
    (a world that just formed has trained nothing yet: a rank killed then never trained in
    it, and under load the job could end before the world that follows)."""
    watch.pull(100)
    state = watch.state
    done = max(steps, state.base_step)
    return len(state.ranks) == ranks and state.last_committed >= done and not state.paused


def worker_of(pid: int) -> str:
    """The worker id the launcher gave process `pid` ($COHORT_WORKER_ID)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"COHORT_WORKER_ID="))
