"""`cohort replay`, `export` and `report`: commands that read a whole run and explain it."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import click

from cohort.commands.shared import (
    FILE,
    NO_JOB,
    F,
    fail,
    job_of,
    job_option,
    or_fail,
    redis_client,
    redis_url_option,
    run_dir_option,
)
from cohort.errors import Exit
from cohort.events.connection import Client, where
from cohort.events.keys import Keys

if TYPE_CHECKING:
    from cohort.coordinator.replay import Run

T = TypeVar("T")
ONE_SOURCE = (
    "give exactly one source: --job J (from Redis), --run-dir DIR (a `cohort run`'s run "
    "directory) or --file F (from `cohort export`)"
)


def reads_whole_run(command: F) -> F:
    """A one-shot command that reads a whole run: see coordinator.replay.read_once."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from cohort.coordinator.replay import read_once

        with read_once():
            return command(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _file_option(help: str) -> Callable[[F], F]:
    """--file PATH: read the run from a `cohort export` file instead of Redis."""
    return click.option("--file", "path", type=FILE, help=help)


def _output_option(help: str) -> Callable[[F], F]:
    """--output/-o PATH, required: where the command writes what it made of the run."""
    return click.option("--output", "-o", required=True, type=FILE, help=help)


def run_from(
    ctx: click.Context,
    job: str | None,
    path: Path | None,
    name: str,
    with_inbox: bool,
    missing: str = ONE_SOURCE,
) -> Run:
    """The run in the export file `path`, else JOB's in Redis or in --run-dir (connecting
    as `name`); exit 2 unless exactly one source is given."""
    from cohort.coordinator.replay import from_file, from_redis

    if path is not None:
        if job is not None or ctx.obj.get("run_dir") is not None:
            fail(ONE_SOURCE)
        return or_fail(lambda: from_file(path))
    job = job_of(ctx, job, missing)
    conn = redis_client(ctx, name)
    known(conn, job)
    return from_redis(conn, job, with_inbox=with_inbox)


def known(conn: Client, job: str) -> None:
    """Return if Redis holds JOB's journal or inbox; else exit 2 naming it and the jobs
    this Redis does hold (a typo must not read as an empty run)."""
    from cohort.events.reset import jobs

    keys = Keys(job)
    if conn.exists(keys.journal, keys.inbox):
        return
    held = jobs(conn)
    fail(
        f"job {job!r} has no journal or inbox in Redis at {where(conn)}; "
        + (f"the jobs there: {', '.join(held)}" if held else "it holds no cohort job")
    )


def write_whole(output: Path, write: Callable[[IO[bytes]], T]) -> T:
    """`write` to OUTPUT.part, renamed to OUTPUT at the end: no reader sees half a file."""
    tmp = output.with_name(output.name + ".part")
    try:
        with tmp.open("wb") as out:
            result = write(out)
        tmp.replace(output)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        fail(f"cannot write {str(output)!r}: {exc.strerror}")
    return result


@click.command()
@job_option("Replay this job's journal from Redis.", required=False)
@redis_url_option()
@run_dir_option()
@_file_option("Replay an exported file instead (no Redis needed).")
@click.option("--until", metavar="ID", help="Stop at this journal entry ID (inclusive).")
@click.option("--json", "as_json", is_flag=True, help="State and timeline as JSON.")
@click.option(
    "--audit",
    is_flag=True,
    help="Check every sample of each epoch was used by exactly one committed step.",
)
@click.option(
    "--timeline", is_flag=True, help="With --audit: the timeline too (else the verdict alone)."
)
@click.option("--quiet", "-q", is_flag=True, help="Only the final state, no timeline.")
@click.pass_context
@reads_whole_run
def replay(
    ctx: click.Context,
    job: str | None,
    path: Path | None,
    until: str | None,
    as_json: bool,
    audit: bool,
    timeline: bool,
    quiet: bool,
) -> None:
    """Rebuild a job's state at any journal entry, with its timeline and a stable hash;
    with --audit, the state and the audit's verdict (--timeline for the timeline too)."""
    from cohort.coordinator.audit import audit as run_audit
    from cohort.coordinator.replay import fact_details, rebuild, view
    from cohort.render.terminal import audit_table, state_summary

    if until is not None and not _is_stream_id(until):
        fail(f"--until {until!r} is not a stream entry ID; use MS-SEQ as shown in the timeline")
    if quiet and timeline:
        fail("--quiet and --timeline contradict each other: give one")
    run = run_from(ctx, job, path, "cohort-replay", with_inbox=False)
    state, facts = or_fail(lambda: rebuild(run, until))
    report = run_audit(f for _, f in facts) if audit else None
    show_timeline = timeline or not (quiet or audit)
    if as_json:
        body: dict[str, Any] = {"job": run.job, "state": view(state)}
        if show_timeline:
            body["timeline"] = [
                {"id": i, "type": type(f).__name__, **f.model_dump(mode="json")} for i, f in facts
            ]
        if report is not None:
            body["audit"] = {
                "ok": report.ok,
                "problems": report.problems,
                "epochs": {e: vars(a) for e, a in report.epochs.items()},
                "refused": [
                    {"sender": who, "verified": proven, "kind": kind, "count": n}
                    for who, proven, kind, n, _ in report.refused.rows()
                ],
                "inbox_repairs": [r.model_dump(mode="json") for r in report.repairs],
                "launcher": None if report.launcher is None else launcher_json(report.launcher),
            }
        click.echo(json.dumps(body, default=str))
    else:
        if show_timeline:
            for entry_id, fact in facts:
                click.echo(f"{entry_id:>22}  {type(fact).__name__:<18} {fact_details(fact)}")
        state_summary(view(state))
        if report is not None:
            audit_table(report)
    if report is not None and not report.ok:
        sys.exit(Exit.DATA)


def launcher_json(launcher: Any) -> dict[str, Any]:
    """A torchrun job's audit record, for --json."""
    return {
        "covers": launcher.covers,
        "rounds": launcher.rounds,
        "runs": launcher.runs,
        "restarts": launcher.restarts,
        "running": launcher.running,
        "ended": launcher.ended,
    }


def _is_stream_id(value: str) -> bool:
    ms, _, seq = value.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


@click.command("export")
@job_option(required=False)
@redis_url_option()
@run_dir_option()
@_output_option("File to write (msgpack; `cohort replay --file` reads it).")
@click.pass_context
@reads_whole_run
def export_cmd(ctx: click.Context, job: str | None, output: Path) -> None:
    """Write JOB's journal, retained inbox and dead letters to a file."""
    from cohort.coordinator.replay import export

    run = run_from(ctx, job, None, "cohort-export", with_inbox=True, missing=NO_JOB)
    job = run.job
    count = write_whole(output, lambda out: export(run, out, time.time()))
    click.echo(
        f"wrote {count} entries ({len(run.journal)} facts, {len(run.inbox)} inbox, "
        f"{len(run.dead)} dead letters) of job {job!r} to {output}"
    )


@click.command("report")
@job_option("Report on this job, read from Redis.", required=False)
@redis_url_option()
@run_dir_option()
@_file_option("Report on an exported file instead (no Redis needed).")
@_output_option("HTML file to write (self-contained: opens offline in any browser).")
@click.option("--title", metavar="TEXT", help="Page title (default: cohort report: JOB).")
@click.pass_context
@reads_whole_run
def report_cmd(
    ctx: click.Context, job: str | None, path: Path | None, output: Path, title: str | None
) -> None:
    """Write one HTML page with plots of a run: membership, step times, loss, GPU memory and
    temperature, with failures, leader changes and advice marked on a shared time axis."""
    from cohort.coordinator.series import series
    from cohort.render.page import render

    run = run_from(ctx, job, path, "cohort-report", with_inbox=True)
    page = render(or_fail(lambda: series(run)), title or f"cohort report: {run.job}")
    write_whole(output, lambda out: out.write(page.encode("utf-8")))
    click.echo(str(output))
