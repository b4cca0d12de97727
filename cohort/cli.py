"""The `cohort` command: the one place that wires the coordinator and the worker sides."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
import redis
from pydantic import ValidationError

from cohort.events.connection import Client, RedisSettings, connect, text
from cohort.events.errors import EventsError, SettingsError
from cohort.events.keys import Keys, check_job
from cohort.events.models import JobConfig

from . import logs

log = logging.getLogger("cohort")


class Exit:
    OK = 0
    USAGE = 2
    REDIS = 3
    DATA = 4
    INTERRUPTED = 130


def fail(message: str, code: int = Exit.USAGE) -> NoReturn:
    click.echo(f"cohort: error: {message}", err=True)
    sys.exit(code)


def _job(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_job(value)
    except EventsError as exc:
        raise click.BadParameter(str(exc)) from None


def _redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(dict)["redis_url"] = value


redis_url_option = click.option(
    "--redis-url",
    metavar="URL",
    expose_value=False,
    callback=_redis_url,
    is_eager=False,
    help="Redis URL (also accepted before the subcommand); env COHORT_REDIS_URL.",
)

job_option = click.option(
    "--job",
    "-j",
    required=True,
    envvar="COHORT_JOB",
    callback=_job,
    help="Job name (letters, digits, '.', '_', '-'); env COHORT_JOB.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--redis-url",
    envvar="COHORT_REDIS_URL",
    metavar="URL",
    help="Redis to use, e.g. redis://host:6379/0 or rediss:// for TLS, "
    "redis+cluster://host:port[,host:port...] for Redis Cluster, "
    "redis+sentinel://host:26379[,...]/SERVICE[/DB] for Sentinel; env COHORT_REDIS_URL. "
    "Default redis://127.0.0.1:6379/0 (`cohort demo` starts its own when unset).",
)
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
    redis_url: str | None,
    log_level: str,
    log_json: bool,
    redis_tls_ca: str | None = None,
    redis_tls_cert: str | None = None,
    redis_tls_key: str | None = None,
) -> None:
    """cohort coordinates elastic data-parallel training through Redis.

    \b
    Start here:
      cohort demo                       a whole job on a private Redis, in one command
      cohort coordinator --job J        run a coordinator (run two or three for failover)
      cohort worker --job J             a simulated worker (your script uses worker.Worker)
      cohort example-worker --job J     a worker training a real (numpy) model
      cohort status --job J             who leads, the world, every worker
      cohort replay --job J             rebuild and explain a run from its journal
    """
    logs.setup(log_level, log_json)
    ctx.ensure_object(dict).setdefault("redis_url", redis_url)
    tls = {"tls_ca": redis_tls_ca, "tls_cert": redis_tls_cert, "tls_key": redis_tls_key}
    ctx.obj.setdefault("redis_tls", {k: v for k, v in tls.items() if v is not None})


def _settings(ctx: click.Context, name: str) -> RedisSettings:
    try:
        tls = ctx.obj.get("redis_tls", {})
        return RedisSettings.resolve(ctx.obj["redis_url"], client_name=name, **tls)
    except SettingsError as exc:
        fail(str(exc))


def _connect(ctx: click.Context, name: str) -> Client:
    settings = _settings(ctx, name)
    try:
        conn = connect(settings)  # a cluster client asks for the slot map at once
        conn.ping()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        if _tls_failure(settings, exc):
            fail(
                f"TLS handshake with Redis at {settings.display_url} failed ({exc}); check "
                "--redis-tls-ca ($COHORT_REDIS_TLS_CA) names the CA that signed the server's "
                "certificate, and --redis-tls-cert/--redis-tls-key if the server asks for a "
                "client certificate",
                Exit.REDIS,
            )
        fail(
            f"cannot reach Redis at {settings.display_url} ({exc}); start one, or point "
            "--redis-url / $COHORT_REDIS_URL at it",
            Exit.REDIS,
        )
    except redis.AuthenticationError as exc:
        fail(f"Redis at {settings.display_url} refused the credentials: {exc}", Exit.REDIS)
    return conn


def _tls_failure(settings: RedisSettings, exc: BaseException) -> bool:
    """True if `exc` came from the TLS layer of a rediss:// connection."""
    if not settings.target.tls:
        return False
    text = str(exc).lower()
    return any(w in text for w in ("ssl", "tls", "certificate", "handshake")) or isinstance(
        exc.__cause__ or exc.__context__, ssl.SSLError
    )


def _signals(stop: threading.Event, what: str) -> None:
    """First SIGINT/SIGTERM: finish cleanly. Second: exit now."""

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


# ---------------------------------------------------------------- coordinator


def _load_config_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        fail(f"cannot read config file {str(path)!r}: {exc.strerror}")
    except tomllib.TOMLDecodeError as exc:
        fail(f"config file {str(path)!r} is not valid TOML: {exc}")


def _pydantic_message(exc: ValidationError, source: str) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        problems.append(f"{where}={err.get('input')!r}: {message}" if where else message)
    return f"bad job settings from {source}: " + "; ".join(problems)


@main.command()
@job_option
@redis_url_option
@click.option(
    "--id",
    "coordinator_id",
    metavar="NAME",
    help="This coordinator's name in facts and logs (default host-pid).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="TOML file with job settings (keys as the flags, with underscores); "
    "flags win over the file.",
)
@click.option("--min-workers", type=int, help="Pause training below this many (default 1).")
@click.option("--max-workers", type=int, help="Refuse joins beyond this many (default 64).")
@click.option("--heartbeat-interval", type=float, help="Seconds between heartbeats (default 1).")
@click.option(
    "--heartbeat-timeout",
    type=float,
    help="Seconds of silence before a worker is failed (default 5).",
)
@click.option("--dataset-size", type=int, help="Samples per epoch (default 60000).")
@click.option("--batch-size", type=int, help="Samples per rank per step (default 32).")
@click.option("--straggler-factor", type=float, help="x median step time (default 1.5).")
@click.option("--straggler-steps", type=int, help="Steps in a row to flag (default 5).")
@click.option(
    "--lease",
    type=float,
    default=3.0,
    show_default=True,
    help="Leader lease, seconds; a follower takes over within about this long.",
)
@click.option(
    "--snapshot-every",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Write a snapshot every N facts.",
)
@click.option(
    "--gpu-rules",
    "gpu_rules_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="GPU rules (TOML or YAML) replacing the defaults; see docs/gpu.md.",
)
@click.option(
    "--allow-volatile",
    is_flag=True,
    help="Lead even if Redis keeps no append-only file (a Redis restart loses the journal).",
)
@click.option(
    "--wait-aof",
    is_flag=True,
    help="After each append, wait for the AOF fsync (WAITAOF; Redis >= 7.2).",
)
@click.option(
    "--wait-replicas",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="After each append, WAIT until this many replicas have it, so a Sentinel or Cluster "
    "failover cannot lose an acknowledged fact (docs/redis-ha.md). 0: do not wait.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port (0: any free port, logged).",
)
@click.pass_context
def coordinator(
    ctx: click.Context,
    job: str,
    coordinator_id: str | None,
    config_file: Path | None,
    lease: float,
    snapshot_every: int,
    metrics_port: int | None,
    allow_volatile: bool,
    wait_aof: bool,
    wait_replicas: int,
    gpu_rules_file: Path | None,
    **flags: Any,
) -> None:
    """Run a coordinator for JOB. Run several: one leads, the others follow and take over.

    The job's settings are journaled by the first leader; later coordinators keep them.
    """
    from cohort.coordinator.errors import CoordinatorError
    from cohort.coordinator.gpu_rules import RulesError, load_rules, parse_rules
    from cohort.coordinator.service import Coordinator, ServiceSettings

    values = _load_config_file(config_file)
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        if gpu_rules_file is not None:
            rules = load_rules(gpu_rules_file)
        elif "gpu_rules" in values:
            rules = parse_rules({"rules": values["gpu_rules"]}, str(config_file))
        else:
            rules = None
    except RulesError as exc:
        fail(str(exc))
    if rules is not None:
        values["gpu_rules"] = tuple(r.model_dump(mode="json") for r in rules.rules)
    try:
        config = JobConfig(**values)
    except ValidationError as exc:
        fail(_pydantic_message(exc, str(config_file) if config_file else "the flags"))
    except TypeError as exc:
        fail(f"bad job settings: {exc}")
    if not 0.2 <= lease <= 600:
        fail(f"--lease {lease} is out of range; use 0.2 to 600 seconds")
    name = coordinator_id or f"{os.uname().nodename}-{os.getpid()}"
    settings = ServiceSettings(
        job=job,
        coordinator=name,
        config=config,
        lease_ms=int(lease * 1000),
        snapshot_every=snapshot_every,
        allow_volatile=allow_volatile,
        wait_aof=wait_aof,
        wait_replicas=wait_replicas,
        display_url=_settings(ctx, name).display_url,
    )
    redis_settings = _settings(ctx, f"cohort-coordinator-{name}")
    try:
        conn = connect(redis_settings)  # a cluster client asks for the slot map at once
    except redis.ConnectionError as exc:
        fail(f"cannot reach Redis at {redis_settings.display_url} ({exc})", Exit.REDIS)
    stop = threading.Event()
    _signals(stop, f"coordinator {name}")
    log.info("coordinator %s for job %r on %s", name, job, _settings(ctx, name).display_url)
    metrics = None
    if metrics_port is not None:
        from cohort.coordinator.metrics import Metrics

        metrics = Metrics(job, name)
        try:
            port = metrics.serve(metrics_port)
        except OSError as exc:
            fail(
                f"--metrics-port {metrics_port}: cannot listen ({exc.strerror}); pick a free "
                "port or 0 for any"
            )
        log.info("metrics on http://0.0.0.0:%d/metrics", port)
    try:
        Coordinator(conn, settings, metrics=metrics).run(stop)
    except CoordinatorError as exc:
        fail(str(exc), Exit.DATA)


# ---------------------------------------------------------------- worker


def worker_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options every worker command shares: its name and GPU sampling."""
    command = click.option(
        "--id", "worker_id", metavar="NAME", help="Worker name (default host-pid-random)."
    )(command)
    return click.option(
        "--gpu-interval",
        type=click.FloatRange(min=0),
        default=5.0,
        show_default=True,
        help="Seconds between NVML GPU readings sent to the coordinator (0: none).",
    )(command)


def _worker_client(
    ctx: click.Context, job: str, worker_id: str | None, gpu_interval: float, name: str
) -> tuple[Client, Any]:
    """A connected Worker whose first SIGINT/SIGTERM finishes the step and leaves."""
    from cohort.worker.client import Worker

    conn = _connect(ctx, name)
    client = Worker(conn, job, worker_id=worker_id, gpu_interval=gpu_interval or None)
    client.install_signal_handlers()
    return conn, client


@main.command()
@job_option
@redis_url_option
@worker_options
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Stop after this many committed steps.",
)
@click.option(
    "--step-time",
    type=click.FloatRange(min=0),
    default=0.1,
    show_default=True,
    help="Simulated compute per step, seconds.",
)
@click.pass_context
def worker(
    ctx: click.Context,
    job: str,
    worker_id: str | None,
    steps: int,
    step_time: float,
    gpu_interval: float,
) -> None:
    """A simulated worker: joins JOB, trains on its shard, survives world changes, leaves.

    It uses exactly the API a real training script uses (worker.Worker). The first
    SIGINT/SIGTERM finishes the current step and leaves; a second exits at once.
    """
    from cohort.worker.errors import WorkerError
    from cohort.worker.simulated import run

    _, client = _worker_client(ctx, job, worker_id, gpu_interval, "cohort-worker")
    try:
        summary = run(client, steps=steps, step_time=step_time, stop=client.stopping)
    except WorkerError as exc:
        fail(str(exc), Exit.DATA)
    click.echo(json.dumps(summary, default=str))


@main.command("example-worker")
@job_option
@redis_url_option
@worker_options
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=200,
    show_default=True,
    help="Train until the job has committed this many steps (all workers stop together).",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=0.2,
    show_default=True,
    help="SGD learning rate.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Initial weights (rank 0's are broadcast at every world start).",
)
@click.option(
    "--pace",
    type=click.FloatRange(min=0, max=60),
    default=0.0,
    show_default=True,
    help="Make each step take at least this many seconds (stands in for a larger model).",
)
@click.option(
    "--save",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the final weights to this .npz file.",
)
@click.pass_context
def example_worker(
    ctx: click.Context,
    job: str,
    worker_id: str | None,
    steps: int,
    lr: float,
    seed: int,
    pace: float,
    save: Path | None,
    gpu_interval: float,
) -> None:
    """Train a real model (a numpy MLP on a deterministic 4-class data set) as one worker.

    Gradients are averaged with allreduce through Redis; the job survives joins, leaves and
    failures without restarting. Prints one JSON line at the end: worker, steps, loss,
    accuracy, weights_digest.
    """
    import numpy as np

    from cohort.worker.collective import Collective
    from cohort.worker.errors import WorkerError

    from .example import run

    conn, client = _worker_client(ctx, job, worker_id, gpu_interval, "cohort-example-worker")
    try:
        summary = run(
            client, Collective(conn, job, client), steps=steps, lr=lr, seed=seed, pace=pace
        )
    except WorkerError as exc:
        fail(str(exc), Exit.DATA)
    click.echo(json.dumps({k: v for k, v in summary.items() if k != "params"}, default=str))
    if save is not None:
        np.savez(save, **summary["params"])


# ---------------------------------------------------------------- status, replay, export


@main.command()
@job_option
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, for scripts.")
@click.option("--watch", "-w", is_flag=True, help="Keep the view live until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(0.1, 60),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.pass_context
def status(ctx: click.Context, job: str, as_json: bool, watch: bool, interval: float) -> None:
    """Leader, epoch, world and every worker of JOB, from the journal and the leader's view."""
    from cohort.coordinator.replay import from_redis, read_once, rebuild, view

    from .render.terminal import status_table

    if watch and as_json:
        fail("--watch and --json do not go together; use --json in a loop for scripts")
    conn = _connect(ctx, "cohort-status")
    if watch:
        _watch(conn, job, interval)
        return
    with read_once():
        state, _ = _or_fail(lambda: rebuild(from_redis(conn, job, with_inbox=False)))
    live = _leader_view(conn, job)
    body = view(state)
    body["leader_view"] = live
    holder = conn.get(Keys(job).leader)
    body["lease_holder"] = text(holder) if holder is not None else None
    if as_json:
        click.echo(json.dumps(body, default=str))
        return
    if not state.configured:
        click.echo(f"job {job!r} has no journal yet: start `cohort coordinator --job {job}`")
        return
    status_table(body)


def _watch(conn: Client, job: str, interval: float) -> None:
    from rich.live import Live

    from cohort.coordinator.replay import JournalWatch, describe, view
    from cohort.events.streams import Journal

    from .render.terminal import console, status_view

    watch = JournalWatch(Journal(conn, Keys(job).journal))
    stop = threading.Event()
    _signals(stop, "status --watch")

    def frame() -> Any:
        body = view(watch.state)
        body["leader_view"] = _leader_view(conn, job)
        recent = [(i, f"{type(f).__name__} {describe(f)}") for i, f in watch.facts[-10:]]
        return status_view(body, recent)

    with Live(frame(), console=console, refresh_per_second=4, screen=False) as live:
        while not stop.is_set():
            try:
                watch.pull(block_ms=int(interval * 1000))
                live.update(frame())
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                live.update(f"[red]Redis unreachable ({exc}); retrying[/]")
                stop.wait(interval)


def _leader_view(conn: Client, job: str) -> dict[str, Any] | None:
    import msgpack

    raw = conn.get(Keys(job).status)
    if not raw:
        return None
    try:
        body = msgpack.unpackb(raw, raw=False)
        return body if isinstance(body, dict) else None
    except Exception:
        return None


def _reads_whole_run(command: Callable[..., Any]) -> Callable[..., Any]:
    """A one-shot command that reads a whole run: see coordinator.replay.read_once."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from cohort.coordinator.replay import read_once

        with read_once():
            return command(*args, **kwargs)

    return wrapper


def _or_fail(fn: Callable[[], Any]) -> Any:
    from cohort.coordinator.errors import CoordinatorError

    try:
        return fn()
    except CoordinatorError as exc:
        fail(str(exc), Exit.DATA)


@main.command()
@click.option(
    "--job", "-j", envvar="COHORT_JOB", callback=_job, help="Replay this job's journal from Redis."
)
@click.option(
    "--file",
    "path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Replay an exported file instead (no Redis needed).",
)
@click.option("--until", metavar="ID", help="Stop at this journal entry ID (inclusive).")
@click.option("--json", "as_json", is_flag=True, help="State and timeline as JSON.")
@click.option(
    "--audit",
    is_flag=True,
    help="Check every sample of each epoch was used by exactly one committed step.",
)
@click.option("--quiet", "-q", is_flag=True, help="Only the final state, no timeline.")
@click.pass_context
@_reads_whole_run
def replay(
    ctx: click.Context,
    job: str | None,
    path: Path | None,
    until: str | None,
    as_json: bool,
    audit: bool,
    quiet: bool,
) -> None:
    """Rebuild a job's state at any journal entry, with its timeline and a stable hash."""
    from cohort.coordinator.audit import audit as run_audit
    from cohort.coordinator.replay import describe, from_file, from_redis, rebuild, view

    from .render.terminal import audit_table, state_summary

    if (job is None) == (path is None):
        fail("give exactly one of --job J (from Redis) or --file F (from `cohort export`)")
    if until is not None and not _is_stream_id(until):
        fail(f"--until {until!r} is not a stream entry ID; use MS-SEQ as shown in the timeline")
    if path is not None:
        run = _or_fail(lambda: from_file(path))
    else:
        assert job is not None
        run = from_redis(_connect(ctx, "cohort-replay"), job, with_inbox=False)
    state, timeline = _or_fail(lambda: rebuild(run, until))
    report = run_audit(f for _, f in timeline) if audit else None
    if as_json:
        body: dict[str, Any] = {"job": run.job, "state": view(state)}
        if not quiet:
            body["timeline"] = [
                {"id": i, "type": type(f).__name__, **f.model_dump(mode="json")}
                for i, f in timeline
            ]
        if report is not None:
            body["audit"] = {
                "ok": report.ok,
                "problems": report.problems,
                "epochs": {e: vars(a) for e, a in report.epochs.items()},
            }
        click.echo(json.dumps(body, default=str))
    else:
        if not quiet:
            for entry_id, fact in timeline:
                click.echo(f"{entry_id:>22}  {type(fact).__name__:<18} {describe(fact)}")
        state_summary(view(state))
        if report is not None:
            audit_table(report)
    if report is not None and not report.ok:
        sys.exit(Exit.DATA)


def _is_stream_id(value: str) -> bool:
    ms, _, seq = value.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


@main.command("export")
@job_option
@redis_url_option
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="File to write (msgpack; `cohort replay --file` reads it).",
)
@click.pass_context
@_reads_whole_run
def export_cmd(ctx: click.Context, job: str, output: Path) -> None:
    """Write JOB's journal, retained inbox and dead letters to a file."""
    from cohort.coordinator.replay import export, from_redis

    conn = _connect(ctx, "cohort-export")
    run = from_redis(conn, job)
    tmp = output.with_name(output.name + ".part")
    try:
        with tmp.open("wb") as out:
            count = export(run, out, time.time())
        tmp.replace(output)
    except OSError as exc:
        fail(f"cannot write {str(output)!r}: {exc.strerror}")
    click.echo(
        f"wrote {count} entries ({len(run.journal)} facts, {len(run.inbox)} inbox, "
        f"{len(run.dead)} dead letters) of job {job!r} to {output}"
    )


# ---------------------------------------------------------------- report


@main.command("report")
@click.option(
    "--job", "-j", envvar="COHORT_JOB", callback=_job, help="Report on this job, read from Redis."
)
@redis_url_option
@click.option(
    "--file",
    "path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Report on an exported file instead (no Redis needed).",
)
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="HTML file to write (self-contained: opens offline in any browser).",
)
@click.option("--title", metavar="TEXT", help="Page title (default: cohort report: JOB).")
@click.pass_context
@_reads_whole_run
def report_cmd(
    ctx: click.Context, job: str | None, path: Path | None, output: Path, title: str | None
) -> None:
    """Write one HTML page with plots of a run: membership, step times, loss, GPU memory and
    temperature, with failures, leader changes and advice marked on a shared time axis."""
    from cohort.coordinator.replay import from_file, from_redis
    from cohort.coordinator.series import series

    from .render.page import render

    if (job is None) == (path is None):
        fail("give exactly one of --job J (from Redis) or --file F (from `cohort export`)")
    if path is not None:
        run = _or_fail(lambda: from_file(path))
    else:
        assert job is not None
        run = from_redis(_connect(ctx, "cohort-report"), job)
    page = render(_or_fail(lambda: series(run)), title or f"cohort report: {run.job}")
    tmp = output.with_name(output.name + ".part")
    try:
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(output)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        fail(f"cannot write {str(output)!r}: {exc.strerror}")
    click.echo(str(output))


# ---------------------------------------------------------------- acl


@main.command("acl")
@job_option
@redis_url_option
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
    from . import acl

    chosen: list[acl.Role] = [r for r in acl.ROLES if not roles or r in roles]
    passwords, generated = acl.passwords(chosen)
    admin = _settings(ctx, "cohort-acl")
    try:
        version = acl.parse_version(redis_version) if redis_version else acl.MIN_VERSION
        if do_apply:
            if redis_version:
                fail("--redis-version is for printing; --apply asks the server its version")
            conn = _connect(ctx, "cohort-acl")
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


# ---------------------------------------------------------------- demo


@main.command()
@redis_url_option
@click.option("--workers", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(20, 100_000),
    default=240,
    show_default=True,
    help="Steps the job trains for (a few seconds per hundred).",
)
@click.option("--job", "-j", default="demo", show_default=True, callback=_job)
@click.option("--keep", is_flag=True, help="Leave the private Redis running at the end.")
@click.pass_context
def demo(ctx: click.Context, workers: int, steps: int, job: str, keep: bool) -> None:
    """Run a whole job: two coordinators and several workers, with a failure of each.

    Without --redis-url or $COHORT_REDIS_URL it starts a private redis-server on a free
    port in a temp dir, and removes it at the end (also on Ctrl-C).
    """
    from .demo import run_demo

    sys.exit(run_demo(ctx.obj["redis_url"], job=job, workers=workers, steps=steps, keep=keep))


if __name__ == "__main__":  # pragma: no cover
    main()
