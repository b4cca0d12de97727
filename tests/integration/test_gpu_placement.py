"""One GPU per process under a real `cohort run`, on a machine without a GPU.

The launcher trusts an inherited CUDA_VISIBLE_DEVICES as the node's GPUs (it opens none to
check), so three made-up GPU UUIDs stand for a three-GPU node: `-n 2 --spares 1` gives each
rank and the spare one of them, what each script reads in its own environment, and the
process that replaces a killed rank gets its slot's GPU again. More processes than GPUs are
refused before anything starts, naming the -n and --spares that fit.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from cohort.errors import Exit
from tests.helpers import wait_until
from tests.integration.launch import Launch, training

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("run_script.py"))
FAST = ("--heartbeat-timeout", "2", "--heartbeat-interval", "0.5", "--batch-size", "16")
GPUS = "GPU-aaaa,GPU-bbbb,GPU-cccc"


def _seen(folder: Path, worker: str, timeout: float) -> dict[str, Any]:
    """What `worker`'s process wrote of its environment as it started (run_script --env-to)."""
    path = folder / f"{worker}.json"
    wait_until(path.exists, timeout, message=f"{worker} started")
    seen: dict[str, Any] = json.loads(path.read_text())
    return seen


def test_each_rank_and_spare_gets_a_gpu_of_its_own_and_a_replacement_its_slots_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", GPUS)
    out = tmp_path / "env"
    out.mkdir()
    run = Launch(
        "-n", "2", "--spares", "1", "--node", "n", *FAST, "--epochs", "200",
        SCRIPT, "0.05", "--env-to", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert run.run_json()["gpus"] == GPUS.split(",")
    watch = run.journal()
    wait_until(lambda: training(watch, 2, steps=2), 90, message="two ranks training")
    first = {w: _seen(out, w, 60) for w in ("n-0", "n-1", "n-2")}
    assert {
        w: (s["local_rank"], s["spare"], s["cuda_visible_devices"]) for w, s in first.items()
    } == {
        "n-0": ("0", "0", "GPU-aaaa"),
        "n-1": ("1", "0", "GPU-bbbb"),
        "n-2": ("2", "1", "GPU-cccc"),  # the spare's own: promoted, it shares no rank's GPU
    }
    assert "one GPU each (CUDA_VISIBLE_DEVICES='GPU-aaaa,GPU-bbbb,GPU-cccc')" in run.output

    os.kill(first["n-0"]["pid"], signal.SIGKILL)
    again = _seen(out, "n-0.1", 90)  # the killed rank's slot, its next process
    assert (again["local_rank"], again["cuda_visible_devices"]) == ("0", "GPU-aaaa")

    os.kill(run.popen.pid, signal.SIGTERM)  # every rank finishes its step and leaves
    assert run.wait(120) == Exit.INTERRUPTED, run.output[-3000:]


def test_more_processes_than_gpus_are_refused_naming_what_fits_and_nothing_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    run = Launch("-n", "4", "--spares", "1", SCRIPT, cwd=tmp_path)
    assert run.wait(60) == Exit.USAGE, run.output
    assert (
        "-n 4 --spares 1: 5 processes need 5 GPUs, one each; this node has 4 "
        "(CUDA_VISIBLE_DEVICES='0,1,2,3'): give -n 3 --spares 1" in run.output
    )
    assert "Traceback" not in run.output
    assert not (tmp_path / "cohort-runs").exists() and run.seen == set()
