"""Real cohort processes against a real redis-server, killed with real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from cohort.coordinator.fold import evolve
from cohort.coordinator.state import JobState
from cohort.events.codec import decode_command, decode_fact
from cohort.events.keys import Keys
from cohort.events.models import Command, Fact
from cohort.events.streams import ZERO, Inbox, Journal, id_ms
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Process:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Send `sig`; returns the wall-clock time it was sent."""
        at = time.time()
        self.popen.send_signal(sig)
        return at

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        """The JSON line a worker prints last, as it exits."""
        return dict(json.loads(self.output().strip().splitlines()[-1]))

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)


@dataclass
class Cluster:
    """A job on a real Redis: start coordinators and workers, read its journal."""

    url: str
    conn: redis.Redis
    job: str
    tmp: Path
    procs: list[Process] = field(default_factory=list)
    state: JobState = field(default_factory=JobState)
    journal_id: str = ZERO
    facts: list[tuple[str, Fact]] = field(default_factory=list)

    def spawn(self, name: str, *args: str) -> Process:
        """`cohort *args` against this job's Redis."""
        return self.python(name, "-m", "cohort", "--redis-url", self.url, *args)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`cohort *args` against this job's Redis, run to its end, its output captured."""
        return subprocess.run(
            [sys.executable, "-m", "cohort", "--redis-url", self.url, *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def python(self, name: str, *args: str, env: dict[str, str] | None = None) -> Process:
        """`python *args`, run from the project's root (with `env` added to the
        environment), its output in `tmp/name.log`; `stop` ends it."""
        log = self.tmp / f"{name}.log"
        argv = [sys.executable, *args]
        handle = log.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        popen = subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )  # fmt: skip
        handle.close()
        proc = Process(name, argv, log, popen)
        self.procs.append(proc)
        return proc

    def coordinator(self, name: str, *flags: str) -> Process:
        """A coordinator of this job; a test that names no dataset size gets 2048 samples (its
        workers declare none)."""
        if not any(f.startswith("--dataset-size") or f == "--config" for f in flags):
            flags = (*flags, "--dataset-size", "2048")
        return self.spawn(name, "coordinator", "--job", self.job, "--id", name, *flags)

    def trainer_coordinator(
        self, name: str, *flags: str, workers: int = 2, interval: float = 0.5, timeout: float = 2.0
    ) -> Process:
        """A coordinator for the bundled trainer's data (2048 samples, batches of 32), at
        least `workers` to train, heartbeats every `interval` s, failed after `timeout` s,
        a 1 s lease."""
        return self.coordinator(
            name, "--min-workers", str(workers), "--dataset-size", "2048", "--batch-size", "32",
            "--heartbeat-interval", str(interval), "--heartbeat-timeout", str(timeout),
            "--lease", "1", *flags,
        )  # fmt: skip

    def worker(self, name: str, *flags: str) -> Process:
        return self.spawn(name, "worker", "--job", self.job, "--id", name, *flags)

    def example_worker(
        self, name: str, steps: int | None, *flags: str, save: bool = False
    ) -> Process:
        """The bundled trainer for `steps` steps (None: until the job finishes); with `save`,
        its weights go to `saved(name)`."""
        saving = ("--save", str(self.saved(name))) if save else ()
        length = ("--steps", str(steps)) if steps is not None else ()
        return self.spawn(
            name, "example-worker", "--job", self.job, "--id", name, *length, *saving, *flags,
        )  # fmt: skip

    def saved(self, name: str) -> Path:
        return self.tmp / f"{name}.npz"

    def pull(self) -> JobState:
        """Fold what the journal gained since the last pull."""
        for entry_id, fields in self.conn.xrange(
            Keys(self.job).journal, f"({self.journal_id}" if self.journal_id != ZERO else "-", "+"
        ):
            fact = decode_fact(fields[b"e"])
            self.state = evolve(self.state, fact)
            self.journal_id = entry_id.decode()
            self.facts.append((self.journal_id, fact))
        return self.state

    def until(self, predicate, timeout: float = 30.0, message: str = "condition"):  # type: ignore[no-untyped-def]
        """Wait (pulling the journal) until `predicate(state)` holds; dump logs if it never does."""
        try:
            return wait_until(lambda: predicate(self.pull()), timeout, 0.02, message)
        except AssertionError:
            for proc in self.procs:
                print(f"----- {proc.name} (alive={proc.alive()})\n{proc.output()[-3000:]}")
            raise

    def finished(self, proc: Process, timeout: float = 120.0) -> int:
        """Wait for `proc` to exit; on a timeout, show every process's log, then fail."""
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for other in self.procs:
                print(f"----- {other.name} (alive={other.alive()})\n{other.output()[-3000:]}")
            raise

    def commands(self) -> list[tuple[str, Command]]:
        """The job's inbox as it stands: (entry ID, command); IDs carry the server's clock."""
        rows = Inbox(self.conn, Keys(self.job).inbox).range()
        return [(entry.id, decode_command(entry.raw or b"")) for entry in rows]

    def of_type(self, cls: type) -> list[tuple[str, Fact]]:
        self.pull()
        return [(i, f) for i, f in self.facts if isinstance(f, cls)]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.alive():
                try:
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.send_signal(signal.SIGTERM)
                    proc.popen.wait(5)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    proc.popen.kill()
                    proc.popen.wait()


def journal(conn: redis.Redis, job: str) -> Journal:
    return Journal(conn, Keys(job).journal)


def ms(entry_id: str) -> float:
    return id_ms(entry_id) / 1000
