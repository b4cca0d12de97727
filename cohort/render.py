"""Terminal output of the cohort command (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


def _shard(ranges: list[list[int]]) -> str:
    if not ranges:
        return "-"
    size = sum(b - a for a, b in ranges)
    first = f"[{ranges[0][0]},{ranges[0][1]})"
    more = f" +{len(ranges) - 1} ranges" if len(ranges) > 1 else ""
    return f"{size} samples {first}{more}"


def state_summary(body: dict[str, Any]) -> None:
    counters = body["counters"]
    console.print(
        f"[bold]job[/] {body['job'] or '?'}  [bold]leader[/] {body['leader'] or '-'} "
        f"(epoch {body['leader_epoch']})  [bold]world[/] v{body['world_version']} "
        f"size {body['world_size']}  [bold]data epoch[/] {body['epoch']}  "
        f"[bold]next step[/] {body['next_step']}  "
        f"{'[yellow]paused[/]' if body['paused'] else '[green]running[/]'}"
    )
    console.print(
        f"joined {counters['joined']}  left {counters['left']}  failed {counters['failed']}  "
        f"refused {counters['refused']}  steps {counters['steps_committed']}  "
        f"epochs {counters['epochs_finished']}  elections {counters['elections']}  "
        f"facts {body['facts']}  state hash {body['state_hash']}"
    )


def status_table(body: dict[str, Any]) -> None:
    state_summary(body)
    live = body.get("leader_view") or {}
    workers_live = live.get("workers", {})
    if live:
        console.print(
            f"leader view: {live.get('coordinator')} at journal {live.get('journal_id')}, "
            f"inbox lag {live.get('inbox_lag_ms', 0)} ms"
        )
    else:
        console.print("[yellow]no live leader view (no coordinator leads right now?)[/]")
    table = Table("worker", "state", "rank", "shard", "last heartbeat", "step", "flags")
    at = live.get("at")
    shards = body.get("shards", [])
    for worker, member in body["members"].items():
        seen = workers_live.get(worker, {})
        last = seen.get("last_seen")
        ago = f"{at - last:.1f}s ago" if last and at else "-"
        rank = member.get("rank")
        shard = _shard(shards[rank]) if rank is not None and rank < len(shards) else "-"
        progress = seen.get("progress") or [-1, -1]
        table.add_row(
            worker,
            member["status"],
            "-" if rank is None else str(rank),
            shard,
            ago,
            str(progress[1]) if progress[1] >= 0 else "-",
            "straggler" if member.get("straggler") else "",
        )
    console.print(table)


def audit_table(report: Any) -> None:
    table = Table("epoch", "finished", "steps", "samples used", "duplicated", "missing", "ok")
    for epoch, entry in sorted(report.epochs.items()):
        table.add_row(
            str(epoch),
            "yes" if entry.finished else "no",
            str(entry.steps),
            str(entry.used),
            str(sum(b - a for a, b in entry.duplicates)),
            str(sum(b - a for a, b in entry.missing)),
            "[green]ok[/]" if entry.ok else "[red]FAIL[/]",
        )
    console.print(table)
    for problem in report.problems:
        console.print(f"[red]{problem}[/]")
    console.print("[green]audit passed[/]" if report.ok else "[red]audit failed[/]")
