"""`torchrun --rdzv-backend=cohort`: real torchrun agents on a real redis-server and a real
`cohort coordinator`, nodes SIGKILLed (the agent and its worker), a node added.

torchrun finds the backend through the `torchrun.handlers` entry point that pyproject.toml
declares: the test writes that declaration as the metadata of a `cohort-elastic` on the
agents' PYTHONPATH, ahead of any installed one, so the entry point under test is this
checkout's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cohort.events.models import WorkerFailed, WorkerJoined, WorkerLeft
from cohort.localredis import LocalRedis
from tests.helpers import entry_point_path, wait_until
from tests.integration.cluster import ROOT, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]
torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).with_name("torchrun_ddp.py")


@dataclass
class Node:
    """One torchrun agent (in a session of its own) and the log its worker writes."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    out: Path
    started: float = field(default_factory=time.time)

    @property
    def agent(self) -> str:
        """How its worker id in the cohort job ends (handler.py's agent_id)."""
        return f"-{self.popen.pid}-0"

    def lines(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]

    def trains(self, world: int, since: float) -> bool:
        return any(x["world"] == world and x["t"] > since for x in self.lines())

    def kill(self) -> float:
        """SIGKILL the agent and its worker (torchrun gives it a session of its own): the
        node is gone. Returns when."""
        worker = self.lines()[-1]["pid"]
        at = time.time()
        os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        self.popen.wait(10)
        return at

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        for pid in {x["pid"] for x in self.lines()}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def nodes(server: LocalRedis, tmp_path: Path) -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        node.stop()


def start_node(made: list[Node], url: str, job: str, tmp: Path, name: str) -> Node:
    meta = tmp / "meta"
    if not meta.exists():
        entry_point_path(tmp, ROOT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(meta), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "TRAIN_LOG": str(tmp / f"{name}.jsonl"),
        "TRAIN_UNTIL": str(tmp / "finish"),
        "TRAIN_STEPS": "30",
    }
    out = tmp / f"{name}.out"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:3", "--nproc-per-node=1",
        "--rdzv-backend=cohort", f"--rdzv-endpoint={url}", f"--rdzv-id={job}",
        # torch's own keep-alive check would drop a lost node after 90 s: the journal must;
        # no last_call_timeout: the backend's default must give the fast restart
        "--rdzv-conf=keep_alive_interval=30", "--max-restarts=10",
        "--monitor-interval=0.1",
        str(SCRIPT),
    ]  # fmt: skip
    with out.open("wb") as handle:
        popen = subprocess.Popen(
            argv, env=env, cwd=tmp, stdout=handle, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    node = Node(name, popen, tmp / f"{name}.jsonl", out)
    made.append(node)
    return node


def test_torchrun_job_survives_lost_nodes_grows_and_passes_the_audit(
    cluster: Cluster, nodes: list[Node], tmp_path: Path
) -> None:
    cluster.coordinator(
        "c1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--lease", "1"
    )
    a = start_node(nodes, cluster.url, cluster.job, tmp_path, "a")
    b = start_node(nodes, cluster.url, cluster.job, tmp_path, "b")

    def wait(what: str, done: Any, timeout: float = 60.0) -> None:
        try:
            wait_until(done, timeout, 0.05, what)
        except AssertionError:
            for node in nodes:
                print(
                    f"----- {node.name} (exit {node.popen.poll()})\n{node.out.read_text()[-4000:]}"
                )
            for proc in cluster.procs:
                print(f"----- {proc.name}\n{proc.output()[-2000:]}")
            raise

    wait("a and b train together", lambda: a.trains(2, 0) and b.trains(2, 0))
    cluster.until(lambda s: len(s.members) == 2, 30, "both agents journaled as members")

    # The first agent (rank 0; its agent hosted the workers' store) and its worker die.
    killed = a.kill()
    wait("b trains alone after a died", lambda: b.trains(1, killed))
    resumed_alone = min(x["t"] for x in b.lines() if x["world"] == 1 and x["t"] > killed)
    failed = [f for _, f in cluster.of_type(WorkerFailed)]
    assert [f.worker for f in failed if f.worker.endswith(a.agent)], failed
    assert b.popen.poll() is None

    # A new node joins: torchrun grows the job to two again.
    c = start_node(nodes, cluster.url, cluster.job, tmp_path, "c")
    wait("b and c train together", lambda: b.trains(2, c.started) and c.trains(2, c.started))
    grown = min(x["t"] for x in c.lines() if x["world"] == 2) - c.started

    # The other agent (not the first) dies too.
    killed_c = c.kill()
    wait("b trains alone after c died", lambda: b.trains(1, killed_c))
    resumed_again = min(x["t"] for x in b.lines() if x["world"] == 1 and x["t"] > killed_c)

    (tmp_path / "finish").touch()
    wait("b's agent exits", lambda: b.popen.poll() is not None)
    assert b.popen.returncode == 0, b.out.read_text()[-3000:]
    cluster.until(lambda s: not s.members, 30, "every agent left or failed in the journal")
    joined = [f.worker for _, f in cluster.of_type(WorkerJoined)]
    failed = [f.worker for _, f in cluster.of_type(WorkerFailed)]
    left = [f.worker for _, f in cluster.of_type(WorkerLeft)]
    assert len(joined) == 3 and sorted(failed) == sorted(
        w for w in joined if w.endswith((a.agent, c.agent))
    ), (joined, failed)
    assert left == [w for w in joined if w.endswith(b.agent)], left

    audit = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", cluster.url, "replay", "--job",
         cluster.job, "--audit", "--json", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stderr
    audited = json.loads(audit.stdout)["audit"]
    assert audited["ok"] is True and "membership only" in audited["launcher"]["covers"]
    ended = audited["launcher"]["ended"]
    assert sorted(how.split(":")[0] for how in ended.values()) == [
        "failed", "failed", "torchrun agent shut down",
    ], ended  # fmt: skip
    shown = {}
    for args in (("status", "--json"), ("report", "-o", str(tmp_path / "report.html"))):
        ran = subprocess.run(
            [sys.executable, "-m", "cohort", "--redis-url", cluster.url, args[0], "--job",
             cluster.job, *args[1:]],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert ran.returncode == 0, (args, ran.stderr)
        shown[args[0]] = ran.stdout
    assert b.agent in (tmp_path / "report.html").read_text()
    launcher = json.loads(shown["status"])["launcher"]
    # rounds: a+b, b alone, b+c, b alone (more if a restart raced a join): one run
    assert launcher["runs"] == 1 and launcher["restarts"] >= 3, launcher
    assert launcher["agents"] == [] and json.loads(shown["status"])["phase"] == "ended"

    # A new run on the finished run's id starts cleanly (c10d's store dies with its run;
    # ours stays in Redis, closed), trains its steps and ends.
    d = start_node(nodes, cluster.url, cluster.job, tmp_path, "d")
    wait("a new run on the same id trains", lambda: d.trains(1, d.started))
    wait("the new run ends", lambda: d.popen.poll() is not None)
    assert d.popen.returncode == 0, d.out.read_text()[-3000:]
    cluster.until(
        lambda s: s.counters.runs == 2 and not s.members, 30, "the rerun journaled as a 2nd run"
    )
    print(
        f"\nb resumed {resumed_alone - killed:.1f} s after a (rank 0) was lost, "
        f"c trained {grown:.1f} s after it started, "
        f"b resumed {resumed_again - killed_c:.1f} s after c was lost"
    )
