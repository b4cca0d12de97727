"""`cohort acl`: Redis ACL users for a job's coordinators, workers and viewers."""

from __future__ import annotations

import click

from cohort.commands.shared import fail, job_option, redis_client, redis_settings, redis_url_option
from cohort.errors import Exit


@click.command("acl")
@job_option()
@redis_url_option()
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice(["coordinator", "worker", "viewer"]),
    help="Only this role (repeatable). Default: all three.",
)
@click.option(
    "--worker",
    "workers",
    multiple=True,
    metavar="WORKER",
    help="Issue WORKER its own credential (repeatable): a user cohort-JOB-w-WORKER whose "
    "password signs its commands. The first one switches JOB to signed commands only.",
)
@click.option(
    "--revoke",
    "revokes",
    multiple=True,
    metavar="WORKER",
    help="Take WORKER's credential back on every node (repeatable): its user is deleted, its "
    "connections killed, its commands dead-lettered; it fails by silence.",
)
@click.option(
    "--apply",
    "do_apply",
    is_flag=True,
    help="Create or replace the users on the --redis-url server (needs ACL SETUSER there).",
)
@click.option(
    "--redis-version",
    metavar="MAJOR.MINOR",
    help="Without --apply: write rules for this Redis (default 7.0; 7.2 adds CLIENT SETINFO "
    "and WAITAOF). --apply asks the server.",
)
@click.pass_context
def acl_cmd(
    ctx: click.Context,
    job: str,
    roles: tuple[str, ...],
    workers: tuple[str, ...],
    revokes: tuple[str, ...],
    do_apply: bool,
    redis_version: str | None,
) -> None:
    """Redis ACL users for JOB: coordinator, worker (inbox, journal read, gradients only:
    it cannot forge a fact) and viewer (read-only, for status, replay and report).

    \b
    Prints `ACL SETUSER` lines for redis-cli on stdout, and each role's URL on stderr:
      cohort acl --job J | redis-cli -u ADMIN_URL
    or creates the users itself with --apply. Passwords come from
    $COHORT_ACL_COORDINATOR_PASSWORD, $COHORT_ACL_WORKER_PASSWORD and
    $COHORT_ACL_VIEWER_PASSWORD, else are generated and shown once: store them now.
    Applying again replaces each user's password and rules.

    \b
    Per-worker credentials (docs/identity.md): a worker then speaks only for itself.
      cohort acl --job J --worker w1 --worker w2 --apply   # prints each worker's URL
      cohort acl --job J --revoke w1                       # w1 is cut off at once
    """
    from cohort import acl

    if revokes:
        if workers or roles or redis_version:
            fail("--revoke goes alone: not with --worker, --role or --redis-version")
        _revoke(ctx, job, revokes)
        return
    if workers:
        _issue(ctx, job, workers, do_apply, redis_version)
        if not roles:
            return
    chosen: list[acl.Role] = [r for r in acl.ROLES if not roles or r in roles]
    passwords, generated = acl.passwords(chosen)
    admin = redis_settings(ctx, "cohort-acl")
    try:
        version = acl.parse_version(redis_version) if redis_version else acl.MIN_VERSION
        if do_apply:
            if redis_version:
                fail("--redis-version is for printing; --apply asks the server its version")
            conn = redis_client(ctx, "cohort-acl")
            for name in acl.apply(conn, job, passwords):
                click.echo(f"applied ACL user {name}")
        else:
            for command in acl.setuser_commands(job, passwords, version):
                click.echo(acl.command_line(command))
    except acl.AclError as exc:
        fail(str(exc), Exit.REDIS if do_apply else Exit.USAGE)
    for role in chosen:
        if role in generated:
            url = acl.role_url(admin.url, job, role, passwords[role])
            note = "generated password, shown once"
        else:
            url = acl.role_url(admin.url, job, role, "***")
            note = f"password from ${acl.password_env(role)}"
        click.echo(f"# {role}: {url}  ({note})", err=not do_apply)


def _issue(
    ctx: click.Context, job: str, workers: tuple[str, ...], do_apply: bool, version: str | None
) -> None:
    """Each worker's own user: created (--apply) or printed, its URL shown once."""
    from cohort import acl
    from cohort.events.identity import worker_user

    try:
        acl.check_workers(workers)
    except acl.AclError as exc:
        fail(str(exc))
    admin = redis_settings(ctx, "cohort-acl")
    conn = redis_client(ctx, "cohort-acl")
    try:
        parsed = acl.parse_version(version) if version else None
        if do_apply and parsed is not None:
            fail("--redis-version is for printing; --apply asks the server its version")
        issued = acl.issue(conn, job, workers, apply_users=do_apply, redis_version=parsed)
    except acl.CredentialRefusedError as exc:
        fail(str(exc))
    except acl.AclError as exc:
        fail(str(exc), Exit.REDIS if do_apply else Exit.USAGE)
    for worker, secret in issued.items():
        if do_apply:
            click.echo(f"applied ACL user {worker_user(job, worker)}")
        else:
            click.echo(
                acl.command_line(acl.worker_setuser(job, worker, secret, parsed or acl.MIN_VERSION))
            )
        url = acl.url_as(admin.url, worker_user(job, worker), secret)
        click.echo(
            f"# worker {worker}: {url}  (its own credential: keep it secret)", err=not do_apply
        )


def _revoke(ctx: click.Context, job: str, workers: tuple[str, ...]) -> None:
    from cohort import acl
    from cohort.events.identity import worker_user

    conn = redis_client(ctx, "cohort-acl")
    for worker in workers:
        try:
            killed = acl.revoke(conn, job, worker)
        except acl.CredentialRefusedError as exc:
            fail(str(exc))
        except acl.AclError as exc:
            fail(str(exc), Exit.REDIS)
        click.echo(
            f"revoked worker {worker}: user {worker_user(job, worker)} deleted, "
            f"{killed} connection(s) killed; its commands are dead-lettered from now on"
        )
