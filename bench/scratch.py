"""A benchmark run's temporary directory: its processes' logs while it runs, gone once it
has succeeded, kept where it failed."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import TracebackType


def discard(tmp: Path, keep: str = "") -> None:
    """Delete a run's temporary directory, unless an exception is on its way (called from a
    `finally`) or the caller says why to `keep` it (a run that measured something wrong):
    then its logs are the only record, and stderr says where."""
    if sys.exc_info()[1] is not None:
        print(f"the failed run's logs are kept in {tmp}", file=sys.stderr)
    elif keep:
        print(f"{keep}: the run's logs are kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


_logs: Path | None = None
"""This process's directory of its benchmarks' process logs (made at the first)."""
_failed = False
"""Whether an uncaught exception is ending this process: its logs are then kept."""


def log_file(name: str) -> Path:
    """A new log file for a benchmark's process `name`. The logs go into one directory per
    benchmark process, deleted as it exits, unless an uncaught exception ends it: then they
    are the failure's record, and stderr says where. (A failure a benchmark catches quotes
    the log's end in its own message.)"""
    global _logs
    if _logs is None:
        _logs = Path(tempfile.mkdtemp(prefix="cohort-bench-logs-"))
        _note_failures()
        atexit.register(_discard_logs)
    handle, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=_logs)
    os.close(handle)  # the process's own handle opens it again, to append
    return Path(path)


def _note_failures() -> None:
    previous = sys.excepthook

    def noted(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        global _failed
        _failed = True
        previous(kind, value, trace)

    sys.excepthook = noted


def _discard_logs() -> None:
    if _logs is None:
        return
    if _failed:
        print(f"the failed run's process logs are kept in {_logs}", file=sys.stderr)
    else:
        shutil.rmtree(_logs, ignore_errors=True)
