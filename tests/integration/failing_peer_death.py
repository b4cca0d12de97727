"""bench.peer_death's torchrun run (c10d, a worker SIGKILLed) failing midway, as it once
did: after the kill, once torchrun has started the new workers (each in a session of its
own) and before they log a step, the measurement raises. tests/integration/test_bench.py
runs it and checks that nothing the bench started is left.

    python -m tests.integration.failing_peer_death
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench import peer_death
from cohort.processes import descendants
from tests.helpers import wait_until


def _fail(
    logs: list[Path], victim: int, killed_at: float, survivor: subprocess.Popen[bytes]
) -> float:
    logged = {int(x["pid"]) for log in logs for x in peer_death._lines(log)}
    wait_until(
        lambda: set(descendants(survivor.pid)) - logged, 120, 0.05, "a worker torchrun restarted"
    )
    raise RuntimeError("induced failure: torchrun restarted its workers, none has logged yet")


if __name__ == "__main__":
    peer_death._back_after = _fail  # type: ignore[assignment]
    peer_death._torchrun_once("worker")
