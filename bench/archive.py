"""Redis memory per job over a long job, with and without the journal's archive; and replay
of an archived journal against the same kind of journal kept whole in Redis.

A `cohort coordinator` process leads a job of one simulated worker (bench/fleet.py: the
commands, no model) that trains STEPS steps as fast as the leader decides them: each
StepDone commits a step (a StepCommitted fact). The job runs twice, each on a fresh
redis-server: with `--journal-hot HOT --archive-uri DIR` (segments in a local directory),
and with no storage (the journal stays whole, as every job before issue 36). Every
`--every`/10 steps the bench reads, with MEMORY USAGE, what the job's journal holds in
Redis (the journal stream, its snapshot and its archive index), and the inbox beside it (the
coordinator trims the inbox to its last 10 minutes of commands, whatever the journal does);
the table shows, per `--every` steps, the most the archived run's journal held and what the
whole journal held at its end.

Then `cohort replay`'s read (`from_redis` + fold, in this process) runs on both journals,
alternating, `--runs` times: the archived one reads its segments from the directory.

    python -m bench.archive [--steps 1000000] [--hot 100000] [--every 50000] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fleet import Fleet, coordinator
from bench.results import Section, verdict
from cohort.coordinator.replay import from_redis, read_once, rebuild
from cohort.events.connection import Client
from cohort.events.keys import Keys
from cohort.events.models import StepCommitted
from cohort.events.streams import Entry, Journal
from cohort.localredis import LocalRedis
from cohort.processes import Proc

JOB = "archive"
AHEAD = 4096
"""StepDones the bench sends ahead of the last committed step, at most (and at most a
twentieth of --journal-hot, as a real job appends far fewer facts per turn than that)."""
SAMPLES = 10
"""Samples per table row: archiving makes a sawtooth, which rows alone would alias."""


@dataclass
class Sampled:
    """One run: the journal's footprint in Redis every `every` steps."""

    archived: bool
    steps: list[int] = field(default_factory=list)
    journal: list[int] = field(default_factory=list)
    """Bytes: the journal stream, the snapshot and the archive index."""
    entries: list[int] = field(default_factory=list)
    inbox: list[int] = field(default_factory=list)
    seconds: float = 0.0
    segments: int = 0


def measure(steps: int, hot: int, every: int, runs: int) -> Section:
    with (
        tempfile.TemporaryDirectory(prefix="cohort-bench-archive-") as tmp,
        LocalRedis(appendonly=False) as archived,
        LocalRedis(appendonly=False) as whole,
    ):
        samples = [
            _run(archived, steps, hot, every, Path(tmp)),
            _run(whole, steps, hot, every, None),
        ]
        times: dict[str, list[float]] = {"archived": [], "whole": []}
        for _ in range(runs):
            times["archived"].append(_replay(archived.client(), steps))
            times["whole"].append(_replay(whole.client(), steps))
    return _section(steps, hot, every, runs, samples, times)


def _run(server: LocalRedis, steps: int, hot: int, every: int, storage: Path | None) -> Sampled:
    label = "archived" if storage else "whole"
    print(f"archive: {steps:,} steps, journal {label} ...", flush=True)
    conn = server.client()
    flags = ["--min-workers", "1", "--max-workers", "1", "--heartbeat-timeout", "3600"]
    flags += ["--max-steps", str(steps), "--journal-hot", str(hot)]
    if storage is not None:
        flags += ["--archive-uri", str(storage)]
    proc = coordinator(server.url, JOB, *flags)
    sampled = Sampled(archived=storage is not None)
    try:
        fleet = Fleet(conn, JOB, 1)
        fleet.join_all()
        started = time.perf_counter()
        _train(fleet, proc, steps, hot, every, sampled)
        sampled.seconds = time.perf_counter() - started
    finally:
        proc.stop()
    sampled.segments = len(list(storage.glob("journal/*/*.segment"))) if storage else 0
    return sampled


def _train(fleet: Fleet, proc: Proc, steps: int, hot: int, every: int, sampled: Sampled) -> None:
    """Send StepDones in order, at most AHEAD past the last commit; sample SAMPLES times
    every `every` steps."""
    every = max(1, every // SAMPLES)
    ahead = max(64, min(AHEAD, hot // 20))
    conn, sent, committed = fleet.conn, 0, -1
    world = fleet.watch.state.world_version
    journal = Journal(conn, Keys(JOB).journal)
    seen = journal.last_id()
    while committed < steps - 1:
        if not proc.alive():
            raise RuntimeError(f"the coordinator exited:\n{proc.log.read_text()[-3000:]}")
        upto = min(steps, committed + 1 + ahead)
        if sent < upto:
            fleet.send(
                fleet.step_done(["w00000"])[0].model_copy(update={"step": s, "world": world})
                for s in range(sent, upto)
            )
            sent = upto
        new = journal.tail(seen, block_ms=100, count=10_000)  # waits for the next facts
        seen = new[-1].id if new else seen
        before, committed = committed, _committed(new, committed)
        if committed // every > before // every or committed == steps - 1:
            _sample(conn, committed + 1, sampled)


def _committed(new: list[Entry], known: int) -> int:
    """The last committed step, after the journal's `new` entries."""
    for fact in reversed(Journal.decode_page(new)):
        if isinstance(fact, StepCommitted):
            return max(known, fact.step)
    return known


def _sample(conn: Client, step: int, sampled: Sampled) -> None:
    keys = Keys(JOB)
    usage = [_usage(conn, k) for k in (keys.journal, keys.snapshot, keys.archive, keys.inbox)]
    sampled.steps.append(step)
    sampled.journal.append(sum(usage[:3]))
    sampled.entries.append(int(conn.xlen(keys.journal)))  # type: ignore[arg-type]
    sampled.inbox.append(usage[3])


def _usage(conn: Client, key: str) -> int:
    found: Any = conn.memory_usage(key, samples=0)
    return int(found or 0)


def _replay(conn: Client, steps: int) -> float:
    """Seconds of `cohort replay`'s read: the whole journal read, decoded and folded."""
    start = time.perf_counter()
    with read_once():
        state, _ = rebuild(from_redis(conn, JOB, with_inbox=False))
    took = time.perf_counter() - start
    assert state.last_committed == steps - 1, state.last_committed
    return took


def _section(
    steps: int,
    hot: int,
    every: int,
    runs: int,
    samples: list[Sampled],
    times: dict[str, list[float]],
) -> Section:
    archived, whole = samples
    section = Section(
        key="archive",
        title=f"Redis memory per job over {steps:,} steps, with and without the archive",
        command=f"python -m bench.archive --steps {steps} --hot {hot} --every {every} "
        f"--runs {runs}",
        header=["steps (up to)", "archived: most entries in Redis", "archived: most MB",
                "whole: entries in Redis", "whole: MB", "archived / whole"],
    )  # fmt: skip
    for step, most, most_bytes, entries, size in _rows(archived, whole):
        section.rows.append(
            [
                f"{step:,}",
                f"{most:,}",
                f"{most_bytes / 1e6:.1f}",
                f"{entries:,}",
                f"{size / 1e6:.1f}",
                f"{most_bytes / size:.2f}",
            ]
        )
    section.rows += _verdict_rows(archived, whole, hot, times)
    section.notes = _notes(archived, whole, hot, times)
    section.raw = {
        "rows": _rows(archived, whole),
        "archived": _totals(archived),
        "whole": _totals(whole),
        "replay_seconds": times,
    }
    return section


def _rows(archived: Sampled, whole: Sampled) -> list[list[int]]:
    """Per table row: steps, the archived run's most entries and bytes, the whole run's."""
    rows = []
    for start in range(0, len(archived.steps), SAMPLES):
        block = slice(start, start + SAMPLES)
        end = min(start + SAMPLES, len(archived.steps), len(whole.steps)) - 1
        rows.append(
            [
                archived.steps[end],
                max(archived.entries[block]),
                max(archived.journal[block]),
                whole.entries[end],
                whole.journal[end],
            ]
        )
    return rows


def _totals(sampled: Sampled) -> dict[str, Any]:
    return {
        "seconds": sampled.seconds,
        "segments": sampled.segments,
        "samples": len(sampled.steps),
        "most_entries": max(sampled.entries),
        "last_entries": sampled.entries[-1],
        "last_bytes": sampled.journal[-1],
        "inbox_bytes": sampled.inbox[-1],
    }


def _verdict_rows(
    archived: Sampled, whole: Sampled, hot: int, times: dict[str, list[float]]
) -> list[list[str]]:
    half = len(archived.journal) // 2
    growth = max(archived.journal[half:]) / max(archived.journal[:half])
    grew = max(whole.journal[half:]) / max(whole.journal[:half])
    most = max(archived.entries)
    replay = statistics.median(times["archived"]) / statistics.median(times["whole"])
    return [
        ["**target**", f"most entries in Redis: {most:,}", f"<= 1.01 x --journal-hot ({hot:,})",
         "", "", verdict(most, hot * 1.01, higher_is_better=False)],
        ["**target**", "most MB, second half of the run / first half", f"{growth:.2f}",
         f"whole: {grew:.2f}", "flat: <= 1.05", verdict(growth, 1.05, higher_is_better=False)],
        ["**replay**", "archived journal's read + fold, seconds (median)",
         f"{statistics.median(times['archived']):.2f}", "whole journal's",
         f"{statistics.median(times['whole']):.2f}", f"{replay:.2f}"],
    ]  # fmt: skip


def _notes(archived: Sampled, whole: Sampled, hot: int, times: dict[str, list[float]]) -> list[str]:
    last = whole.journal[-1] / max(1, whole.entries[-1])
    return [
        f"- The archived run wrote {archived.segments} segments; it trained its steps in "
        f"{archived.seconds:.0f} s, the whole-journal run in {whole.seconds:.0f} s (the "
        "bench sends StepDones as fast as the leader commits them).",
        f"- A journal entry costs Redis about {last:.0f} bytes in the whole run's stream. "
        f"Kept whole, the journal grows with the job ({whole.journal[-1] / 1e6:.1f} MB at the "
        f"end); archived, Redis holds between --journal-hot/2 and --journal-hot entries "
        f"({hot // 2:,}-{hot:,}) plus the snapshot and the index.",
        f"- The inbox is the other thing a job keeps in Redis: the coordinator trims it to "
        f"its last 10 minutes of commands, so in a run this short it holds every command "
        f"({archived.inbox[-1] / 1e6:.1f} MB at the end here); its bound is the retention "
        "window, not the job's length.",
        "- Replay reads the archived journal's segments from a local directory (sha256 "
        "checked) and Redis's tail; the whole journal is one XRANGE a page at a time. "
        f"Runs: {len(times['archived'])}, alternating.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--hot", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(measure(args.steps, args.hot, args.every, args.runs).markdown())


if __name__ == "__main__":
    main()
