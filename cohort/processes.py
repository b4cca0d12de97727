"""Child processes that log to a file: start, check, signal, stop, and read the log's end.

The demo and the benchmarks run `cohort` processes this way. Each child gets its own
session, so a signal reaches the process group (a worker's helpers die with it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO


def stop_all(procs: Iterable[Proc], grace: float = 5.0) -> None:
    """SIGTERM to each at once, then SIGKILL to any still running `grace` seconds later:
    stopping many takes `grace` at most, not `grace` each."""
    started = [proc for proc in procs if proc.popen is not None]
    for proc in started:
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in started:
        assert proc.popen is not None
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            proc.popen.wait()


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
