"""A job's keys, found and deleted: what `cohort reset` (and the demo, before it runs a job
name again) does, so that the name starts a new run; and which jobs a Redis holds."""

from __future__ import annotations

from cohort.events.connection import Client, text
from cohort.events.keys import JOURNAL_PATTERN, Keys, job_of_journal

BATCH = 500


def job_keys(conn: Client, job: str) -> list[str]:
    """Every key of `job`, in its own slot and spread to others (on every primary of a
    cluster: the client's SCAN visits them all)."""
    return sorted(
        {
            text(k)
            for pattern in Keys(job).patterns
            for k in conn.scan_iter(match=pattern, count=BATCH)
        }
    )


def delete_job(conn: Client, job: str) -> int:
    """UNLINK every key of `job`, a batch at a time (a cluster client splits a batch by slot);
    keys written meanwhile (a late gradient) are found by the next scan. Returns how many."""
    deleted = 0
    while found := job_keys(conn, job):
        for start in range(0, len(found), BATCH):
            deleted += int(conn.unlink(*found[start : start + BATCH]))
    return deleted


def jobs(conn: Client) -> list[str]:
    """Every job with a journal on this Redis (every primary of a cluster), sorted."""
    found = (job_of_journal(text(k)) for k in conn.scan_iter(match=JOURNAL_PATTERN, count=BATCH))
    return sorted({job for job in found if job is not None})
