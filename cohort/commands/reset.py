"""`cohort reset`: delete a job's keys, so its name can start a new run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from cohort.commands.runs import reads_whole_run, write_whole
from cohort.commands.shared import FILE, fail, job_option, or_fail, redis_client, redis_url_option
from cohort.events import storage
from cohort.events.archive import History
from cohort.events.connection import Client
from cohort.events.keys import Keys
from cohort.events.reset import delete_job, job_keys

if TYPE_CHECKING:
    from cohort.coordinator.replay import Run
    from cohort.coordinator.state import JobState

T = TypeVar("T")


@click.command("reset")
@job_option()
@redis_url_option()
@click.option("--yes", "-y", is_flag=True, help="Do not ask: delete at once.")
@click.option(
    "--export",
    "export_to",
    type=FILE,
    help="Write the run to this file first (as `cohort export`; `cohort replay --file` reads it).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Reset even while a coordinator holds the job's lease (its processes then fail).",
)
@click.pass_context
@reads_whole_run
def reset(ctx: click.Context, job: str, yes: bool, export_to: Path | None, force: bool) -> None:
    """Delete every key of JOB (journal, inbox, snapshot, lease, gradients) and the journal's
    archived segments, so that the name starts a new run. Checkpoint files stay where they
    were written.

    Asks first, and offers to export the run; --yes skips both (--export still writes).
    """
    conn = redis_client(ctx, "cohort-reset")
    keys = Keys(job)
    found = or_fail(lambda: job_keys(conn, job))
    if not found:
        click.echo(f"job {job!r} has no keys in Redis: nothing to reset")
        return
    if conn.exists(keys.leader) and not force:
        fail(
            f"job {job!r} has a running coordinator (it holds {keys.leader}); stop the job's "
            "coordinators and workers first, or pass --force",
        )
    segments = or_fail(lambda: History.of(conn, job).index())
    run, state = _read(conn, job, export_to)
    where = state.config.checkpoint_uri if state.config is not None else None
    click.echo(
        f"job {job!r}: {len(found)} keys, {state.facts} facts"
        + (f" ({len(segments)} archived segments)" if segments else "")
        + f", last committed step {state.last_committed}, "
        + ("finished" if state.finished else "not finished")
        + (f"; checkpoint files under {where} are kept" if where else "")
    )
    offer = run is not None and not yes and export_to is None
    if offer and _ask(click.confirm, "export the run first?", True):
        export_to = Path(_ask(click.prompt, "file", f"{job}-{int(time.time())}.cohort"))
    if run is not None and export_to is not None:
        from cohort.coordinator.replay import export

        count = write_whole(export_to, lambda out: export(run, out, time.time()))
        click.echo(f"wrote {count} entries of job {job!r} to {export_to}")
    what = f"the {len(found)} keys" + (
        f" and {len(segments)} archived segments" if segments else ""
    )
    if not yes and not _ask(click.confirm, f"delete {what} of job {job!r}?", False):
        click.echo("nothing was deleted")
        return
    deleted = or_fail(lambda: delete_job(conn, job))
    removed = sum(storage.remove(segment.uri) for segment in segments)
    click.echo(
        f"job {job!r} is reset: {deleted} keys"
        + (f" and {removed} archived segments" if segments else "")
        + " deleted; its name starts a new run"
    )


def _read(conn: Client, job: str, export_to: Path | None) -> tuple[Run | None, JobState]:
    """The run and its state; a run whose archive cannot be read whole is reset anyway (its
    keys and the segments its index names), after a warning, unless it is to be exported."""
    from cohort.coordinator.fold import fold
    from cohort.coordinator.replay import ReplayError, from_redis, rebuild

    try:
        run = from_redis(conn, job, with_inbox=True)  # keys without a journal are reset too
    except ReplayError as exc:
        if export_to is not None:
            fail(f"cannot export job {job!r}: {exc}")
        click.echo(f"warning: {exc}; it cannot be exported, and is reset all the same", err=True)
        return None, fold(())
    return run, or_fail(lambda: rebuild(run))[0]


def _ask(how: Callable[..., T], question: str, default: Any) -> T:
    """`how` (click.confirm or click.prompt) asks `question`; no answer (stdin closed) exits 2
    saying how to reset without questions."""
    try:
        return how(question, default=default)
    except click.Abort:
        fail(
            "reset asks before it deletes and got no answer: nothing was deleted; pass --yes "
            "(and --export FILE to keep a copy) to reset without questions"
        )
