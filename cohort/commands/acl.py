"""`cohort acl`: Redis ACL users for a job's coordinators, workers and viewers."""

from __future__ import annotations

import click

from cohort.errors import Exit

from .shared import fail, job_option, redis_client, redis_settings, redis_url_option


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
    """
    from cohort import acl

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
