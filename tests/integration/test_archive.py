"""A job whose journal's cold part moved to storage, run by real processes on a real Redis:
Redis keeps a hot tail, the leader is SIGKILLed mid-run, and replay, audit, export, report
and status read the archived job as they read the same journal kept whole."""

from __future__ import annotations

import json
from pathlib import Path

from cohort.coordinator.replay import Run, export, from_redis
from cohort.events.archive import History
from cohort.events.keys import Keys
from cohort.events.streams import ZERO, Entry, Journal
from tests.integration.cluster import Cluster

HOT = 200
STEPS = 700


class Mirror:
    """Every journal entry as it was appended: the journal an unarchived job would hold."""

    def __init__(self, job: Cluster) -> None:
        keys = Keys(job.job)
        self.history = History(Journal(job.conn, keys.journal), keys)
        self.entries: list[Entry] = []

    def pull(self) -> int:
        after = self.entries[-1].id if self.entries else ZERO
        new = [e for page in self.history.journal.pages(after) for e in page]
        assert self.history.intact(after), "the test's mirror fell behind a trim"
        self.entries += new
        return len(self.entries)


def test_an_archived_job_replays_audits_exports_and_reports_as_the_whole_journal(
    cluster: Cluster, tmp_path: Path
) -> None:
    storage = tmp_path / "checkpoints"
    flags = ("--journal-hot", str(HOT), "--checkpoint-uri", str(storage), "--max-steps", str(STEPS))
    mirror = Mirror(cluster)
    cluster.trainer_coordinator("c1", *flags)
    workers = [cluster.example_worker(name, None) for name in ("a", "b")]
    cluster.until(lambda s: mirror.pull() and s.archived, 120, "a first segment is archived")
    cluster.procs[0].kill()  # the leader dies wherever it is in archiving
    cluster.trainer_coordinator("c2", *flags)
    cluster.until(lambda s: mirror.pull() and s.finished is not None, 180, "the job finishes")
    for worker in workers:
        assert cluster.finished(worker) == 0, worker.output()[-3000:]
    mirror.pull()
    held = cluster.conn.xlen(Keys(cluster.job).journal)
    assert held <= HOT + 50, held  # the hot tail, never the whole journal
    assert len(cluster.state.archived) >= 2

    kept = from_redis(cluster.conn, cluster.job)  # the inbox and dead letters, as they stand
    assert kept.journal == mirror.entries
    run = Run(cluster.job, journal=mirror.entries, inbox=kept.inbox, dead=kept.dead)
    whole = tmp_path / "whole.export"
    with whole.open("wb") as out:
        export(run, out, 0.0)
    archived = tmp_path / "archived.export"
    assert cluster.cli("export", "--job", cluster.job, "-o", str(archived)).returncode == 0
    audits = [
        cluster.cli("replay", *source, "--audit", "--json")
        for source in (("--job", cluster.job), ("--file", str(whole)), ("--file", str(archived)))
    ]
    assert [a.returncode for a in audits] == [0, 0, 0], [a.stderr for a in audits]
    assert audits[0].stdout == audits[1].stdout == audits[2].stdout
    assert json.loads(audits[0].stdout)["audit"]["ok"]
    pages = []
    for source in (("--job", cluster.job), ("--file", str(archived)), ("--file", str(whole))):
        page = tmp_path / f"report-{len(pages)}.html"
        done = cluster.cli("report", *source, "--title", "t", "-o", str(page))
        assert done.returncode == 0, done.stderr
        pages.append(page.read_bytes())
    assert pages[0] == pages[1] == pages[2]

    status = json.loads(cluster.cli("status", "--job", cluster.job, "--json").stdout)
    journal = status["journal"]
    assert journal["facts"] == len(mirror.entries) and journal["in_redis"] == held
    assert journal["segments"] == len(cluster.state.archived) >= 2
    files = sorted(storage.glob("journal/*/*.segment"))
    assert len(files) == journal["segments"]
    reset = cluster.cli("reset", "--job", cluster.job, "--yes")
    assert reset.returncode == 0, reset.stderr
    assert f"and {len(files)} archived segments deleted" in reset.stdout
    assert not any(f.exists() for f in files)
