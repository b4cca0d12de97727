"""Nothing the launcher started outlives it, however it ends.

The reaper is a small process in a session of its own that the launcher keeps a pipe to.
The launcher tells it each process group it starts (`watch`) and each one that ended
(`forget`); when the pipe closes without a `release` (the launcher was SIGKILLed, or its
whole process group was), the reaper SIGKILLs every group still on its list: the ranks
with whatever they started, the coordinators, the private redis-server. A launcher that
ends normally has stopped them itself and `release`s the reaper.

Run as `python -m cohort.launcher.reaper [SIGNUM...]` (signals it ignores); it reads lines
`+PGID`, `-PGID` and `release`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import IO


class Reaper:
    """The launcher's side of the reaper: a pipe it writes what to kill if it dies."""

    def __init__(self, ignore: tuple[signal.Signals, ...] = ()) -> None:
        """`ignore`: signals meant for the launcher that reach its every process (SLURM's
        --signal), which the reaper must outlive."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cohort.launcher.reaper", *(str(int(s)) for s in ignore)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the launcher's process group may die: not the reaper
        )
        assert self.process.stdin is not None
        self._pipe: IO[bytes] = self.process.stdin

    def watch(self, pgid: int) -> None:
        self._say(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        self._say(f"-{pgid}")

    def release(self) -> None:
        """The launcher stopped everything itself: the reaper exits without killing."""
        self._say("release")
        self._pipe.close()
        self.process.wait(5)

    def _say(self, line: str) -> None:
        self._pipe.write(f"{line}\n".encode())
        self._pipe.flush()


def reap(lines: IO[str]) -> list[int]:
    """Follow the launcher's lines until the pipe closes; the groups left to kill then
    (none after a `release`)."""
    groups: list[int] = []
    for line in lines:
        word = line.strip()
        if word == "release":
            return []
        if word.startswith("+"):
            groups.append(int(word[1:]))
        elif word.startswith("-") and int(word[1:]) in groups:
            groups.remove(int(word[1:]))
    return groups


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to handle
    for number in sys.argv[1:]:  # and so is the drain signal
        signal.signal(int(number), signal.SIG_IGN)
    for pgid in reap(sys.stdin):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(pgid, signal.SIGKILL)


if __name__ == "__main__":
    main()
