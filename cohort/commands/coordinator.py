"""`cohort coordinator`: run one of a job's coordinators (one leads, the others follow)."""

from __future__ import annotations

import os
import threading
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from cohort.commands.shared import (
    FILE,
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
from cohort.events.models import JobConfig

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
@click.option(
    "--config",
    "config_file",
    type=FILE,
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
@click.option(
    "--dataset-size",
    type=int,
    help="Samples per epoch (default: the dataset the first worker to join declares; a "
    "worker declaring other data is refused).",
)
@click.option(
    "--batch-size",
    type=int,
    help="Samples per rank per step; with --global-batch, the most per forward (default 32).",
)
@click.option(
    "--global-batch",
    type=int,
    help="Keep this many samples per step whatever the world size: ranks split them and "
    "accumulate micro-batches of --batch-size, so the update equals a bigger world's "
    "(default: --batch-size per rank; the global batch follows the world).",
)
@click.option(
    "--placement",
    type=click.Choice(["contiguous", "strided", "hash", "locality"]),
    help="How each epoch's samples are dealt to ranks: contiguous runs, strided (rank r "
    "takes r, r+n, ...: the global batches follow the epoch's order at any world size), or, "
    "for a dataset of files, hash (a worker keeps its files across epochs and worlds) or "
    "locality (files the worker's node holds first). Default: contiguous.",
)
@click.option(
    "--shuffle/--no-shuffle",
    default=None,
    help="Visit each epoch's samples in its own pseudorandom order, keyed by the seed and "
    "the epoch, exactly once whatever the world does (default: shuffle); --no-shuffle: in "
    "index order.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**53),
    help="The shuffle's seed: the same seed gives the same orders (default 0).",
)
@click.option("--straggler-factor", type=float, help="x median step time (default 1.5).")
@click.option("--straggler-steps", type=int, help="Steps in a row to flag (default 5).")
@click.option(
    "--checkpoint-uri",
    metavar="URI",
    help="Where the weights are checkpointed: an absolute path, file://..., or any fsspec "
    "filesystem (s3://, gs://, ... with its extra installed on the workers).",
)
@click.option(
    "--checkpoint-every",
    type=int,
    help="Committed steps between checkpoints (default 100).",
)
@click.option(
    "--checkpoint-keep",
    type=int,
    help="Checkpoints kept; older files are deleted (default 3).",
)
@click.option(
    "--max-steps",
    type=int,
    help="The job finishes once this many steps committed (default: no limit).",
)
@click.option(
    "--epochs",
    type=int,
    help="The job finishes once this many epochs finished (default: no limit).",
)
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
    "--gpu-rules",
    "gpu_rules_file",
    type=FILE,
    help="GPU rules (TOML or YAML) replacing the defaults; see docs/gpu.md.",
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
    config_file: Path | None,
    lease: float,
    snapshot_every: int,
    metrics_port: int | None,
    allow_volatile: bool,
    allow_eviction: bool,
    wait_aof: bool,
    wait_replicas: int,
    gpu_rules_file: Path | None,
    stay: bool,
    wait_for_redis: float,
    **flags: Any,
) -> None:
    """Run a coordinator for JOB. Run several: one leads, the others follow and take over.

    The job's settings are journaled by the first leader. A coordinator given settings
    that differ from the journaled ones refuses to start (keep them, or `cohort reset`).
    When the job reaches --max-steps or --epochs, the coordinators exit 0 once its last
    worker left.
    """
    from cohort.coordinator.errors import CoordinatorError
    from cohort.coordinator.service import Coordinator, ServiceSettings

    config, given = _job_config(config_file, gpu_rules_file, flags)
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
    )
    conn = redis_client(ctx, server.client_name or "", wait_for_redis)
    stop = threading.Event()
    stop_on_signals(stop, f"coordinator {name}")
    log.info("coordinator %s for job %r on %s", name, job, server.display_url)
    metrics = _serve_metrics(job, name, metrics_port) if metrics_port is not None else None
    try:
        Coordinator.on_redis(conn, settings, metrics=metrics).run(stop)
    except CoordinatorError as exc:
        fail(str(exc), Exit.DATA)


def _job_config(
    config_file: Path | None, gpu_rules_file: Path | None, flags: dict[str, Any]
) -> tuple[JobConfig, frozenset[str]]:
    """The job's settings (the TOML file's, then the flags given, then the GPU rules) and
    the names of those that were given."""
    from cohort.coordinator.gpu_rules import RulesError, load_rules, parse_rules

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
    if values.get("checkpoint_uri") is not None:
        _check_checkpoint_uri(str(values["checkpoint_uri"]))
    try:
        return JobConfig(**values), frozenset(values)
    except ValidationError as exc:
        fail(_pydantic_message(exc, str(config_file) if config_file else "the flags"))
    except TypeError as exc:
        fail(f"bad job settings: {exc}")


def _check_checkpoint_uri(uri: str) -> None:
    """An absolute path or a URL of a filesystem fsspec knows; else exit 2 naming it."""
    from fsspec.registry import known_implementations, registry
    from fsspec.utils import get_protocol

    protocol = get_protocol(uri)
    if "://" not in uri and not uri.startswith("/"):
        fail(
            f"--checkpoint-uri {uri!r} is a relative path; every worker resolves it in its own "
            "directory: give an absolute path or a URL (file:///..., s3://...)"
        )
    if protocol not in known_implementations and protocol not in registry:
        fail(
            f"--checkpoint-uri {uri!r}: fsspec knows no filesystem {protocol!r}; use an absolute "
            "path, file:///..., or e.g. s3://, gs://, abfs:// (with s3fs, gcsfs, adlfs installed)"
        )


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
