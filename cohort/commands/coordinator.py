"""`cohort coordinator`: run one of a job's coordinators (one leads, the others follow)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import click

from cohort.commands.settings import JobSettings, check_storage_uri, job_settings
from cohort.commands.shared import (
    fail,
    job_option,
    log,
    redis_client,
    redis_settings,
    redis_url_option,
    stop_on_signals,
    wait_for_redis_option,
)
from cohort.errors import Exit

if TYPE_CHECKING:
    from cohort.coordinator.metrics import Metrics


@click.command()
@job_option()
@redis_url_option()
@click.option(
    "--id",
    "coordinator_id",
    metavar="NAME",
    help="This coordinator's name in facts and logs (default host-pid).",
)
@job_settings
@click.option(
    "--stay",
    is_flag=True,
    help="Keep running once the job finished (default: exit 0 when its last worker left).",
)
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
    "--allow-volatile",
    is_flag=True,
    help="Lead even if Redis keeps no append-only file (a Redis restart loses the journal).",
)
@click.option(
    "--allow-eviction",
    is_flag=True,
    help="Lead even if Redis may evict keys (maxmemory-policy other than noeviction): "
    "memory pressure could then drop the journal.",
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
    "--journal-hot",
    type=click.IntRange(min=200),
    default=100_000,
    show_default=True,
    metavar="FACTS",
    help="Keep about this many facts of the journal in Redis and move older ones to storage "
    "(--archive-uri), so Redis's memory stays flat however long the job runs.",
)
@click.option(
    "--archive-uri",
    metavar="URI",
    help="Where the journal's archived segments go: an absolute path or fsspec URL (default: "
    "the job's --checkpoint-uri; neither: the journal stays whole in Redis).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port (0: any free port, logged).",
)
@wait_for_redis_option()
@click.pass_context
def coordinator(
    ctx: click.Context,
    job: str,
    coordinator_id: str | None,
    lease: float,
    snapshot_every: int,
    metrics_port: int | None,
    allow_volatile: bool,
    allow_eviction: bool,
    wait_aof: bool,
    wait_replicas: int,
    journal_hot: int,
    archive_uri: str | None,
    stay: bool,
    wait_for_redis: float,
    **params: Any,
) -> None:
    """Run a coordinator for JOB. Run several: one leads, the others follow and take over.

    The job's settings are journaled by the first leader. A coordinator given settings
    that differ from the journaled ones refuses to start (keep them, or `cohort reset`).
    When the job reaches --max-steps or --epochs, the coordinators exit 0 once its last
    worker left.
    """
    from cohort.coordinator.errors import CoordinatorError
    from cohort.coordinator.service import Coordinator, ServiceSettings
    from cohort.events.archive import ArchiveError

    config, given = JobSettings.of(params).config()
    _check_storage(job, config.checkpoint_uri, archive_uri)
    if not 0.2 <= lease <= 600:
        fail(f"--lease {lease} is out of range; use 0.2 to 600 seconds")
    name = coordinator_id or f"{os.uname().nodename}-{os.getpid()}"
    server = redis_settings(ctx, f"cohort-coordinator-{name}")
    settings = ServiceSettings(
        job=job,
        coordinator=name,
        config=config,
        lease_ms=int(lease * 1000),
        snapshot_every=snapshot_every,
        allow_volatile=allow_volatile,
        allow_eviction=allow_eviction,
        wait_aof=wait_aof,
        wait_replicas=wait_replicas,
        display_url=server.display_url,
        given=given,
        stay=stay,
        journal_hot=journal_hot,
        archive_uri=archive_uri,
    )
    conn = redis_client(ctx, server.client_name or "", wait_for_redis)
    stop = threading.Event()
    stop_on_signals(stop, f"coordinator {name}")
    log.info("coordinator %s for job %r on %s", name, job, server.display_url)
    metrics = _serve_metrics(job, name, metrics_port) if metrics_port is not None else None
    try:
        Coordinator.on_redis(conn, settings, metrics=metrics).run(stop)
    except (CoordinatorError, ArchiveError) as exc:
        fail(str(exc), Exit.DATA)


def _check_storage(job: str, checkpoint_uri: str | None, archive_uri: str | None) -> None:
    """The archive's URI is one fsspec knows, and the checkpoint location is this job's from
    now on; else exit 2 naming the URI (and the job that holds the location)."""
    from cohort.events.storage import StorageError, claim

    if archive_uri is not None:
        check_storage_uri("--archive-uri", archive_uri)
    try:
        if checkpoint_uri is not None:
            claim(checkpoint_uri, job)
    except StorageError as exc:
        fail(str(exc))


def _serve_metrics(job: str, name: str, port: int) -> Metrics:
    """Prometheus metrics on `port` (0: any free one, logged); else exit 2 naming the port."""
    from cohort.coordinator.metrics import Metrics

    metrics = Metrics(job, name)
    try:
        bound = metrics.serve(port)
    except OSError as exc:
        fail(
            f"--metrics-port {port}: cannot listen ({exc.strerror}); pick a free port or 0 for any"
        )
    log.info("metrics on http://0.0.0.0:%d/metrics", bound)
    return metrics
