"""Many simulated workers in one process, talking to a real `cohort coordinator` process.

A worker here is only its commands: Join, WeightsLoaded, Heartbeat, StepDone,
sent through pipelines, so one process can stand in for a thousand. The fleet
learns the world and the committed steps by folding the journal, like workers do.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence

from bench import scratch
from cohort.coordinator.replay import JournalWatch
from cohort.events import identity
from cohort.events.codec import FIELD, encode
from cohort.events.connection import Client
from cohort.events.keys import Keys
from cohort.events.models import Command, Heartbeat, Join, StepDone, WeightsLoaded
from cohort.processes import Proc


def spawn(url: str, name: str, *args: str, launcher: Sequence[str] = ()) -> Proc:
    """`python -m cohort ARGS` against `url`, started (through `launcher`, e.g. onto a
    simulated host), its output in a temp log file."""
    log = scratch.log_file(f"cohort-bench-{name}")
    argv = [*launcher, sys.executable, "-m", "cohort", "--redis-url", url, *args]
    proc = Proc(name, argv, log)
    proc.start()
    return proc


FLEET_DATASET = 10_000_000


def coordinator(url: str, job: str, *flags: str, launcher: Sequence[str] = ()) -> Proc:
    """A `cohort coordinator` process (AOF-less bench server: --allow-volatile)."""
    if "--dataset-size" not in flags:  # the simulated workers declare no dataset
        flags = (*flags, "--dataset-size", str(FLEET_DATASET))
    args = ("coordinator", "--job", job, "--allow-volatile", *flags)
    return spawn(url, job, *args, launcher=launcher)


def enable_identity(conn: Client, job: str) -> bytes:
    """Switch `job` to signed commands (as `cohort acl --worker` does): its job key."""
    key = Keys(job).identity
    conn.set(key, os.urandom(identity.JOB_KEY_BYTES), nx=True)
    return bytes(conn.get(key))  # type: ignore[arg-type]


class Fleet:
    """`job_key`: sign each worker's commands with its own secret (identity mode)."""

    def __init__(self, conn: Client, job: str, workers: int, job_key: bytes | None = None) -> None:
        self.conn = conn
        self.job = job
        self.inbox = Keys(job).inbox
        self.names = [f"w{i:05d}" for i in range(workers)]
        self.watch = JournalWatch.of(conn, job)
        self.signers: dict[str, identity.Signer] = {}
        if job_key is not None:
            self.signers = {
                w: identity.Signer(w, identity.secret_of(job_key, w)) for w in self.names
            }

    def send(self, commands: Iterable[Command]) -> str:
        """XADD every command in one pipeline (signed by its worker, with a job key);
        returns the last entry ID."""
        pipe = self.conn.pipeline(transaction=False)
        for command in commands:
            raw = encode(command)
            signer = self.signers.get(command.worker)
            pipe.xadd(self.inbox, signer.fields(raw) if signer else {FIELD: raw})  # type: ignore[arg-type]
        ids = pipe.execute()
        return ids[-1].decode() if ids else ""

    def until(self, predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate(self.watch.state):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout} s")
            self.watch.pull(block_ms=200)

    def join_all(self, timeout: float = 120.0) -> None:
        """Every worker joins and loads weights; returns once they form one world."""
        for start in range(0, len(self.names), 500):
            part = self.names[start : start + 500]
            self.send(Join(at=time.time(), job=self.job, worker=w) for w in part)
        self.until(lambda s: len(s.members) == len(self.names), timeout, "every join")
        for start in range(0, len(self.names), 500):
            part = self.names[start : start + 500]
            self.send(WeightsLoaded(at=time.time(), job=self.job, worker=w) for w in part)
        self.until(lambda s: len(s.ranks) == len(self.names), timeout, "the full world")

    def step_done(self, workers: Iterable[str], step_time: float = 0.1) -> list[StepDone]:
        state = self.watch.state
        return [
            StepDone(at=time.time(), job=self.job, worker=w, step=state.next_step,
                     world=state.world_version, step_time=step_time, samples=32)
            for w in workers
        ]  # fmt: skip

    def heartbeats(self, workers: Iterable[str]) -> list[Heartbeat]:
        state = self.watch.state
        last = state.last_committed if state.last_committed >= 0 else None
        return [
            Heartbeat(at=time.time(), job=self.job, worker=w, step=last,
                      world=state.world_version if last is not None else None)
            for w in workers
        ]  # fmt: skip
