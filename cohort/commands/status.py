"""`cohort status`: who leads, the world and every worker of a job, once or live."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from cohort.commands.shared import (
    fail,
    job_of,
    job_option,
    or_fail,
    redis_client,
    redis_url_option,
    run_dir_option,
    stop_on_signals,
)
from cohort.events.connection import UNAVAILABLE, Client, text
from cohort.events.keys import Keys

if TYPE_CHECKING:
    from cohort.coordinator.state import JobState

RECENT_LINES = 10
RECENT_WINDOW = 5000
"""Facts --watch folds for its recent lines: runs of commits fold into one line each."""


@click.command()
@job_option(required=False)
@redis_url_option()
@run_dir_option()
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
def status(
    ctx: click.Context, job: str | None, as_json: bool, watch: bool, interval: float
) -> None:
    """Leader, epoch, world and every worker of JOB, from the journal and the leader's view
    (of a run `cohort run` kept in a directory, finished or not: --run-dir DIR)."""
    from cohort.coordinator.replay import from_redis, read_once, rebuild
    from cohort.render.terminal import status_table

    if watch and as_json:
        fail("--watch and --json do not go together; use --json in a loop for scripts")
    job = job_of(ctx, job)
    conn = redis_client(ctx, "cohort-status")
    if watch:
        _watch(conn, job, interval)
        return
    with read_once():
        state, _ = or_fail(lambda: rebuild(from_redis(conn, job, with_inbox=False)))
    body = _status(conn, job, state)
    if as_json:
        click.echo(json.dumps(body, default=str))
        return
    if not state.configured:
        click.echo(f"job {job!r} has no journal yet: start `cohort coordinator --job {job}`")
        return
    status_table(body)


def _watch(conn: Client, job: str, interval: float) -> None:
    """Redraw the status as the journal grows, until Ctrl-C; rides out Redis outages. On a
    terminal the view is redrawn in place; piped or redirected, a frame is printed at most
    every `interval` seconds, each under a line with its time."""
    from cohort.coordinator.replay import JournalWatch
    from cohort.coordinator.timeline import lines
    from cohort.render.terminal import console, status_view

    watch = JournalWatch.of(conn, job)
    stop = threading.Event()
    stop_on_signals(stop, "status --watch")

    def frame() -> Any:
        body = _status(conn, job, watch.state)
        folded = lines(watch.facts[-RECENT_WINDOW:])[-RECENT_LINES:]
        return status_view(body, [(line.entry_id, f"{line.type} {line.text}") for line in folded])

    def refresh(show: Callable[[Any], None]) -> None:
        """Fold what the journal gained (waiting up to `interval` for it) and show it."""
        try:
            watch.pull(block_ms=int(interval * 1000))
            show(frame())
        except UNAVAILABLE as exc:
            show(f"[red]Redis unreachable ({exc}); retrying[/]")
            stop.wait(interval)

    if not console.is_terminal:
        _print_frames(refresh, stop, interval)
        return
    from rich.live import Live

    with Live(frame(), console=console, refresh_per_second=4, screen=False) as live:
        while not stop.is_set():
            refresh(live.update)


def _print_frames(
    refresh: Callable[[Callable[[Any], None]], None], stop: threading.Event, interval: float
) -> None:
    """Plain periodic output for a pipe or a file: one frame at most every `interval` s."""
    from cohort.render.terminal import console

    def show(renderable: Any) -> None:
        console.print(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        console.print(renderable)
        console.file.flush()

    while not stop.is_set():
        started = time.monotonic()
        refresh(show)
        stop.wait(max(0.0, started + interval - time.monotonic()))


def _status(conn: Client, job: str, state: JobState) -> dict[str, Any]:
    """The status body of docs/status-json.md: `state`, the lease now, the leader's view."""
    from cohort.coordinator.status import status as status_body
    from cohort.events.clock import ServerClock

    token = conn.get(Keys(job).leader)
    lease = text(token) if token is not None else None
    return status_body(
        state, lease, _leader_view(conn, job), ServerClock(conn).now(), _held(conn, job)
    )


def _held(conn: Client, job: str) -> tuple[int, int | None]:
    """The journal's entries in Redis, and its bytes there (None: MEMORY USAGE refused)."""
    import redis

    key = Keys(job).journal
    entries = int(conn.xlen(key))  # type: ignore[arg-type]
    try:
        size: Any = conn.memory_usage(key, samples=0)
    except redis.ResponseError:
        size = None
    return entries, None if size is None else int(size)


def _leader_view(conn: Client, job: str) -> dict[str, Any] | None:
    """The leader's volatile view (inbox lag, last heartbeats), if a leader published one."""
    import msgpack

    raw = conn.get(Keys(job).status)
    if not raw:
        return None
    try:
        body = msgpack.unpackb(raw, raw=False)
        return body if isinstance(body, dict) else None
    except Exception:
        return None
