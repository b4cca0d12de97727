"""`cohort worker` and `cohort example-worker`: one worker process of a job each."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from cohort.commands.shared import (
    FILE,
    F,
    fail,
    job_option,
    redis_client,
    redis_url_option,
    wait_for_redis_option,
)
from cohort.errors import Exit
from cohort.events.connection import Client
from cohort.events.models import Dataset

if TYPE_CHECKING:
    from cohort.worker.membership.client import Worker

SYNTHETIC = Dataset(size=60_000, adapts=True)
"""What these workers declare: they make their data to whatever size the job has, so a job
that knows its dataset (--dataset-size, or another worker's declaration) keeps it, and one
that does not takes 60000 samples."""


def worker_command(name: str, steps: int | None, steps_help: str) -> Callable[[F], click.Command]:
    """A worker command with the options every worker shares, before its own:
    --job, --redis-url, --gpu-interval, --id, --steps (default `steps`) and --join-timeout."""

    def decorate(command: F) -> click.Command:
        shared = (
            job_option(),
            redis_url_option(),
            click.option(
                "--gpu-interval",
                type=click.FloatRange(min=0),
                default=5.0,
                show_default=True,
                help="Seconds between NVML GPU readings sent to the coordinator (0: none).",
            ),
            click.option(
                "--id", "worker_id", metavar="NAME", help="Worker name (default host-pid-random)."
            ),
            click.option(
                "--steps",
                type=click.IntRange(min=1),
                default=steps,
                show_default=steps is not None,
                help=steps_help,
            ),
            click.option(
                "--join-timeout",
                type=click.FloatRange(min=0),
                default=0.0,
                envvar="COHORT_JOIN_TIMEOUT",
                callback=_zero_is_none,
                metavar="SECONDS",
                help="Give up (exit 4) if no coordinator has answered the join after SECONDS. "
                "0 (the default): wait however late one starts, heartbeating meanwhile, until "
                "stopped; env COHORT_JOIN_TIMEOUT.",
            ),
            wait_for_redis_option(),
        )
        for option in reversed(shared):  # click lists options in the reverse of applying them
            command = option(command)
        return click.command(name)(click.pass_context(command))

    return decorate


def _zero_is_none(ctx: click.Context, param: click.Parameter, value: float) -> float | None:
    return value or None


def run_worker(
    ctx: click.Context,
    job: str,
    worker_id: str | None,
    gpu_interval: float,
    wait_for_redis: float,
    name: str,
    train: Callable[[Client, Worker], dict[str, Any]],
) -> dict[str, Any]:
    """Join JOB as a Worker, `train`, print the summary as one JSON line and return it.

    The first SIGINT/SIGTERM finishes the step and leaves (before the join is answered: takes
    the join back and exits 0); a WorkerError exits 4.
    """
    from cohort.worker.membership.client import Worker

    conn = redis_client(ctx, name, wait_for_redis)

    def joined() -> dict[str, Any]:
        client = Worker(
            conn,
            job,
            worker_id=worker_id,
            gpu_interval=gpu_interval or None,
            dataset=SYNTHETIC,
        )
        client.install_signal_handlers()
        return train(conn, client)

    return summarised(joined)


def summarised(train: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a worker's `train`, print its summary as one JSON line (without its parameters)
    and return it; a stop before the join exits 0, a WorkerError exits 4 naming it (a
    worker id that is not its credential's: 2)."""
    from cohort.worker.errors import (
        IdentityMismatchError,
        RedisUnreachableError,
        Stopped,
        WorkerError,
    )

    try:
        summary = train()
    except RedisUnreachableError as exc:
        fail(str(exc), Exit.REDIS)
    except IdentityMismatchError as exc:
        fail(str(exc))
    except Stopped as exc:
        click.echo(f"cohort: {exc}", err=True)
        sys.exit(Exit.OK)
    except WorkerError as exc:
        fail(str(exc), Exit.DATA)
    click.echo(json.dumps({k: v for k, v in summary.items() if k != "params"}, default=str))
    return summary


@worker_command("worker", steps=100, steps_help="Stop after this many committed steps.")
@click.option(
    "--step-time",
    type=click.FloatRange(min=0),
    default=0.1,
    show_default=True,
    help="Simulated compute per step, seconds.",
)
def worker(
    ctx: click.Context,
    job: str,
    worker_id: str | None,
    steps: int,
    step_time: float,
    gpu_interval: float,
    join_timeout: float | None,
    wait_for_redis: float,
) -> None:
    """A simulated worker: joins JOB, trains on its shard, survives world changes, leaves.

    It uses exactly the API a real training script uses (cohort.Worker). The first
    SIGINT/SIGTERM finishes the current step and leaves; a second exits at once.
    """
    from cohort.worker.loop.simulated import run

    run_worker(
        ctx,
        job,
        worker_id,
        gpu_interval,
        wait_for_redis,
        "cohort-worker",
        lambda conn, client: run(
            client,
            steps=steps,
            step_time=step_time,
            stop=client.stopping,
            join_timeout=join_timeout,
        ),
    )


@worker_command(
    "example-worker",
    steps=None,
    steps_help="Stop once the job committed this many steps (default: train until the job "
    "finishes, at its coordinators' --max-steps or --epochs).",
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
    type=FILE,
    help="Write the final weights to this .npz file.",
)
@click.option(
    "--collective-timeout",
    type=click.FloatRange(min=0, min_open=True, max=1e9),
    envvar="COHORT_COLLECTIVE_TIMEOUT",
    metavar="SECONDS",
    help="How long an allreduce waits for its peers while Redis answers (time Redis is away "
    "does not count); env COHORT_COLLECTIVE_TIMEOUT. Default 60.",
)
@click.option(
    "--ride-out",
    type=click.FloatRange(min=0, min_open=True, max=1e9),
    envvar="COHORT_RIDE_OUT",
    metavar="SECONDS",
    help="How long one Redis outage may last before the worker gives up (exit 3); env "
    "COHORT_RIDE_OUT. Default 300.",
)
def example_worker(
    ctx: click.Context,
    job: str,
    worker_id: str | None,
    steps: int | None,
    lr: float,
    seed: int,
    pace: float,
    save: Path | None,
    collective_timeout: float | None,
    ride_out: float | None,
    gpu_interval: float,
    join_timeout: float | None,
    wait_for_redis: float,
) -> None:
    """Train a real model (a numpy MLP on a deterministic 4-class data set) as one worker,
    with `cohort.NumpyElasticJob`: the loop a training script writes (see cohort/example.py).

    Gradients are averaged with allreduce through Redis; the job survives joins, leaves and
    failures without restarting. Prints one JSON line at the end: worker, steps, loss,
    accuracy, weights_digest, and why the job finished.
    """
    import numpy as np

    from cohort.example import run
    from cohort.worker.loop.elastic import NumpyElasticJob

    conn = redis_client(ctx, "cohort-example-worker", wait_for_redis)
    summary = summarised(
        lambda: run(
            NumpyElasticJob(
                job,
                conn=conn,
                worker_id=worker_id,
                join_timeout=join_timeout,
                digest_every=1,
                gpu_interval=gpu_interval or None,
                dataset=SYNTHETIC,
                collective_timeout=collective_timeout,
                ride_out=ride_out,
            ),
            steps=steps,
            lr=lr,
            seed=seed,
            pace=pace,
        )
    )
    if save is not None:
        np.savez(save, **summary["params"])
