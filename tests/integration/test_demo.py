"""The demo's phases, with real processes: a phase that waits on processes which have all
exited stops at once, naming them, instead of waiting for its deadline."""

from __future__ import annotations

import sys
from contextlib import ExitStack

import pytest

from cohort.demo import Demo, DemoFailedError
from cohort.localredis import LocalRedis
from cohort.processes import Proc

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

SLEEPER = "import time; time.sleep(120)"
CRASHER = "print('worker cannot train: no GPU left'); raise SystemExit(3)"


def _demo(stack: ExitStack, server: LocalRedis) -> Demo:
    demo = Demo(stack, "phases", workers=2, steps=24)
    demo.start_redis(server.url, keep=True)
    return demo


def _start(demo: Demo, name: str, code: str) -> Proc:
    proc = Proc(name, [sys.executable, "-c", code], demo.tmp / f"{name}.log")
    demo.procs[name] = proc
    proc.start()
    return proc


def test_every_worker_gone_before_the_last_step_fails_the_phase_at_once(
    server: LocalRedis,
) -> None:
    with ExitStack() as stack:
        demo = _demo(stack, server)
        coordinator = _start(demo, "coord-1", SLEEPER)
        for name in ("worker-1", "worker-2"):
            _start(demo, name, CRASHER)
        with pytest.raises(DemoFailedError) as failed, demo.live():
            demo.kill_a_worker()
        # the phase's own check, not the demo's deadline, ended it
        assert str(failed.value) == (
            "every worker has exited at step 0 of 24 "
            "(worker-1: exit code 3, worker-2: exit code 3); worker-1's log ends:"
        )
        assert [p.name for p in failed.value.procs] == ["worker-1"]
        assert "no GPU left" in failed.value.procs[0].tail()
        assert coordinator.alive()
    assert not coordinator.alive()  # the demo's clean-up stopped what still ran


def test_every_coordinator_gone_fails_the_phase_and_names_the_one_not_killed_by_the_demo(
    server: LocalRedis,
) -> None:
    with ExitStack() as stack:
        demo = _demo(stack, server)
        _start(demo, "coord-1", SLEEPER)
        _start(demo, "coord-2", "print('coordinator lost its lease'); raise SystemExit(4)")
        worker = _start(demo, "worker-1", SLEEPER)
        demo.kill("coord-1")
        with pytest.raises(DemoFailedError) as failed, demo.live():
            demo.wait_for_the_end()
        assert str(failed.value) == (
            "every coordinator has exited before the job's end "
            "(coord-1: killed by the demo, coord-2: exit code 4); coord-2's log ends:"
        )
        assert "lost its lease" in failed.value.procs[0].tail()
        assert worker.alive()
    assert not worker.alive()
