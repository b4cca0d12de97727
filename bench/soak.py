"""1,000 simulated workers at 1 Hz (a heartbeat and a StepDone each per second) for a while.

One `cohort coordinator` process leads; the fleet (bench/fleet.py) sends each
tenth of the workers' commands every 100 ms. Measured over the window after the
full world formed:
- inbox lag: from a batch's XADD until the coordinator's cursor passed it (the
  cursor is polled every 10 ms by its own thread), p50/p99;
- the coordinator process's CPU (utime + stime from /proc) per second of wall time;
- its peak RSS (VmRSS, sampled every 200 ms).

    python -m bench.soak [--workers 1000] [--seconds 60] [--signed]

With --signed the job has an identity key and every command is signed with its worker's
secret (docs/identity.md): the leader verifies an HMAC per command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import Fleet, coordinator, enable_identity
from bench.results import Section, verdict
from cohort.events.connection import text
from cohort.events.keys import Keys
from cohort.events.streams import id_key
from cohort.localredis import LocalRedis

TICKS = 10  # per second: each tick sends one tenth of the fleet's commands


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(workers: int = 1000, seconds: float = 60.0, signed: bool = False) -> Section:
    job = "soak"
    with LocalRedis(appendonly=False) as server:
        conn = server.client()
        job_key = enable_identity(conn, job) if signed else None
        proc = coordinator(
            server.url, job, "--min-workers", str(workers), "--max-workers", str(workers),
            "--heartbeat-interval", "1", "--heartbeat-timeout", "10", "--lease", "10",
        )  # fmt: skip
        try:
            assert proc.popen is not None
            pid = proc.popen.pid
            fleet = Fleet(conn, job, workers, job_key)
            fleet.join_all()
            monitor = _Monitor(server, job, pid)
            monitor.start()
            window = _drive(fleet, pid, monitor, seconds)
            monitor.stop()
            assert proc.alive(), "the coordinator died"
            dead = conn.xlen(Keys(job).dead)
            assert dead == 0, f"{dead} commands were dead-lettered"
        except Exception:
            print(proc.tail(40))
            raise
        finally:
            proc.stop()
    return _section(workers, seconds, signed, window, monitor)


class _Monitor:
    """A thread timing each batch from its XADD until the coordinator's cursor passed it
    (polled every 10 ms), and sampling the coordinator's RSS every 200 ms."""

    def __init__(self, server: LocalRedis, job: str, pid: int) -> None:
        self.server, self.job, self.pid = server, job, pid
        self.pending: list[tuple[tuple[int, int], float]] = []  # (entry id, sent at), in order
        self.lags: list[float] = []
        self.rss: list[float] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def sent(self, last: tuple[int, int], sent_at: float) -> None:
        """A batch whose last entry is `last` was XADDed at `sent_at`."""
        with self.lock:
            self.pending.append((last, sent_at))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        watcher = self.server.client()
        key, last_rss = Keys(self.job).cursor, 0.0
        while not self.done.wait(0.01):
            raw = watcher.get(key)
            now = time.perf_counter()
            if raw is None:
                continue
            cursor = id_key(text(raw))
            with self.lock:
                while self.pending and self.pending[0][0] <= cursor:
                    self.lags.append(now - self.pending.pop(0)[1])
            if now - last_rss > 0.2:
                self.rss.append(_rss_mb(self.pid))
                last_rss = now


@dataclass(frozen=True)
class _Window:
    """What the fleet sent in the measured window, and what it cost the coordinator."""

    sent: int
    wall: float
    cpu: float
    steps: int


def _drive(fleet: Fleet, pid: int, monitor: _Monitor, seconds: float) -> _Window:
    """Send each tenth of the fleet's heartbeats and StepDones every 100 ms for `seconds`."""
    cpu0, wall0 = _cpu_seconds(pid), time.perf_counter()
    steps0 = fleet.watch.state.last_committed
    slices = [fleet.names[i::TICKS] for i in range(TICKS)]
    tick = sent = 0
    while time.perf_counter() - wall0 < seconds:
        fleet.watch.pull(block_ms=0)
        part = slices[tick % TICKS]
        sent_at = time.perf_counter()
        last = fleet.send([*fleet.heartbeats(part), *fleet.step_done(part, 1.0)])
        monitor.sent(id_key(last), sent_at)
        tick += 1
        sent += 2 * len(part)
        time.sleep(max(0.0, wall0 + tick / TICKS - time.perf_counter()))  # the pace
    wall = time.perf_counter() - wall0
    cpu = _cpu_seconds(pid) - cpu0
    fleet.watch.pull(block_ms=0)
    return _Window(sent, wall, cpu, fleet.watch.state.last_committed - steps0)


def _section(
    workers: int, seconds: float, signed: bool, window: _Window, monitor: _Monitor
) -> Section:
    """The section BENCHMARKS.md shows: lag, CPU and memory against their targets."""
    lags = sorted(monitor.lags)
    p50 = statistics.median(lags)
    p99 = lags[int(0.99 * (len(lags) - 1))]
    sent, wall, steps = window.sent, window.wall, window.steps
    load = window.cpu / wall
    peak = max(monitor.rss)
    section = Section(
        key="soak-signed" if signed else "soak",
        title=f"{workers:,} simulated workers at 1 Hz for {seconds:.0f} s"
        + (", every command signed" if signed else ""),
        command=f"python -m bench.soak --workers {workers} --seconds {seconds:g}"
        + (" --signed" if signed else ""),
        header=["what", "measured", "target", ""],
    )
    section.rows = [
        ["inbox lag p99 (p50)", f"{p99 * 1e3:.0f} ms ({p50 * 1e3:.0f} ms)", "< 500 ms",
         verdict(p99, 0.5, higher_is_better=False)],
        ["coordinator CPU, share of one core", f"{load:.0%}", "< 30%",
         verdict(load, 0.30, higher_is_better=False)],
        ["coordinator peak RSS", f"{peak:.0f} MB", "< 300 MB",
         verdict(peak, 300, higher_is_better=False)],
        ["commands per second (steps committed)",
         f"{sent / wall:,.0f} ({steps} steps in {wall:.0f} s)", "", ""],
    ]  # fmt: skip
    section.notes = _notes(signed)
    section.raw = {"lag_p50_s": p50, "lag_p99_s": p99, "cpu_share": load, "rss_peak_mb": peak,
                   "steps": steps, "seconds": wall, "batches": len(lags)}  # fmt: skip
    return section


def _notes(signed: bool) -> list[str]:
    """How the fleet paces its commands; with `signed`, what signing adds."""
    notes = [
        "Each tenth of the fleet sends its heartbeats and StepDones every 100 ms, so a step "
        "commits about once a second once all ranks have reported it. The fleet, the "
        "coordinator and redis-server share this machine's cores.",
    ]
    if signed:
        notes.append(
            "Per-worker identity (docs/identity.md): every command carries its worker's "
            "HMAC-SHA256 and the leader checks each against the secret it derives from the "
            "job key; none was dead-lettered. The unsigned section above is its peer, run "
            "back to back with it by `python -m bench --only soak,soak-signed`."
        )
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--signed", action="store_true", help="per-worker signed commands")
    args = parser.parse_args()
    print(measure(args.workers, args.seconds, args.signed).markdown())


if __name__ == "__main__":
    main()
