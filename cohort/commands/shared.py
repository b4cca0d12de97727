"""What every cohort subcommand shares: options, the Redis connection, signals, failing.

Each option is declared once here. `--redis-url` is accepted on the group (with the
$COHORT_REDIS_URL fallback) and again on every command that talks to Redis, so
`cohort --redis-url U status` and `cohort status --redis-url U` both work. The commands
that read a run (status, replay, report, export, checkpoints) take `--run-dir DIR` in its
place: the journal of the run `cohort run` kept there, opened read-only.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import redis

from cohort.errors import Exit
from cohort.events.connection import (
    DEFAULT_WAIT,
    ENV_WAIT,
    Client,
    RedisSettings,
    connect,
    reach,
)
from cohort.events.errors import EventsError, RedisUnavailableError, SettingsError
from cohort.events.keys import check_job

log = logging.getLogger("cohort")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def fail(message: str, code: Exit = Exit.USAGE) -> NoReturn:
    """Print `cohort: error: MESSAGE` on stderr and exit with `code`; no traceback."""
    click.echo(f"cohort: error: {message}", err=True)
    sys.exit(code)


# ---------------------------------------------------------------- options

FILE = click.Path(path_type=Path, dir_okay=False)
"""The type of an option naming a file (not a directory), given to the command as a Path."""


def _check_job(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_job(value)
    except EventsError as exc:
        raise click.BadParameter(str(exc)) from None


def job_option(
    help: str | None = "Job name (ASCII letters, digits, '.', '_', '-'); env COHORT_JOB.",
    **overrides: Any,
) -> Callable[[F], F]:
    """--job/-j, checked as a job name; required and read from $COHORT_JOB unless overridden."""
    settings: dict[str, Any] = {"required": True, "envvar": "COHORT_JOB", **overrides}
    return click.option("--job", "-j", callback=_check_job, help=help, **settings)


def _keep_redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """The group's value (or the environment's) first; a command's own, if given, wins."""
    obj = ctx.ensure_object(dict)
    if value is not None or "redis_url" not in obj:
        obj["redis_url"] = value


def redis_url_option(*, on_group: bool = False) -> Callable[[F], F]:
    """--redis-url, on the group (with the $COHORT_REDIS_URL fallback) or after a command.

    Not read from the environment after a command: there it would override the URL given
    before the command. Commands read the choice through `redis_settings`.
    """
    return click.option(
        "--redis-url",
        metavar="URL",
        envvar="COHORT_REDIS_URL" if on_group else None,
        expose_value=False,
        callback=_keep_redis_url,
        help=(
            "Redis to use, e.g. redis://host:6379/0 or rediss:// for TLS, "
            "redis+cluster://host:port[,host:port...] for Redis Cluster, "
            "redis+sentinel://host:26379[,...]/SERVICE[/DB] for Sentinel; env "
            "COHORT_REDIS_URL. Default redis://127.0.0.1:6379/0 (`cohort demo` starts its "
            "own when unset)."
            if on_group
            else "Redis URL (also accepted before the subcommand); env COHORT_REDIS_URL."
        ),
    )


def _keep_run_dir(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        ctx.ensure_object(dict)["run_dir"] = value


def run_dir_option() -> Callable[[F], F]:
    """--run-dir DIR on a command that reads a run: the journal of the run `cohort run`
    kept in DIR (its job too, unless --job is given), opened read-only; see `opened_run`."""
    return click.option(
        "--run-dir",
        type=click.Path(path_type=Path, file_okay=False),
        metavar="DIR",
        expose_value=False,
        callback=_keep_run_dir,
        help="Read the run `cohort run` kept in DIR (its 'logs in' directory; its job unless "
        "--job is given): a finished run's journal is opened read-only from its AOF, no "
        "Redis to start by hand. Instead of --redis-url.",
    )


NO_JOB = "give the job: --job J (or $COHORT_JOB), or the run's directory: --run-dir DIR"


def job_of(ctx: click.Context, job: str | None, missing: str = NO_JOB) -> str:
    """The job a command reads: --job as given on the command line, else the --run-dir's,
    else $COHORT_JOB; else exit 2 naming the ways to give one."""
    given = job is not None and ctx.get_parameter_source("job") not in (
        click.core.ParameterSource.ENVIRONMENT,
        click.core.ParameterSource.DEFAULT,
    )
    if not given and ctx.obj.get("run_dir") is not None:
        return opened_run(ctx).job
    if job is None:
        fail(missing)
    return job


def opened_run(ctx: click.Context) -> Any:
    """The run in --run-dir, opened read-only until the command ends (`rundir.Opened`);
    exit 2 naming the directory if it holds no run that can be read."""
    from cohort.launcher.rundir import RunDirError, open_read_only

    obj = ctx.find_root().ensure_object(dict)
    if "opened" not in obj:
        if _url_given(ctx):
            fail("give --run-dir DIR or --redis-url URL, not both: the run's journal is in one")
        try:
            obj["opened"] = ctx.find_root().with_resource(open_read_only(obj["run_dir"]))
        except RunDirError as exc:
            fail(str(exc))
    return obj["opened"]


def _url_given(ctx: click.Context) -> bool:
    """Whether --redis-url is on the command line (before or after the subcommand); the
    environment's $COHORT_REDIS_URL gives way to --run-dir."""
    return any(
        c.get_parameter_source("redis_url") is click.core.ParameterSource.COMMANDLINE
        for c in (ctx, ctx.find_root())
    )


# ---------------------------------------------------------------- Redis


def redis_settings(ctx: click.Context, name: str) -> RedisSettings:
    """The chosen URL (a --run-dir's journal, else --redis-url) and TLS files, checked, with
    `name` as the client name; else exit 2."""
    url = opened_run(ctx).url if ctx.obj.get("run_dir") is not None else ctx.obj["redis_url"]
    try:
        tls = ctx.obj.get("redis_tls", {})
        return RedisSettings.resolve(url, client_name=name, **tls)
    except SettingsError as exc:
        fail(str(exc))


def redis_client(ctx: click.Context, name: str, wait: float = 0.0) -> Client:
    """A client that has answered PING, trying for `wait` seconds (start-up: see
    `--wait-for-redis`); else exit 3 with one line naming the URL and what to check."""
    settings = redis_settings(ctx, name)
    try:
        # a cluster client asks for the slot map as it is made
        return reach(lambda: connect(settings), settings.display_url, wait)
    except KeyboardInterrupt:
        fail(f"interrupted while waiting for Redis at {settings.display_url}", Exit.INTERRUPTED)
    except RedisUnavailableError as exc:
        if tls_failure(settings, exc.__cause__ or exc):
            fail(
                f"TLS handshake with Redis at {settings.display_url} failed ({exc.__cause__}); "
                "check --redis-tls-ca ($COHORT_REDIS_TLS_CA) names the CA that signed the "
                "server's certificate, and --redis-tls-cert/--redis-tls-key if the server asks "
                "for a client certificate",
                Exit.REDIS,
            )
        fail(str(exc) + _stopped_run(settings.display_url), Exit.REDIS)
    except redis.AuthenticationError as exc:
        fail(f"Redis at {settings.display_url} refused the credentials: {exc}", Exit.REDIS)


def _stopped_run(url: str) -> str:
    """Where `url` was the private Redis of a run under ./cohort-runs (gone with its
    launcher): how to read that run instead."""
    from cohort.launcher.rundir import previous_runs

    run = next((r for r in previous_runs() if r.body.get("redis_url") == url), None)
    if run is None or not run.body.get("private_redis"):
        return ""
    return (
        f"; it was the private Redis of run {run.dir} (job {run.job!r}), which stops with its "
        f"launcher: read the run with --run-dir {run.dir}"
    )


def wait_for_redis_option() -> Callable[[F], F]:
    """--wait-for-redis SECONDS: how long a long-running command waits at start-up for Redis
    to answer before it exits 3 naming the URL (once running, it rides out outages)."""
    return click.option(
        "--wait-for-redis",
        type=click.FloatRange(min=0),
        default=DEFAULT_WAIT,
        show_default=True,
        envvar=ENV_WAIT,
        metavar="SECONDS",
        help="At start-up, wait this long for Redis to answer, then exit 3 naming the URL "
        "(a wrong URL, a server not up yet); once running, outages are retried with backoff "
        f"for as long as they last; env {ENV_WAIT}.",
    )


def tls_failure(settings: RedisSettings, exc: BaseException) -> bool:
    """True if `exc` came from the TLS layer of a rediss:// connection."""
    if not settings.target.tls:
        return False
    text = str(exc).lower()
    return any(w in text for w in ("ssl", "tls", "certificate", "handshake")) or isinstance(
        exc.__cause__ or exc.__context__, ssl.SSLError
    )


def or_fail(read: Callable[[], T]) -> T:
    """`read()`, or exit 4 with the message of the CoordinatorError it raised."""
    from cohort.coordinator.errors import CoordinatorError

    try:
        return read()
    except CoordinatorError as exc:
        fail(str(exc), Exit.DATA)


# ---------------------------------------------------------------- signals


def stop_on_signals(stop: threading.Event, what: str) -> None:
    """First SIGINT/SIGTERM: set `stop`, so `what` finishes cleanly. Second: exit now."""

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(Exit.INTERRUPTED)
        log.info(
            "%s: %s stops after this turn (again to exit now)", signal.Signals(signum).name, what
        )
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
