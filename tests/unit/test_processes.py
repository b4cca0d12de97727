"""Ending what a process started in sessions of its own (cohort/processes.py): torchrun's
workers, which killing the agent's process group leaves running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cohort.processes import descendants, end, kill_tree
from tests.helpers import wait_until

# a parent that starts a child in a session of its own, says its pid, and waits
PARENT = """
import subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"],
                         start_new_session=True)
print(child.pid, flush=True)
threading.Event().wait()
"""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _parent() -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert os.getsid(child) != os.getsid(parent.pid)  # out of the parent's group's reach
    assert descendants(parent.pid) == [child]
    return parent, child


def test_kill_tree_ends_a_child_in_a_session_of_its_own_with_its_parent() -> None:
    parent, child = _parent()
    kill_tree(parent.pid)
    assert parent.wait(10) == -signal.SIGKILL
    wait_until(lambda: not _running(child), 10, 0.01, "the child ended")


@pytest.mark.parametrize("sig", [signal.SIGTERM, 0])
def test_end_leaves_nothing_the_parent_started_even_when_the_parent_leaves_it(sig: int) -> None:
    """SIGTERM ends the parent alone (its child outlives it) and 0 kills at once: either
    way, the child ends too."""
    parent, child = _parent()
    end([parent], sig, grace=10)
    assert parent.returncode == -(sig or signal.SIGKILL)
    wait_until(lambda: not _running(child), 10, 0.01, "the child ended")
