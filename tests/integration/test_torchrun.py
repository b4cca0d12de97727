"""`torchrun --rdzv-backend=cohort`: real torchrun agents on a real redis-server and a real
`cohort coordinator`, nodes SIGKILLed (the agent and its worker), a node added.

tests/integration/torchrun_nodes.py starts the nodes, with this checkout's entry point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis.exceptions import NoPermissionError

from cohort import acl
from cohort.events.connection import RedisSettings, connect
from cohort.events.keys import Keys
from tests.integration.cluster import Cluster
from tests.integration.torchrun_nodes import Node, Nodes, audited, cohort, journaled, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]
torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).with_name("torchrun_ddp.py")


def start_node(nodes: Nodes, name: str) -> Node:
    tmp = nodes.cluster.tmp
    argv = torchrun(
        nodes.cluster, SCRIPT, "--nnodes=1:3",
        # torch's own keep-alive check would drop a lost node after 90 s: the journal must;
        # no last_call_timeout: the backend's default must give the fast restart
        "--rdzv-conf=keep_alive_interval=30", "--max-restarts=10", "--monitor-interval=0.1",
    )  # fmt: skip
    return nodes.start(name, argv, {"TRAIN_UNTIL": str(tmp / "finish"), "TRAIN_STEPS": "30"})


def test_torchrun_job_survives_lost_nodes_grows_and_passes_the_audit(
    cluster: Cluster, nodes: Nodes, tmp_path: Path
) -> None:
    cluster.coordinator(
        "c1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--lease", "1"
    )
    a = start_node(nodes, "a")
    b = start_node(nodes, "b")
    nodes.wait("a and b train together", lambda: a.trains(2, 0) and b.trains(2, 0))
    cluster.until(lambda s: len(s.members) == 2, 30, "both agents journaled as members")

    # The first agent (rank 0; its agent hosted the workers' store) and its worker die.
    killed = a.kill()
    nodes.wait("b trains alone after a died", lambda: b.trains(1, killed))
    resumed_alone = b.first(1, killed) or 0.0
    assert [w for w in journaled(cluster)[1] if w.endswith(a.agent)], journaled(cluster)
    assert b.popen.poll() is None

    # A new node joins: torchrun grows the job to two again.
    c = start_node(nodes, "c")
    nodes.wait("b and c train together", lambda: b.trains(2, c.started) and c.trains(2, c.started))
    grown = (c.first(2, c.started) or 0.0) - c.started

    # The other agent (not the first) dies too.
    killed_c = c.kill()
    nodes.wait("b trains alone after c died", lambda: b.trains(1, killed_c))
    resumed_again = b.first(1, killed_c) or 0.0

    (tmp_path / "finish").touch()
    nodes.finished(b)
    cluster.until(lambda s: not s.members, 30, "every agent left or failed in the journal")
    joined, failed, left = journaled(cluster)
    assert len(joined) == 3 and sorted(failed) == sorted(
        w for w in joined if w.endswith((a.agent, c.agent))
    ), (joined, failed)
    assert left == [w for w in joined if w.endswith(b.agent)], left

    launcher = audited(cluster)["audit"]["launcher"]
    assert "membership only" in launcher["covers"]
    assert sorted(how.split(":")[0] for how in launcher["ended"].values()) == [
        "failed", "failed", "torchrun agent shut down",
    ], launcher["ended"]  # fmt: skip
    status = json.loads(cohort(cluster, "status", "--json"))
    cohort(cluster, "report", "-o", str(tmp_path / "report.html"))
    assert b.agent in (tmp_path / "report.html").read_text()
    # rounds: a+b, b alone, b+c, b alone (more if a restart raced a join): one run
    rounds = status["launcher"]
    assert rounds["runs"] == 1 and rounds["restarts"] >= 3, rounds
    assert rounds["agents"] == [] and status["phase"] == "ended"

    # A new run on the finished run's id starts cleanly (c10d's store dies with its run;
    # ours stays in Redis, closed), trains its steps and ends.
    d = start_node(nodes, "d")
    nodes.wait("a new run on the same id trains", lambda: d.trains(1, d.started))
    nodes.finished(d)
    cluster.until(
        lambda s: s.counters.runs == 2 and not s.members, 30, "the rerun journaled as a 2nd run"
    )
    print(
        f"\nb resumed {resumed_alone - killed:.1f} s after a (rank 0) was lost, "
        f"c trained {grown:.1f} s after it started, "
        f"b resumed {resumed_again - killed_c:.1f} s after c was lost"
    )


def test_agents_run_as_the_torchrun_user_of_cohort_acl(cluster: Cluster, nodes: Nodes) -> None:
    """`cohort acl --role torchrun`'s user is all an agent needs (its membership, the
    rendezvous state, the agents' store), with the URL in $COHORT_REDIS_URL and no endpoint,
    as deploy/kubernetes runs it; and it may not touch the job's other keys."""
    acl.apply(cluster.conn, cluster.job, {"torchrun": "t-pw"})
    url = acl.url_as(cluster.url, acl.user(cluster.job, "torchrun"), "t-pw")
    cluster.coordinator("c1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2")
    argv = [a for a in torchrun(cluster, SCRIPT, "--nnodes=1") if "--rdzv-endpoint" not in a]
    a = nodes.start("a", [*argv[:-1], "--rdzv-endpoint=", argv[-1]], {
        "COHORT_REDIS_URL": url, "TRAIN_STEPS": "20",
    })  # fmt: skip
    nodes.wait("a trains as the torchrun user", lambda: a.trains(1, 0))
    nodes.finished(a)
    cluster.until(lambda s: s.counters.rounds == 1 and not s.members, 30, "a's round and leave")
    assert "cannot" not in a.out.read_text() and "NOPERM" not in a.out.read_text()
    agent = connect(RedisSettings(url=url))
    with pytest.raises(NoPermissionError):
        agent.get(Keys(cluster.job).leader)
