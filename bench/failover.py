"""Leader SIGKILL -> a follower leading and appending, while workers keep sending.

Two `cohort coordinator` processes with a 1 s lease and 8 simulated workers
heartbeating and finishing steps. The leader is SIGKILLed; the time is from the
kill to the new leader's LeaderElected fact (its server time), the first fact it
appends. Then the killed one is started again as a follower for the next run.

There is no peer for this row: torchrun's c10d store lives in one agent and dies
with it (see the peer-death table); the target is the lease + 1 s.

    python -m bench.failover [--runs 5]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import threading
import time
from collections.abc import Callable

from bench.fleet import Fleet, coordinator
from bench.results import Section, verdict
from cohort.events.connection import Client
from cohort.events.models import LeaderElected
from cohort.localredis import LocalRedis
from cohort.processes import Proc

LEASE_S = 1.0


def _until_following(conn, name: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Wait until coordinator `name` is in its follow loop (its connection's last command is
    the journal XREAD or the lease GET), so the next kill has a follower ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for client in conn.client_list():
            if client.get("name") == f"cohort-coordinator-{name}" and client.get("cmd") in (
                "xread",
                "get",
            ):
                return
        time.sleep(0.05)  # CLIENT LIST has nothing to block on
    raise TimeoutError(f"coordinator {name!r} did not start following within {timeout} s")


def measure(runs: int = 5) -> Section:
    job = "failover"
    took: list[float] = []
    with LocalRedis(appendonly=False) as server:
        conn = server.client()
        flags = ("--lease", str(LEASE_S), "--min-workers", "8", "--heartbeat-timeout", "30")

        def start(name: str) -> Proc:
            return coordinator(server.url, job, "--id", name, *flags)

        procs = {name: start(name) for name in "ab"}
        fleet = Fleet(conn, job, 8)
        busy = threading.Event()
        try:
            fleet.join_all()
            thread = threading.Thread(target=_send, args=(server, job, busy), daemon=True)
            thread.start()
            for _ in range(runs):
                took.append(_fail_over(fleet, procs, start, conn))
            busy.set()
            thread.join()
        finally:
            busy.set()
            for proc in procs.values():
                proc.stop()
    return _section(runs, took)


def _send(server: LocalRedis, job: str, busy: threading.Event) -> None:
    """Workers go on sending heartbeats and StepDones while the leader changes."""
    sender = Fleet(server.client(), job, 8)
    while not busy.wait(0.05):
        sender.watch.pull(block_ms=0)
        sender.send([*sender.heartbeats(sender.names), *sender.step_done(sender.names)])


def _fail_over(
    fleet: Fleet, procs: dict[str, Proc], start: Callable[[str], Proc], conn: Client
) -> float:
    """SIGKILL the leader; seconds to its successor's LeaderElected. The killed one starts
    again as a follower, and a step commits before the next run."""
    fleet.watch.pull(block_ms=0)
    leader = fleet.watch.state.leader
    assert leader in procs, f"unexpected leader {leader!r}"
    epoch = fleet.watch.state.leader_epoch
    killed_at = time.time()
    procs[leader].signal(signal.SIGKILL)
    procs[leader].stop()  # reaps it
    fleet.until(lambda s, e=epoch: s.leader_epoch > e, 30, "a new leader")
    elected = [f for _, f in fleet.watch.facts if isinstance(f, LeaderElected)][-1]
    took = elected.at - killed_at
    procs[leader] = start(leader)
    _until_following(conn, leader)
    committed = fleet.watch.state.last_committed
    fleet.until(lambda s, c=committed: s.last_committed > c, 30, "steps again")
    return took


def _section(runs: int, took: list[float]) -> Section:
    med = statistics.median(took)
    return Section(
        key="failover",
        title="Leader SIGKILL to a new leader appending",
        command=f"python -m bench.failover --runs {runs}",
        header=["what", "median s", "runs, s", "target", ""],
        rows=[
            [
                f"lease {LEASE_S:g} s, 8 workers sending",
                f"{med:.2f}",
                ", ".join(f"{t:.2f}" for t in took),
                f"<= {LEASE_S + 1:g} (lease + 1)",
                verdict(med, LEASE_S + 1, higher_is_better=False),
            ]
        ],  # fmt: skip
        notes=[
            "After each takeover the test waits for a step to commit under the new leader "
            "before the next kill, so every run fails over a working job."
        ],
        raw={"seconds": took, "lease_s": LEASE_S},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(measure(args.runs).markdown())


if __name__ == "__main__":
    main()
