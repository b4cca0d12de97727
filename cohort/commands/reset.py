"""`cohort reset`: delete a job's keys, so its name can start a new run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from cohort.commands.runs import reads_whole_run, write_whole
from cohort.commands.shared import FILE, fail, job_option, or_fail, redis_client, redis_url_option
from cohort.events.keys import Keys
from cohort.events.reset import delete_job, job_keys

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
    """Delete every key of JOB (journal, inbox, snapshot, lease, gradients), so that the
    name starts a new run. Checkpoint files stay where they were written.

    Asks first, and offers to export the run; --yes skips both (--export still writes).
    """
    from cohort.coordinator.replay import from_redis, rebuild

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
    run = from_redis(conn, job, with_inbox=True)  # keys without a journal are reset too
    state, _ = or_fail(lambda: rebuild(run))
    where = state.config.checkpoint_uri if state.config is not None else None
    click.echo(
        f"job {job!r}: {len(found)} keys, {len(run.journal)} facts, last committed step "
        f"{state.last_committed}, {'finished' if state.finished else 'not finished'}"
        + (f"; checkpoint files under {where} are kept" if where else "")
    )
    if not yes and export_to is None and _ask(click.confirm, "export the run first?", True):
        export_to = Path(_ask(click.prompt, "file", f"{job}-{int(time.time())}.cohort"))
    if export_to is not None:
        from cohort.coordinator.replay import export

        count = write_whole(export_to, lambda out: export(run, out, time.time()))
        click.echo(f"wrote {count} entries of job {job!r} to {export_to}")
    if not yes and not _ask(click.confirm, f"delete the {len(found)} keys of job {job!r}?", False):
        click.echo("nothing was deleted")
        return
    deleted = or_fail(lambda: delete_job(conn, job))
    click.echo(f"job {job!r} is reset: {deleted} keys deleted; its name starts a new run")


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
