"""`cohort acl`: Redis ACL users for a job's coordinators, workers and viewers."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import click
import redis

from cohort.commands.shared import fail, job_option, redis_client, redis_settings, redis_url_option
from cohort.errors import Exit
from cohort.events.connection import Client

_ALONE = ("--revoke", "--unrevoke", "--rotate", "--finish-rotation")


@click.command("acl")
@job_option()
@redis_url_option()
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice(["coordinator", "worker", "viewer", "torchrun"]),
    help="Only this role (repeatable). Default: coordinator, worker and viewer; torchrun is "
    "for a torchrun job's agents (--rdzv-backend=cohort).",
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
    "--unrevoke",
    "unrevokes",
    multiple=True,
    metavar="WORKER",
    help="Take WORKER off the revoked set (repeatable): the leader accepts its signatures "
    "again within a second. With --apply its user is created again and its URL printed.",
)
@click.option(
    "--rotate",
    is_flag=True,
    help="Make a new job key: every worker's user takes its old and its new secret for "
    "--grace seconds, running workers move to the new one by themselves, then only the "
    "new one works. Waits out the grace (see --no-wait).",
)
@click.option(
    "--grace",
    type=float,
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="With --rotate: how long the old key and passwords stay valid (at least 10).",
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="With --rotate: return at once; the old key expires by itself at the grace's end, "
    "and --finish-rotation then removes the old passwords.",
)
@click.option(
    "--finish-rotation",
    is_flag=True,
    help="End a rotation's grace now (safe to repeat): only the new key and passwords work.",
)
@click.option(
    "--apply",
    "do_apply",
    is_flag=True,
    help="Create or replace the users on the --redis-url server (needs ACL SETUSER there).",
)
@click.option(
    "--lock-default",
    is_flag=True,
    help="With --apply: turn Redis's `default` user off (or, with "
    "$COHORT_ACL_DEFAULT_PASSWORD, make it need that password); without it, an open "
    "`default` user is only warned about.",
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
    unrevokes: tuple[str, ...],
    rotate: bool,
    grace: float,
    no_wait: bool,
    finish_rotation: bool,
    do_apply: bool,
    lock_default: bool,
    redis_version: str | None,
) -> None:
    """Redis ACL users for JOB: coordinator, worker (XADD to the inbox, journal read,
    gradients only: it cannot forge a fact) and viewer (read-only, for status, replay and
    report), each confined to the --redis-url's database; with --role torchrun, the user of
    a torchrun job's agents (membership as a worker's, the rendezvous and its store).

    \b
    Prints `ACL SETUSER` lines for redis-cli on stdout, and each role's URL on stderr:
      cohort acl --job J | redis-cli -u ADMIN_URL
    or creates the users itself with --apply. Passwords come from
    $COHORT_ACL_COORDINATOR_PASSWORD, $COHORT_ACL_WORKER_PASSWORD and
    $COHORT_ACL_VIEWER_PASSWORD (and _TORCHRUN_), else are generated and shown once: store them now.
    Applying again replaces each user's password and rules. After --apply, an open
    `default` user (no password, every command) is warned about: --lock-default closes it.

    \b
    Per-worker credentials (docs/identity.md): a worker then speaks only for itself.
      cohort acl --job J --worker w1 --worker w2 --apply   # prints each worker's URL
      cohort acl --job J --revoke w1                       # w1 is cut off at once
      cohort acl --job J --unrevoke w1 --apply             # w1 may speak again
      cohort acl --job J --rotate --grace 60               # a new job key, no restart
    """
    alone = _alone(revokes, unrevokes, rotate, finish_rotation)
    _check_combination(alone, workers, roles, redis_version, do_apply, lock_default)
    if alone is not None:
        _run_alone(ctx, job, alone, revokes, unrevokes, do_apply, grace, no_wait)
        return
    if lock_default:
        _check_lock(ctx)  # before anything is applied
    if workers:
        _issue(ctx, job, workers, do_apply, redis_version)
    if roles or not workers:
        _roles(ctx, job, roles, do_apply, redis_version)
    if do_apply:
        _default_user(ctx, job, lock_default)


def _alone(
    revokes: tuple[str, ...], unrevokes: tuple[str, ...], rotate: bool, finish: bool
) -> str | None:
    """The one action that goes alone, if one was asked for; two are a usage error."""
    chosen = [
        flag for flag, asked in zip(_ALONE, (revokes, unrevokes, rotate, finish), strict=True)
        if asked
    ]  # fmt: skip
    if len(chosen) > 1:
        fail(f"{chosen[0]} goes alone: not with {', '.join(chosen[1:])}")
    return chosen[0] if chosen else None


def _check_combination(
    alone: str | None,
    workers: tuple[str, ...],
    roles: tuple[str, ...],
    redis_version: str | None,
    do_apply: bool,
    lock_default: bool,
) -> None:
    if alone is not None and (workers or roles or redis_version or lock_default):
        fail(f"{alone} goes alone: not with --worker, --role, --redis-version or --lock-default")
    if alone is not None and do_apply and alone != "--unrevoke":
        fail(f"{alone} acts on the server by itself: drop --apply")
    if lock_default and not do_apply:
        fail("--lock-default changes the server: add --apply (it locks after applying)")


def _run_alone(
    ctx: click.Context,
    job: str,
    alone: str,
    revokes: tuple[str, ...],
    unrevokes: tuple[str, ...],
    do_apply: bool,
    grace: float,
    no_wait: bool,
) -> None:
    if alone == "--revoke":
        _revoke(ctx, job, revokes)
    elif alone == "--unrevoke":
        _unrevoke(ctx, job, unrevokes, do_apply)
    elif alone == "--rotate":
        _rotate(ctx, job, grace, no_wait)
    else:
        _finish_rotation(ctx, job)


def _roles(
    ctx: click.Context,
    job: str,
    roles: tuple[str, ...],
    do_apply: bool,
    redis_version: str | None,
) -> None:
    """The role users: created (--apply) or printed, each URL shown (a generated password
    once)."""
    from cohort import acl

    chosen: list[acl.Role] = [r for r in acl.ROLES if r in (roles or acl.DEFAULT_ROLES)]
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
            for command in acl.setuser_commands(job, passwords, version, _url_user_db(ctx)[1]):
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


def _url_user_db(ctx: click.Context) -> tuple[str | None, int]:
    """The user the --redis-url logs in as and the database it selects."""
    settings = redis_settings(ctx, "cohort-acl")
    target = settings.target
    if target.kind != "single":
        return target.username, target.db
    parsed = redis.connection.parse_url(settings.url)  # redis-py reads a one-server URL
    return parsed.get("username") or None, int(parsed.get("db") or 0)


def _check_lock(ctx: click.Context) -> None:
    from cohort import acl

    username = _url_user_db(ctx)[0]
    refusal = acl.lock_refusal(username, os.environ.get(acl.DEFAULT_PASSWORD_ENV) or None)
    if refusal is not None:
        fail(refusal)


def _default_user(ctx: click.Context, job: str, lock: bool) -> None:
    """After applying: lock the `default` user if asked, else warn if it is open."""
    from cohort import acl

    conn = redis_client(ctx, "cohort-acl")
    if lock:
        with _refusals("locking the default user"):
            click.echo(acl.lock_default(conn, os.environ.get(acl.DEFAULT_PASSWORD_ENV) or None))
    exposure = acl.default_user_exposure(conn)
    if exposure is not None:
        click.echo(acl.default_warning(exposure, job), err=True)


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
            command = acl.worker_setuser(
                job, worker, secret, parsed or acl.MIN_VERSION, _url_user_db(ctx)[1]
            )
            click.echo(acl.command_line(command))
        _show_url(ctx, job, worker, secret, err=not do_apply)


def _show_url(ctx: click.Context, job: str, worker: str, secret: str, err: bool) -> None:
    from cohort import acl
    from cohort.events.identity import worker_user

    url = acl.url_as(redis_settings(ctx, "cohort-acl").url, worker_user(job, worker), secret)
    click.echo(f"# worker {worker}: {url}  (its own credential: keep it secret)", err=err)


@contextlib.contextmanager
def _refusals(what: str) -> Iterator[None]:
    """A refusal as one line: a bad name or state exits 2, anything Redis refused exits 3."""
    from cohort import acl

    try:
        yield
    except (acl.CredentialRefusedError, acl.DefaultUserError) as exc:
        fail(str(exc))
    except acl.AclError as exc:
        fail(str(exc), Exit.REDIS)
    except redis.RedisError as exc:
        fail(
            f"{what} failed ({exc}): the --redis-url user must be an admin (ACL SETUSER, "
            "ACL USERS, and GET/SET/DEL of the job's keys)",
            Exit.REDIS,
        )


def _revoke(ctx: click.Context, job: str, workers: tuple[str, ...]) -> None:
    from cohort import acl
    from cohort.events.identity import worker_user

    conn = redis_client(ctx, "cohort-acl")
    for worker in workers:
        with _refusals(f"revoking worker {worker!r}"):
            killed = acl.revoke(conn, job, worker)
        click.echo(
            f"revoked worker {worker}: user {worker_user(job, worker)} deleted, "
            f"{killed} connection(s) killed; its commands are dead-lettered from now on"
        )


def _unrevoke(ctx: click.Context, job: str, workers: tuple[str, ...], do_apply: bool) -> None:
    from cohort import acl

    conn = redis_client(ctx, "cohort-acl")
    for worker in workers:
        with _refusals(f"un-revoking worker {worker!r}"):
            acl.unrevoke(conn, job, worker)
        click.echo(
            f"un-revoked worker {worker}: the leader accepts its signatures again within a second"
        )
        if not do_apply:
            click.echo(
                f"# worker {worker} has no Redis user: create it with "
                f"cohort acl --job {job} --worker {worker} --apply (or add --apply here)"
            )
    if do_apply:
        _issue(ctx, job, workers, True, None)


def _rotate(ctx: click.Context, job: str, grace: float, no_wait: bool) -> None:
    """Begin a rotation, print the new URLs, wait out the grace and finish it."""
    from cohort import acl

    try:
        acl.check_grace(grace)
    except acl.AclError as exc:
        fail(str(exc))
    conn = redis_client(ctx, "cohort-acl")
    with _refusals(f"rotating job {job!r}'s key"):
        rotation = acl.begin_rotation(conn, job, grace)
    click.echo(
        f"rotated job {job}'s key: {len(rotation.secrets)} worker user(s) take the old and the "
        f"new secret for {grace:g} s; running workers move to the new one by themselves"
    )
    for worker, secret in rotation.secrets.items():
        _show_url(ctx, job, worker, secret, err=True)
    if no_wait:
        click.echo(
            f"the old key expires by itself in {grace:g} s; then run "
            f"cohort acl --job {job} --finish-rotation to remove the old passwords"
        )
        return
    _wait_out(conn, job)
    _finish_rotation(ctx, job)


def _wait_out(conn: Client, job: str) -> None:
    from cohort.events.keys import Keys

    left = int(conn.pttl(Keys(job).identity_previous))
    click.echo(f"waiting out the grace ({max(left, 0) / 1000:.0f} s) ...", err=True)
    try:
        threading.Event().wait(max(left, 0) / 1000)
    except KeyboardInterrupt:
        fail(
            "interrupted: the rotation is under way; the old key still expires by itself at "
            f"the grace's end; then run cohort acl --job {job} --finish-rotation to remove "
            "the old passwords (or now, to end the grace at once)",
            Exit.INTERRUPTED,
        )


def _finish_rotation(ctx: click.Context, job: str) -> None:
    from cohort import acl

    conn = redis_client(ctx, "cohort-acl")
    with _refusals(f"finishing the rotation of job {job!r}'s key"):
        workers = acl.finish_rotation(conn, job)
    click.echo(
        f"rotation of job {job}'s key finished: the old key is gone and {len(workers)} worker "
        "user(s) take only their new secret"
    )
