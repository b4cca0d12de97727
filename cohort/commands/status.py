"""`cohort status`: who leads, the world and every worker of a job, once or live."""

from __future__ import annotations

import json
import threading
from typing import Any

import click
import redis

from cohort.events.connection import Client, text
from cohort.events.keys import Keys

from .shared import fail, job_option, or_fail, redis_client, redis_url_option, stop_on_signals

RECENT_LINES = 10
RECENT_WINDOW = 5000
"""Facts --watch folds for its recent lines: runs of commits fold into one line each."""


@click.command()
@job_option()
@redis_url_option()
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
    from cohort.render.terminal import status_table

    if watch and as_json:
        fail("--watch and --json do not go together; use --json in a loop for scripts")
    conn = redis_client(ctx, "cohort-status")
    if watch:
        _watch(conn, job, interval)
        return
    with read_once():
        state, _ = or_fail(lambda: rebuild(from_redis(conn, job, with_inbox=False)))
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
    """Redraw the status as the journal grows, until Ctrl-C; rides out Redis outages."""
    from rich.live import Live

    from cohort.coordinator.replay import JournalWatch, view
    from cohort.coordinator.timeline import lines
    from cohort.events.streams import Journal
    from cohort.render.terminal import console, status_view

    watch = JournalWatch(Journal(conn, Keys(job).journal))
    stop = threading.Event()
    stop_on_signals(stop, "status --watch")

    def frame() -> Any:
        body = view(watch.state)
        body["leader_view"] = _leader_view(conn, job)
        folded = lines(watch.facts[-RECENT_WINDOW:])[-RECENT_LINES:]
        return status_view(body, [(line.entry_id, f"{line.type} {line.text}") for line in folded])

    with Live(frame(), console=console, refresh_per_second=4, screen=False) as live:
        while not stop.is_set():
            try:
                watch.pull(block_ms=int(interval * 1000))
                live.update(frame())
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                live.update(f"[red]Redis unreachable ({exc}); retrying[/]")
                stop.wait(interval)


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
