"""Quick benchmark runs that must leave nothing running: `python -m bench --quick --only ...`
in a subprocess, then a count of what it started that is still alive.

A process counts as the bench's if
- its environment holds the run's token (every process the bench starts inherits it:
  torchrun's workers in sessions of their own, redis-servers, multiprocessing ranks), or
- its command line names a script of this checkout's bench/, it started after the run
  did, and it holds no other run's token, or
- it is a descendant of this test process that was not there before the run.
Other agents' and other tests' processes match none of these.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cohort.processes import descendants, kill_tree, started_at
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "COHORT_BENCH_RUN"
LEFT_WITHIN_S = 30.0
"""How long a process the bench started may take to exit after the bench itself did."""


def _read(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; only its parent's wait is missing)."""
    stat = _read(pid, "stat")
    return bool(stat) and not stat.rsplit(b")", 1)[1].split()[0].startswith((b"Z", b"X"))


def _ticks() -> int:
    """Now, in the unit of a process's start time: clock ticks since boot."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return int(uptime * os.sysconf("SC_CLK_TCK"))


def describe(pid: int) -> str:
    """`pid` and its command line."""
    argv = _read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    return f"{pid}: {argv}"


@dataclass
class QuickBench:
    """Runs of `python -m bench` (or any command) marked with a token of their own."""

    tmp: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    before: set[int] = field(default_factory=set)
    since: int = 0
    """When the last run began, in clock ticks since boot (as a process's start time)."""

    def quick(self, sections: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """`python -m bench --quick --only SECTIONS`, its page written in `tmp` with the raw
        JSON beside it, then `nothing_left`."""
        out = self.tmp / "B.md"
        argv = [sys.executable, "-m", "bench", "--quick", "--only", sections, "--out", str(out)]
        return self.run(argv, timeout)

    def run(
        self, argv: list[str], timeout: float = 900, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`argv` from the checkout's root with the token, its output captured; then
        `nothing_left`: fails naming each process it left running."""
        self.before = set(descendants(os.getpid()))
        self.since = _ticks()
        env = {**os.environ, **(env or {}), TOKEN: self.token}
        try:
            return subprocess.run(
                argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:  # killed: what it started is still up
            self.clean()
            raise AssertionError(f"the bench ran past {timeout:.0f} s: {argv}") from exc
        finally:
            self.nothing_left()

    def left(self) -> list[int]:
        """The bench's processes still running."""
        mine = os.getpid()
        new = set(descendants(mine)) - self.before
        scripts = str(ROOT / "bench").encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == mine:
                continue
            pid = int(entry.name)
            env = _read(pid, "environ").split(b"\0")
            marked = f"{TOKEN}={self.token}".encode() in env
            # another run's (a test on another xdist worker): never this run's to count or kill
            theirs = not marked and any(e.startswith(f"{TOKEN}=".encode()) for e in env)
            named = scripts in _read(pid, "cmdline") and (started_at(pid) or 0) > self.since
            named = named and not theirs
            if (marked or named or pid in new) and _running(pid):
                found.append(pid)
        return found

    def nothing_left(self, within: float = LEFT_WITHIN_S) -> None:
        """Wait (up to `within` s) for every process the run started to end; else kill
        them and fail, naming each."""
        try:
            wait_until(lambda: not self.left(), within, 0.1, "the bench's processes ended")
        except AssertionError:
            named = [describe(pid) for pid in self.left()]
            self.clean()
            if named:
                raise AssertionError("the bench left running:\n" + "\n".join(named)) from None

    def clean(self) -> None:
        """SIGKILL whatever the runs left (and all under it)."""
        for pid in self.left():
            with contextlib.suppress(OSError):
                kill_tree(pid)
