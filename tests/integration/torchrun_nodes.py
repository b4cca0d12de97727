"""torchrun agents as the nodes of a test: real launchers (`torchrun`, `accelerate launch`)
with `--rdzv-backend=cohort` on the test's redis-server, each in a session of its own, read
through the JSON lines their training scripts append, and SIGKILLed as a lost machine is.

torchrun finds the backend through the `torchrun.handlers` entry point that pyproject.toml
declares: each node gets that declaration as the metadata of a `cohort-elastic` on its
PYTHONPATH, ahead of any installed one, so the entry point under test is this checkout's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cohort.events.models import WorkerFailed, WorkerJoined, WorkerLeft
from tests.helpers import entry_point_path, wait_until
from tests.integration.cluster import ROOT, Cluster


@dataclass
class Node:
    """One launcher (the torchrun agent, in a session of its own) and the log its workers
    write: one JSON line a step with at least t, pid, rank and world."""

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
        return self.first(world, since) is not None

    def first(self, world: int, since: float) -> float | None:
        """When its workers first trained a step in a world of `world` after `since`."""
        return min((x["t"] for x in self.lines() if x["world"] == world and x["t"] > since),
                   default=None)  # fmt: skip

    def rank(self) -> int:
        """The rank its worker had at its latest step."""
        return int(self.lines()[-1]["rank"])

    def kill(self) -> float:
        """SIGKILL the agent and its worker: the node is gone. Returns when."""
        at = self.send(signal.SIGKILL)
        self.popen.wait(10)
        return at

    def hang(self) -> float:
        """SIGSTOP the agent and its worker: the node hangs, its connections open, as a
        machine cut off the network. Returns when."""
        return self.send(signal.SIGSTOP)

    def send(self, sig: int) -> float:
        """Send `sig` to the agent's process group and to its latest worker: torchrun starts
        each worker in a session of its own, out of the agent's group. Returns when."""
        worker = self.lines()[-1]["pid"]
        at = time.time()
        os.killpg(self.popen.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, sig)
        return at

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        for pid in {x["pid"] for x in self.lines()}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def torchrun(cluster: Cluster, script: Path, *flags: str) -> list[str]:
    """The torchrun command of one node of `cluster`'s job: one worker, our backend, the
    job's Redis and id, then `flags` (torchrun's own) and the script."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
        "--rdzv-backend=cohort", f"--rdzv-endpoint={cluster.url}", f"--rdzv-id={cluster.job}",
        *flags, str(script),
    ]  # fmt: skip


class Nodes:
    """The nodes a test starts on `cluster`'s job; `stop` kills what is left of them."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.made: list[Node] = []

    def start(
        self, name: str, argv: list[str], env: Mapping[str, str | None] | None = None
    ) -> Node:
        """Run `argv` in a session of its own from the test's temp dir, its workers logging
        to `name`.jsonl there, with `env` added to the environment (None: taken out)."""
        tmp = self.cluster.tmp
        meta = tmp / "meta"
        if not meta.exists():
            entry_point_path(tmp, ROOT)
        path = os.pathsep.join([str(meta), str(ROOT), os.environ.get("PYTHONPATH", "")])
        added = {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
                 "TRAIN_LOG": str(tmp / f"{name}.jsonl"), **(env or {})}  # fmt: skip
        full = {k: v for k, v in {**os.environ, **added}.items() if v is not None}
        out = tmp / f"{name}.out"
        with out.open("wb") as handle:
            popen = subprocess.Popen(
                argv, env=full, cwd=tmp, stdout=handle, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        node = Node(name, popen, tmp / f"{name}.jsonl", out)
        self.made.append(node)
        return node

    def wait(self, what: str, done: Callable[[], Any], timeout: float = 60.0) -> None:
        """Wait until `done()`; if it never is, show every node's and process's output."""
        try:
            wait_until(done, timeout, 0.05, what)
        except AssertionError:
            self.show()
            raise

    def finished(self, node: Node, timeout: float = 120.0) -> None:
        """Wait for `node`'s launcher to exit, and require exit code 0."""
        self.wait(f"{node.name}'s launcher exits", lambda: node.popen.poll() is not None, timeout)
        assert node.popen.returncode == 0, node.out.read_text()[-3000:]

    def show(self) -> None:
        for node in self.made:
            print(f"----- {node.name} (exit {node.popen.poll()})\n{node.out.read_text()[-4000:]}")
        for proc in self.cluster.procs:
            print(f"----- {proc.name}\n{proc.output()[-2000:]}")

    def stop(self) -> None:
        for node in self.made:
            node.stop()


def journaled(cluster: Cluster) -> tuple[list[str], list[str], list[str]]:
    """The agents the journal says joined, failed and left, in its order."""
    return (
        [f.worker for _, f in cluster.of_type(WorkerJoined)],
        [f.worker for _, f in cluster.of_type(WorkerFailed)],
        [f.worker for _, f in cluster.of_type(WorkerLeft)],
    )


def cohort(cluster: Cluster, *args: str) -> str:
    """`cohort ARGS --job J` on the job's Redis, as a user types it; its output, once it
    exits 0."""
    shown = subprocess.run(
        [sys.executable, "-m", "cohort", "--redis-url", cluster.url, args[0], "--job",
         cluster.job, *args[1:]],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, (args, shown.stderr)
    return shown.stdout


def audited(cluster: Cluster) -> dict[str, Any]:
    """`cohort replay --audit --json --timeline` of the job, which must find nothing wrong:
    its state, its verdict and its facts (`timeline`: type, entry id and the fact's fields)."""
    audit: dict[str, Any] = json.loads(cohort(cluster, "replay", "--audit", "--json", "--timeline"))
    assert audit["audit"]["ok"] is True, audit["audit"]
    return audit
