"""Leader failover with real processes: SIGKILL, SIGSTOP/SIGCONT, commands counted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import msgpack
import pytest

from cohort.events.keys import Keys
from cohort.events.models import Heartbeat, Join, JoinRefused, LeaderElected, WorkerJoined
from cohort.events.streams import Inbox
from tests.helpers import wait_until
from tests.integration.cluster import Cluster, ms

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

LEASE = 1.0
COORD = (
    "--lease",
    str(LEASE),
    "--heartbeat-timeout",
    "600",
    "--heartbeat-interval",
    "1",
    "--max-workers",
    "100000",
)


class Sender(threading.Thread):
    """Workers joining and heartbeating at a steady pace: every command counted."""

    def __init__(self, cluster: Cluster, job: str) -> None:
        super().__init__(daemon=True)
        self.inbox = Inbox(cluster.conn, Keys(job).inbox)
        self.job = job
        self.joins: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            name = f"w{n:05d}"
            self.inbox.send(Join(at=time.time(), job=self.job, worker=name))
            self.joins.append(name)
            for other in self.joins[-20:]:
                self.inbox.send(Heartbeat(at=time.time(), job=self.job, worker=other))
            n += 1
            self.stop.wait(0.005)  # pacing of the simulated workers, not a wait for a condition


def leader_name(cluster: Cluster) -> str | None:
    cluster.pull()
    return cluster.state.leader


def test_sigkilled_leader_is_replaced_within_lease_and_no_command_is_lost_or_doubled(
    cluster: Cluster,
) -> None:
    c1 = cluster.coordinator("c1", *COORD)
    cluster.until(lambda s: s.leader == "c1", message="c1 leads")
    c2 = cluster.coordinator("c2", *COORD)
    sender = Sender(cluster, cluster.job)
    sender.start()
    cluster.until(lambda s: s.counters.joined >= 200, message="joins flow")
    wait_until(lambda: "c2" in cluster.conn.client_list().__repr__(), 10, message="c2 connected")
    killed_at = c1.kill(signal.SIGKILL)
    cluster.until(lambda s: s.leader == "c2", timeout=LEASE + 10, message="c2 takes over")
    after_takeover = len(sender.joins)
    cluster.until(lambda s: s.counters.joined >= after_takeover + 100, message="joins flow again")
    sender.stop.set()
    sender.join()
    sent = list(sender.joins)
    cluster.until(
        lambda s: s.counters.joined + s.counters.refused >= len(sent),
        timeout=30,
        message="every join decided",
    )

    # Every Join is decided exactly once: none lost, none applied twice.
    decided = Counter(
        f.worker for _, f in cluster.facts if isinstance(f, WorkerJoined | JoinRefused)
    )
    assert set(decided) == set(sent)
    assert max(decided.values()) == 1

    elected = cluster.of_type(LeaderElected)
    assert [f.epoch for _, f in elected] == [1, 2]
    took = ms(elected[1][0]) - killed_at
    print(f"failover: new leader appended {took:.3f} s after SIGKILL (lease {LEASE} s)")
    assert took <= LEASE + 1.0

    # The live leader's state equals a replay of the journal.
    view = wait_until(lambda: _status_at_tail(cluster), 10, message="leader status at journal tail")
    replayed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cohort",
            "--redis-url",
            cluster.url,
            "replay",
            "--job",
            cluster.job,
            "--until",
            view["journal_id"],
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(replayed.stdout)["state"]["state_hash"] == view["state_hash"]
    assert c2.alive()


def _status_at_tail(cluster: Cluster) -> dict | None:
    raw = cluster.conn.get(Keys(cluster.job).status)
    if not raw:
        return None
    body = msgpack.unpackb(raw)
    cluster.pull()
    return body if body["journal_id"] == cluster.journal_id else None


def test_stale_leader_resumed_after_sigstop_cannot_append(cluster: Cluster) -> None:
    c1 = cluster.coordinator("c1", *COORD)
    cluster.until(lambda s: s.leader == "c1", message="c1 leads")
    cluster.coordinator("c2", *COORD)
    inbox = Inbox(cluster.conn, Keys(cluster.job).inbox)
    c1.kill(signal.SIGSTOP)
    cluster.until(lambda s: s.leader == "c2", timeout=LEASE + 10, message="c2 takes over")
    for n in range(50):
        inbox.send(Join(at=time.time(), job=cluster.job, worker=f"late{n}"))
    c1.kill(signal.SIGCONT)
    wait_until(
        lambda: "no longer the leader" in c1.output() or "failed to renew" in c1.output(),
        15,
        message="c1 notices it lost the lease",
    )
    for n in range(50, 100):
        inbox.send(Join(at=time.time(), job=cluster.job, worker=f"late{n}"))
    cluster.until(lambda s: s.counters.joined >= 100, message="all joins decided")
    joined = Counter(f.worker for _, f in cluster.facts if isinstance(f, WorkerJoined))
    assert len(joined) == 100 and max(joined.values()) == 1
    assert [f.coordinator for _, f in cluster.of_type(LeaderElected)] == ["c1", "c2"]
    assert cluster.conn.get(Keys(cluster.job).leader).decode().startswith("2:")
