"""Child processes that log to a file: start, check, signal, stop, and read the log's end.

The demo and the benchmarks run `cohort` processes this way. Each child gets its own
session, so a signal reaches the process group (a worker's helpers die with it). What a
child started in a session of its own (torchrun's workers) is out of that group's reach:
`kill_tree` and `end` find it by the process tree instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO


def children(pid: int) -> list[int]:
    """The processes `pid` started that still run (or are not yet reaped), by
    /proc/PID/task/*/children; [] once `pid` is gone."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # the thread or the process ended meanwhile
    return found


def descendants(pid: int) -> list[int]:
    """Every process under `pid`: its children, theirs and so on, in whatever session or
    process group each is."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def started_at(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat), to tell it from a later
    process given the same number; None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def tree(pid: int) -> dict[int, int]:
    """`pid` and every process under it, each with its start time (`started_at`)."""
    found = {}
    for member in [pid, *descendants(pid)]:
        when = started_at(member)
        if when is not None:
            found[member] = when
    return found


def _send(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it, whatever session each is in (torchrun
    starts each worker in a session of its own: killing the agent's process group leaves
    them running). Each is stopped (SIGSTOP) as the walk finds it, so that none starts
    another, or dies and hands its children to init out of the walk's reach, before all are
    killed; the walk is repeated until it finds nothing new."""
    frozen: set[int] = set()
    while True:
        new = [p for p in [pid, *descendants(pid)] if p not in frozen]
        if not new:
            break
        for member in new:
            _send(member, signal.SIGSTOP)
        frozen.update(new)
    for member in frozen:
        _send(member, signal.SIGKILL)


def kill_left(members: dict[int, int]) -> list[int]:
    """SIGKILL each of `members` (a `tree`) that still runs, the same process as then; the
    pids killed."""
    left = [pid for pid, when in members.items() if started_at(pid) == when]
    for pid in left:
        _send(pid, signal.SIGKILL)
    return left


def _kill_all(pid: int) -> None:
    """`kill_tree`, then the process group `pid` leads if it leads one (a member its
    parent left behind is in the group still, out of the tree)."""
    try:
        leads = os.getpgid(pid) == pid
    except ProcessLookupError:
        leads = False
    kill_tree(pid)
    if leads:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def end(
    popens: Iterable[subprocess.Popen[Any]],
    sig: int = signal.SIGTERM,
    grace: float = 5.0,
    group: bool = False,
) -> None:
    """End processes this one started, and all they started: `sig` to each (to the process
    group each leads, with `group`; 0: kill at once), then SIGKILL to each still running
    `grace` seconds later with everything under it (`kill_tree`), then to whatever was under
    them when `sig` was sent and outlived them (a torchrun worker, in a session of its own,
    that its agent did not stop). Ending many takes `grace` at most, not `grace` each."""
    popens = list(popens)
    members: dict[int, int] = {}
    for popen in popens:
        if popen.poll() is not None:
            continue  # reaped: its number may be another's by now
        members.update(tree(popen.pid))
        if sig:
            with contextlib.suppress(ProcessLookupError):
                (os.killpg if group else os.kill)(popen.pid, sig)
    deadline = time.monotonic() + (grace if sig else 0.0)
    for popen in popens:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_all(popen.pid)
            popen.wait()
    kill_left(members)


def stop_all(procs: Iterable[Proc], grace: float = 5.0) -> None:
    """SIGTERM to each one's process group at once, then SIGKILL to any still running
    `grace` seconds later: stopping many takes `grace` at most, not `grace` each. What they
    started in sessions of their own dies with them too (`end`)."""
    end([proc.popen for proc in procs if proc.popen is not None], grace=grace, group=True)


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of the file at `path`; "" if it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def outcome(code: int | None) -> str:
    """A process's return code for people: "exit code 4", "killed by SIGKILL" (a negative
    code), or "running" (None)."""
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@dataclass
class Proc:
    """`argv` run as `name` in a session of its own (a signal sent to the parent's terminal
    reaches the parent only), its stdout and stderr appended to `log`; with `echo`, each
    line of its output is also handed to `echo` as it comes."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None
    echo: Callable[[str], None] | None = None
    started_at: float = 0.0
    """`time.monotonic()` when it was started."""
    _copier: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        handle = self.log.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=handle if self.echo is None else subprocess.PIPE,
            stderr=handle if self.echo is None else subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self.env,
        )
        self.started_at = time.monotonic()
        if self.echo is None:
            handle.close()
            return
        self._copier = threading.Thread(
            target=self._copy, args=(handle,), name=f"output-{self.name}", daemon=True
        )
        self._copier.start()

    def _copy(self, handle: BinaryIO) -> None:
        """Each line of the output to the log, then to `echo`, until the process closes it."""
        assert self.popen is not None and self.popen.stdout is not None and self.echo
        with handle:
            for raw in iter(self.popen.stdout.readline, b""):
                handle.write(raw)
                handle.flush()
                self.echo(raw.decode(errors="replace").rstrip("\n"))

    def drained(self, timeout: float = 5.0) -> None:
        """Wait (up to `timeout`) until the output of a process that exited is all copied."""
        if self._copier is not None:
            self._copier.join(timeout)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def outcome(self) -> str:
        """How it ended, for people: "exit code 4", "killed by SIGKILL", or "running"."""
        return outcome(None if self.popen is None else self.popen.poll())

    def signal(self, sig: int) -> None:
        """Send `sig` to its process group, if it still runs."""
        if self.alive():
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, and SIGKILL if it has not exited within `grace` seconds."""
        stop_all([self], grace)

    def tail(self, lines: int = 8) -> str:
        return tail(self.log, lines)
