"""`cohort demo`: a whole job on this machine, with a worker and a leader killed."""

from __future__ import annotations

import sys

import click

from cohort.commands.shared import job_option, redis_url_option


@click.command()
@redis_url_option()
@click.option("--workers", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(20, 100_000),
    default=240,
    show_default=True,
    help="Steps the job trains for (a few seconds per hundred).",
)
@job_option(None, required=False, envvar=None, default="demo", show_default=True)
@click.option("--keep", is_flag=True, help="Leave the private Redis running at the end.")
@click.pass_context
def demo(ctx: click.Context, workers: int, steps: int, job: str, keep: bool) -> None:
    """Run a whole job: two coordinators and several workers, with a failure of each.

    Without --redis-url or $COHORT_REDIS_URL it starts a private redis-server on a free
    port in a temp dir, and removes it at the end (also on Ctrl-C).
    """
    from cohort.demo import run_demo

    sys.exit(run_demo(ctx.obj["redis_url"], job=job, workers=workers, steps=steps, keep=keep))
