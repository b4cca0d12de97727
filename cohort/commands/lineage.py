"""`cohort checkpoints` and `cohort resume`: a job's checkpoint index, and continuing a job
whose weights are lost."""

from __future__ import annotations

import json
import time
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
)
from cohort.errors import Exit

if TYPE_CHECKING:
    from cohort.events.connection import Client
    from cohort.events.identity import Signer

RESUME_WAIT = 30.0


@click.command()
@job_option(required=False)
@redis_url_option()
@run_dir_option()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.pass_context
def checkpoints(ctx: click.Context, job: str | None, as_json: bool) -> None:
    """The checkpoints of JOB as its journal indexes them, oldest first, and its rewinds."""
    from cohort.coordinator.replay import from_redis, read_once, rebuild
    from cohort.events.models import Rewound

    job = job_of(ctx, job)
    conn = redis_client(ctx, "cohort-checkpoints")
    with read_once():
        state, timeline = or_fail(lambda: rebuild(from_redis(conn, job, with_inbox=False)))
    if not state.configured:
        fail(f"job {job!r} has no journal here; is --redis-url the job's Redis?", Exit.DATA)
    rewinds = [f for _, f in timeline if isinstance(f, Rewound)]
    if as_json:
        plain = {"v", "job", "position"}
        body = {
            "job": job,
            "checkpoint_uri": state.config.checkpoint_uri if state.config else None,
            "checkpoints": [c.model_dump(mode="json", exclude=plain) for c in state.checkpoints],
            "requested": [r.step for r in state.requested],
            "rewinds": [r.model_dump(mode="json", exclude=plain) for r in rewinds],
            "weights_lost": state.weights_lost,
        }
        click.echo(json.dumps(body))
        return
    if not state.checkpoints:
        where = state.config.checkpoint_uri if state.config else None
        click.echo(
            f"job {job!r} has no checkpoints"
            + (
                f" yet (they go to {where})"
                if where
                else ": start its coordinators with --checkpoint-uri URI"
            )  # fmt: skip
        )
    for saved in state.checkpoints:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(saved.at))
        click.echo(f"step {saved.step:>8}  {saved.bytes:>12} bytes  {when}  {saved.uri}")
    for rewind in rewinds:
        click.echo(
            f"rewound from step {rewind.from_step} to {rewind.to_step} ({rewind.source}"
            + (f" {rewind.uri}" if rewind.uri else "")
            + f"): {rewind.reason}"
        )
    if state.weights_lost is not None:
        click.echo(
            f"the weights of step {state.weights_lost} are lost; continue with "
            f"`cohort resume --job {job} --from-scratch` or `--from-checkpoint URI`"
        )


@click.command()
@job_option()
@redis_url_option()
@click.option("--from-scratch", is_flag=True, help="Start over from the initial weights.")
@click.option(
    "--from-checkpoint",
    "uri",
    metavar="URI",
    help="Continue from this checkpoint file (a path or fsspec URL); it is read and "
    "checked here, and must be one of JOB's.",
)
@click.option("--reason", default="", help="Why, for the journal.")
@click.pass_context
def resume(ctx: click.Context, job: str, from_scratch: bool, uri: str | None, reason: str) -> None:
    """Continue JOB after its weights were lost (every holder died and no checkpoint existed).

    Training paused rather than going on from fresh weights; this says how to go on.
    """
    from cohort.coordinator.replay import from_redis, read_once, rebuild
    from cohort.events.archive import History
    from cohort.events.keys import Keys
    from cohort.events.models import Resume, Rewound
    from cohort.events.streams import Inbox, Journal
    from cohort.worker.loop.checkpoints import CheckpointError, read

    if from_scratch == (uri is not None):
        fail("give exactly one of --from-scratch or --from-checkpoint URI")
    conn = redis_client(ctx, "cohort-resume")
    with read_once():
        state, _ = or_fail(lambda: rebuild(from_redis(conn, job, with_inbox=False)))
    if state.weights_lost is None:
        fail(
            f"job {job!r} is not waiting for a resume: its weights are held (last committed "
            f"step {state.last_committed}); a resume would discard training",
            Exit.DATA,
        )
    body: dict[str, object] = {}
    if uri is not None:
        try:
            checkpoint = read(uri)
        except CheckpointError as exc:
            fail(str(exc), Exit.DATA)
        if checkpoint.job != job:
            fail(f"{uri!r} is a checkpoint of job {checkpoint.job!r}, not of {job!r}", Exit.DATA)
        body = {
            "uri": uri,
            "step": checkpoint.step,
            "digest": checkpoint.digest,
            "sha256": checkpoint.sha256,
            "position": checkpoint.position,
        }
    keys, history = Keys(job), History.of(conn, job)
    after = history.journal.last_id()
    Inbox(conn, keys.inbox, _operator_signer(conn, job)).send(
        Resume(at=time.time(), job=job, reason=reason, **body)  # type: ignore[arg-type]
    )
    deadline = time.monotonic() + RESUME_WAIT
    while time.monotonic() < deadline:
        for entries in history.pages(after, block_ms=500):
            for fact in Journal.decode_page(entries):
                if isinstance(fact, Rewound):
                    click.echo(
                        f"job {job!r} resumes from "
                        + (f"step {fact.to_step} ({fact.uri})" if fact.uri else "scratch")
                        + f": steps {fact.to_step + 1}..{fact.from_step} left its lineage"
                    )
                    return
            after = entries[-1].id
    fail(
        f"sent the resume, but no coordinator of job {job!r} answered within "
        f"{RESUME_WAIT:g} s; is one running? (`cohort status --job {job}`)",
        Exit.REDIS,
    )


def _operator_signer(conn: Client, job: str) -> Signer | None:
    """The operator's signer if JOB is in identity mode (its commands must be signed), else
    None. Reading the job key needs coordinator (or admin) credentials."""
    import redis

    from cohort.events import identity
    from cohort.events.keys import Keys

    try:
        job_key: Any = conn.get(Keys(job).identity)
    except redis.exceptions.NoPermissionError:
        fail(
            f"job {job!r} may require signed commands and these credentials cannot read its "
            "identity key: run cohort resume with the coordinator's --redis-url",
            Exit.REDIS,
        )
    return identity.operator(bytes(job_key)) if job_key else None
