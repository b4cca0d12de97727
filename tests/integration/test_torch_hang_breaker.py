"""A hung gloo all_reduce after a peer dies: blocked without cohort, broken within seconds with it.

Two gloo ranks (real processes) run an all_reduce loop; one is SIGKILLed. On one host the
kernel would reset the dead rank's sockets and gloo would fail at once, which is not the
failure that hangs clusters: a host that dies or drops off the network sends no FIN/RST.
So the victim forks a child right after joining the group that inherits its sockets and
outlives it ("keeper"): to the survivor the victim's connections stay open and silent,
exactly as when its machine vanished.

This file is also the rank program: `python -m tests.integration.test_torch_hang_breaker
plain|cohort ...`, printing one JSON line per event.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.localredis import free_port  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.integration.cluster import Cluster, Process  # noqa: E402

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

INTERVAL, TIMEOUT = 0.5, 2.0
"""The coordinator's heartbeat interval and timeout (a worker is failed after TIMEOUT s)."""
GLOO_TIMEOUT = 20.0
"""Gloo's own timeout in the plain run: what the survivor would otherwise wait for."""
PACE = 0.01


# ------------------------------------------------------------------ the rank programs
def say(**fields: Any) -> None:
    print(json.dumps({"t": time.time(), **fields}), flush=True)


def keep_sockets_open() -> int:
    """Fork a child holding this process's sockets until SIGTERM (at most 120 s)."""
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        signal.sigtimedwait({signal.SIGTERM}, 120)
        os._exit(0)
    return pid


def plain_rank(rank: int, port: int, victim: int) -> None:
    """torch.distributed alone: a TCPStore on `port`, gloo, all_reduce until something breaks."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=GLOO_TIMEOUT)
    )
    if rank == victim:
        say(event="keeper", pid=keep_sockets_open())
    pause = threading.Event()
    step = 0
    while True:
        tensor = torch.ones(1000)
        try:
            dist.all_reduce(tensor)
        except RuntimeError as exc:
            say(event="raised", step=step, error=str(exc)[:200])
            return
        say(event="step", step=step, size=2, value=float(tensor[0]))
        step += 1
        pause.wait(PACE)  # pacing, standing in for compute


def cohort_rank(url: str, job: str, name: str, victim: bool, steps_alone: int) -> None:
    """A cohort worker: a gloo group per world from ElasticProcessGroup, all_reduce through its
    guard."""
    from cohort.events.connection import RedisSettings, connect
    from cohort.worker.errors import WorldChangedError
    from cohort.worker.membership.client import Worker
    from cohort.worker.pytorch.dist import ElasticProcessGroup

    conn = connect(RedisSettings(url=url))
    worker = Worker(conn, job, worker_id=name)
    worker.join()
    worker.ready(step=0)
    rendezvous = ElasticProcessGroup(worker, conn, job, host="127.0.0.1", timeout=60)
    pause = threading.Event()
    kept = together = False
    step, alone = 0, 0  # alone: steps in a world of one after a world of two
    while alone < steps_alone:
        world = rendezvous.init_process_group("gloo")
        say(event="world", version=world.version, rank=world.rank, size=world.size)
        if victim and not kept and world.size == 2:
            say(event="keeper", pid=keep_sockets_open())
            kept = True
        together = together or world.size == 2
        step = max(step, world.start_step, worker.next_step)
        try:
            while alone < steps_alone:
                worker.batch(step)  # (a real loop takes its data here) marks the step begun
                tensor = torch.ones(1000)
                rendezvous.all_reduce(tensor, step)
                say(event="step", step=step, size=world.size, value=float(tensor[0]))
                worker.step_done(step)
                worker.wait_committed(step, timeout=30)
                alone += together and world.size == 1
                step += 1
                pause.wait(PACE)  # pacing, standing in for compute
        except WorldChangedError as exc:
            dog = rendezvous.watchdog
            say(
                event="raised",
                step=step,
                error=str(exc),
                reason=dog.reason if dog else "",
                tripped_at=dog.tripped_at if dog else None,
                monotonic=time.monotonic(),
            )
    say(event="done", step=step)
    rendezvous.close()
    worker.leave(reason="done")


def finishing_rank(url: str, job: str, name: str, steps: int, first: bool) -> None:
    """A cohort worker that trains `steps` steps in a world of two and ends normally: the
    `first` leaves at once; the other waits (its watchdog running) until the first has left."""
    from cohort.events.connection import RedisSettings, connect
    from cohort.worker.membership.client import Worker
    from cohort.worker.pytorch.dist import ElasticProcessGroup

    conn = connect(RedisSettings(url=url))
    worker = Worker(conn, job, worker_id=name)
    worker.join()
    worker.ready(step=0)
    rendezvous = ElasticProcessGroup(worker, conn, job, host="127.0.0.1", timeout=60)
    world = rendezvous.init_process_group("gloo")  # a world of two: --min-workers 2
    start = max(world.start_step, worker.next_step)
    for step in range(start, start + steps):
        worker.batch(step)
        rendezvous.all_reduce(torch.ones(10), step)
        worker.step_done(step)
        worker.wait_committed(step, timeout=30)
    if not first:
        worker.wait_for(lambda v: len(v.members) == 1, timeout=30)  # the peer has left
    say(event="done", size=world.size)
    rendezvous.close()
    worker.leave(reason="done")


# ------------------------------------------------------------------ the tests
def events(proc: Process) -> list[dict[str, Any]]:
    out = []
    for line in proc.output().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def last(proc: Process, kind: str) -> dict[str, Any] | None:
    found = [e for e in events(proc) if e["event"] == kind]
    return found[-1] if found else None


def spawn(cluster: Cluster, name: str, *args: str) -> Process:
    return cluster.python(name, "-m", "tests.integration.test_torch_hang_breaker", *args)


def end_keeper(proc: Process) -> None:
    keeper = last(proc, "keeper")
    if keeper is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper["pid"], signal.SIGKILL)


def finished(proc: Process, timeout: float) -> int:
    """`proc`'s exit code; if it is stuck, fail showing its threads' stacks."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.popen.send_signal(signal.SIGUSR1)
        wait_until(lambda: "most recent call first" in proc.output(), 10, message="stacks")
        raise AssertionError(f"{proc.name} is stuck:\n{proc.output()[-8000:]}") from None


def test_without_cohort_the_survivor_stays_blocked_after_a_peer_is_killed(
    cluster: Cluster,
) -> None:
    port = str(free_port())
    survivor = spawn(cluster, "rank0", "plain", "0", port, "1")
    victim = spawn(cluster, "rank1", "plain", "1", port, "1")
    try:
        wait_until(
            lambda: (last(survivor, "step") or {}).get("step", -1) >= 20,
            timeout=60,
            message="both ranks all_reducing",
        )
        wait_until(lambda: last(victim, "keeper"), timeout=10, message="the keeper forked")
        victim.kill(signal.SIGKILL)
        killed = time.monotonic()
        victim.wait(10)
        stalled_at = (last(survivor, "step") or {})["step"]
        # However long we watch, within heartbeat_timeout + 2 s the survivor neither
        # raises nor steps: it is blocked in all_reduce until gloo's 20 s timeout.
        deadline = killed + TIMEOUT + 2.0
        pause = threading.Event()
        while time.monotonic() < deadline:
            assert survivor.alive() and last(survivor, "raised") is None
            pause.wait(0.1)
        assert last(survivor, "raised") is None
        assert (last(survivor, "step") or {})["step"] <= stalled_at + 1
        print(
            f"without cohort: survivor still blocked {time.monotonic() - killed:.1f} s "
            f"after the SIGKILL (gloo timeout {GLOO_TIMEOUT:g} s)"
        )
    finally:
        end_keeper(victim)
        survivor.popen.kill()


def test_with_cohorts_watchdog_the_survivor_raises_within_seconds_and_goes_on_alone(
    cluster: Cluster,
) -> None:
    cluster.coordinator(
        "c1",
        "--min-workers",
        "1",
        "--heartbeat-interval",
        str(INTERVAL),
        "--heartbeat-timeout",
        str(TIMEOUT),
        "--lease",
        "1",
    )
    survivor = spawn(cluster, "a", "cohort", cluster.url, cluster.job, "a", "0")
    victim = spawn(cluster, "b", "cohort", cluster.url, cluster.job, "b", "1")
    try:

        def training_together() -> bool:
            steps = [e for e in events(survivor) if e["event"] == "step" and e["size"] == 2]
            return len(steps) >= 20

        try:
            wait_until(
                training_together, timeout=90, message="a and b all_reducing in a world of 2"
            )
        except AssertionError:
            print(survivor.output()[-3000:], victim.output()[-3000:])
            raise
        assert all(
            e["value"] == 2.0 for e in events(survivor) if e["event"] == "step" and e["size"] == 2
        )
        wait_until(lambda: last(victim, "keeper"), timeout=10, message="the keeper forked")
        killed_wall = victim.kill(signal.SIGKILL)
        victim.wait(10)

        def raised_after_the_kill() -> dict[str, Any] | None:
            found = [e for e in events(survivor) if e["event"] == "raised" and e["t"] > killed_wall]
            return found[0] if found else None

        raised = wait_until(
            raised_after_the_kill,
            timeout=TIMEOUT + 10,
            message="the survivor's all_reduce raised",
        )
        took = raised["t"] - killed_wall
        print(
            f"with cohort: SIGKILL -> WorldChangedError in the survivor {took:.2f} s "
            f"(heartbeat_timeout {TIMEOUT:g} s, interval {INTERVAL:g} s; gloo would wait "
            f"{5 * 60} s); watchdog: {raised['reason']}"
        )
        assert took <= TIMEOUT + 2.0
        assert "breaking its collectives" in survivor.output()  # a live all_reduce was cut
        assert finished(survivor, 60) == 0, survivor.output()[-3000:]
        alone = [
            e
            for e in events(survivor)
            if e["event"] == "step" and e["size"] == 1 and e["t"] > raised["t"]
        ]
        assert len(alone) >= 10 and all(e["value"] == 1.0 for e in alone)
        assert alone[0]["step"] >= raised["step"] - 1
    finally:
        end_keeper(victim)


def test_ranks_that_end_normally_log_no_broken_collective(cluster: Cluster) -> None:
    """A peer leaving at the end of a job ends the world for the other rank, whose
    watchdog still runs; no collective was running, so nothing is reported broken."""
    cluster.coordinator("c1", "--min-workers", "2", "--heartbeat-timeout", "5", "--lease", "1")
    first = spawn(cluster, "a", "finish", cluster.url, cluster.job, "a", "1")
    last_ = spawn(cluster, "b", "finish", cluster.url, cluster.job, "b", "0")
    for rank in (first, last_):
        assert finished(rank, 120) == 0, rank.output()[-3000:]
    assert [(last(r, "done") or {}).get("size") for r in (first, last_)] == [2, 2]
    assert "breaking its collectives" not in first.output() + last_.output()
    assert "WARNING" not in last_.output(), last_.output()[-3000:]


def main(argv: list[str]) -> None:
    if argv[0] == "plain":
        plain_rank(int(argv[1]), int(argv[2]), int(argv[3]))
    elif argv[0] == "finish":
        url, job, name, first = argv[1:5]
        finishing_rank(url, job, name, steps=10, first=first == "1")
    else:
        url, job, name, victim = argv[1:5]
        cohort_rank(url, job, name, victim == "1", steps_alone=20)


if __name__ == "__main__":
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # a stuck rank's stacks, for whoever debugs it
    main(sys.argv[1:])
