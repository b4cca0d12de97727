"""The `cohort` command: the one place that wires the coordinator and the worker sides.

This is the group and its options; each subcommand lives in `cohort.commands`.
"""

from __future__ import annotations

import click

from cohort import logs
from cohort.commands.acl import acl_cmd
from cohort.commands.coordinator import coordinator
from cohort.commands.demo import demo
from cohort.commands.lineage import checkpoints, resume
from cohort.commands.reset import reset
from cohort.commands.run import run
from cohort.commands.runs import export_cmd, replay, report_cmd
from cohort.commands.shared import redis_url_option
from cohort.commands.status import status
from cohort.commands.workers import example_worker, worker


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@redis_url_option(on_group=True)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
@click.option("--log-json", is_flag=True, help="Log one JSON object per line.")
@click.option(
    "--redis-tls-ca",
    metavar="PEM",
    help="CA file to verify a rediss:// server with (default: the system store); "
    "env COHORT_REDIS_TLS_CA.",
)
@click.option(
    "--redis-tls-cert",
    metavar="PEM",
    help="Client certificate for rediss:// (tls-auth-clients); env COHORT_REDIS_TLS_CERT.",
)
@click.option(
    "--redis-tls-key",
    metavar="PEM",
    help="Private key of --redis-tls-cert; env COHORT_REDIS_TLS_KEY.",
)
@click.version_option(package_name="cohort-elastic")
@click.pass_context
def main(
    ctx: click.Context,
    log_level: str,
    log_json: bool,
    redis_tls_ca: str | None = None,
    redis_tls_cert: str | None = None,
    redis_tls_key: str | None = None,
) -> None:
    """cohort coordinates elastic data-parallel training through Redis.

    \b
    Start here:
      cohort run -n 3 train.py          run a training script as 3 elastic ranks, supervised
      cohort demo                       a whole job on a private Redis, in one command
      cohort coordinator --job J        run a coordinator (run two or three for failover)
      cohort worker --job J             a simulated worker (your script uses cohort.Worker)
      cohort example-worker --job J     a worker training a real (numpy) model
      cohort status --job J             who leads, the world, every worker
      cohort status --run-dir DIR       the same of a `cohort run`'s run, finished or not
      cohort replay --job J             rebuild and explain a run from its journal
      cohort checkpoints --job J        the job's checkpoints; `cohort resume` after a loss
      cohort reset --job J              delete a job's keys, so its name starts a new run
    """
    logs.setup(log_level, log_json)
    tls = {"tls_ca": redis_tls_ca, "tls_cert": redis_tls_cert, "tls_key": redis_tls_key}
    ctx.ensure_object(dict).setdefault("redis_tls", {k: v for k, v in tls.items() if v is not None})


for command in (
    run,
    coordinator,
    worker,
    example_worker,
    status,
    replay,
    export_cmd,
    report_cmd,
    acl_cmd,
    checkpoints,
    resume,
    reset,
    demo,
):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
