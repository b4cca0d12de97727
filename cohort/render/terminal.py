"""Terminal output of the cohort command (rich)."""

from __future__ import annotations

import sys
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from cohort.events import deal
from cohort.events.models import JobConfig

# Piped output is read by people later and by scripts: do not cut words to 80 columns.
console = Console() if sys.stdout.isatty() else Console(width=160)


def _shard(ranges: list[list[int]]) -> str:
    if not ranges:
        return "-"
    size = sum(b - a for a, b in ranges)
    first = f"[{ranges[0][0]},{ranges[0][1]})"
    more = f" +{len(ranges) - 1} ranges" if len(ranges) > 1 else ""
    return f"{size} samples {first}{more}"


_PHASES = {
    "running": "[green]running[/]",
    "paused": "[yellow]paused[/]",
    "finished": "[blue]finished[/]",
    "ended": "[blue]ended[/]",
}


def _summary_lines(body: dict[str, Any]) -> list[str]:
    if body.get("launcher") and not body["started"]:
        return _launcher_lines(body)
    counters = body["counters"]
    return [
        f"[bold]job[/] {body['job'] or '?'}  [bold]leader[/] {_leader(body)} "
        f"(epoch {body['leader_epoch']})  [bold]world[/] v{body['world_version']} "
        f"size {body['world_size']}  [bold]data epoch[/] {body['epoch']}{_order(body)}  "
        f"[bold]next step[/] {body['next_step']}  "
        f"{_PHASES[body['phase']]}" + (f" ({body['finished']})" if body["finished"] else ""),
        f"joined {counters['joined']}  left {counters['left']}  failed {_failed(counters)}  "
        f"refused {counters['refused']}  steps {counters['steps_committed']}  "
        f"epochs {counters['epochs_finished']}  elections {counters['elections']}  "
        f"facts {body['facts']}  state hash {body['state_hash']}",
        *_progress_lines(body),
        *_spare_lines(body),
        *_journal_lines(body),
        *_lineage_lines(body),
        *_waiting_lines(body),
    ]


def _failed(counters: dict[str, int]) -> str:
    """How many members failed, and by which sign when any was not silence."""
    failed, disconnected, exited = (
        counters.get(k, 0) for k in ("failed", "disconnected", "exited")
    )
    if not (disconnected or exited):
        return str(failed)
    causes = (
        ("silent", failed - disconnected - exited),
        ("disconnected", disconnected),
        ("exited", exited),
    )
    return f"{failed} ({', '.join(f'{n} {cause}' for cause, n in causes if n)})"


def _spare_lines(body: dict[str, Any]) -> list[str]:
    """The warm spares waiting (ready, syncing) and how many were promoted (none: nothing)."""
    spares, promoted = body.get("spares") or {}, body["counters"].get("promotions", 0)
    ready, syncing = spares.get("ready") or [], spares.get("syncing") or []
    if not (ready or syncing or promoted):
        return []
    waiting = "  ".join(
        f"{how} {', '.join(names)}" for how, names in (("ready", ready), ("syncing", syncing))
        if names
    )  # fmt: skip
    return [f"[bold]spares[/] {waiting or 'none waiting'}  promoted {promoted}"]


def _launcher_lines(body: dict[str, Any]) -> list[str]:
    """A torchrun job: its agents and rounds, in place of cohort's world and steps, which
    such a job has none of (its workers train with torch.distributed)."""
    launcher, counters = body["launcher"], body["counters"]
    agents = launcher["agents"]
    now = f"{len(agents)} agent(s) in the job" if agents else "no agent in the job now"
    latest = (
        f"round {launcher['round']} with {len(launcher['round_agents'])} agent(s) "
        f"({', '.join(launcher['round_agents'])})"
        if launcher["round"] is not None
        else "no round started yet"
    )
    return [
        f"[bold]job[/] {body['job'] or '?'} (torchrun)  [bold]leader[/] {_leader(body)} "
        f"(epoch {body['leader_epoch']})  {now}  {_PHASES[body['phase']]}",
        f"[bold]latest[/] {latest}",
        f"rounds {launcher['rounds']}  runs {launcher['runs']}  restarts "
        f"{launcher['restarts']} (each restarted every worker)  joined {counters['joined']}  "
        f"left {counters['left']}  failed {_failed(counters)}  facts {body['facts']}  "
        f"state hash {body['state_hash']}",
        "[dim]the workers train with torch.distributed: cohort journals the agents, not "
        "their steps or data[/]",
    ]


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _progress_lines(body: dict[str, Any]) -> list[str]:
    """Steps per second, how far the epoch is, and the time to the job's end."""
    ahead = body.get("progress")
    if body["phase"] == "finished":
        return [f"[bold]finished[/] at step {body['last_committed']} in data epoch {body['epoch']}"]
    if not ahead:
        return []  # a replayed state: no `now` to date it
    config = body.get("config") or {}
    rate, done = ahead["steps_per_second"], ahead["epoch_progress"]
    parts = [f"[bold]rate[/] {rate:.2f} steps/s" if rate is not None else "[bold]rate[/] -"]
    epochs = f"/{config['epochs']}" if config.get("epochs") else ""
    if done is not None:
        parts.append(f"[bold]epoch[/] {body['epoch']}{epochs} {done:.0%} done")
    left, eta = ahead["steps_left"], ahead["eta_seconds"]
    if left is None:
        parts.append(f"[bold]end[/] {_length(config)}")
    else:
        when = _duration(eta) if eta is not None else "unknown while paused or measuring"
        parts.append(f"[bold]steps left[/] {left}  [bold]ETA[/] {when}")
    return ["  ".join(parts)]


def _length(config: dict[str, Any]) -> str:
    """The job's configured length, where its steps are not known yet."""
    ends = []
    if config.get("max_steps"):
        ends.append(f"after step {config['max_steps'] - 1}")
    if config.get("epochs"):
        ends.append(f"after {config['epochs']} epochs (steps known once the data is)")
    return " or ".join(ends) or "no configured length"


def _waiting_lines(body: dict[str, Any]) -> list[str]:
    """What a paused job waits for (a job that lost its weights: `_lineage_lines`)."""
    if body["phase"] != "paused" or body["weights_lost"] is not None:
        return []
    if not body.get("config"):
        return ["[yellow]paused[/]: waits for a coordinator to configure the job"]
    saved, last = body["checkpoints"], body["last_committed"]
    if last >= 0 and not body.get("holders") and saved:
        step = saved[-1]["step"]
        return [
            f"[yellow]paused[/]: no member holds the weights of step {last}; when workers "
            f"join, the job rewinds to the checkpoint of step {step} and trains steps "
            f"{step + 1}..{last} again"
        ]
    trainers = sum(1 for m in body["members"].values() if m.get("role", "trainer") == "trainer")
    need = body["config"].get("min_workers", 1)
    return [f"[yellow]paused[/]: waits for {need} worker(s) to train; {trainers} member(s) now"]


def _leader(body: dict[str, Any]) -> str:
    """Who leads: the lease holder in a status body, the last elected in a replayed state."""
    if "leader_id" in body:
        return body["leader_id"] or f"none (last: {body['elected_id'] or '-'})"
    return body["leader"] or "-"


def _order(body: dict[str, Any]) -> str:
    """How the job orders each epoch's samples (nothing before it is configured)."""
    config = body.get("config")
    if not config:
        return ""
    return f" (shuffled, seed {config.get('seed', 0)})" if config.get("shuffle") else " (in order)"


def _lineage_lines(body: dict[str, Any]) -> list[str]:
    """Checkpoints and rewinds, and what to do when the weights are lost."""
    counters, saved = body["counters"], body["checkpoints"]
    lines = []
    if saved or counters["rewinds"]:
        latest = f" (latest: step {saved[-1]['step']})" if saved else ""
        lines.append(
            f"checkpoints {len(saved)}{latest}  rewinds {counters['rewinds']}  "
            f"steps discarded {counters['discarded_steps']}"
        )
    if body["weights_lost"] is not None:
        lines.append(
            f"[red]the weights of step {body['weights_lost']} are lost[/]: continue with "
            f"`cohort resume --job {body['job']} --from-scratch` or `--from-checkpoint URI`"
        )
    return lines


def state_summary(body: dict[str, Any]) -> None:
    for line in _summary_lines(body):
        console.print(line)


def node_text(node: dict[str, Any] | None) -> str:
    """A worker's node in a few words: host, zone (or region), GPUs, files held."""
    if not node:
        return "-"
    parts = [node.get("host") or "?"]
    where = node.get("zone") or node.get("region")
    if where:
        parts.append(where)
    if node.get("gpus"):
        memory = node.get("gpu_memory") or 0
        parts.append(f"{node['gpus']} GPU" + (f" {memory / 2**30:.0f} GiB" if memory else ""))
    files = sum(b - a for a, b in node.get("files") or ())
    if files:
        parts.append(f"{files} files")
    return " ".join(parts)


def _gpu(devices: list[dict[str, Any]]) -> str:
    parts = []
    for d in devices:
        mem = f"{d['memory_pct']:.0f}%" if d.get("memory_pct") is not None else "?"
        temp = f"{d['temperature']:.0f}C" if d.get("temperature") is not None else "?"
        parts.append(f"{d['index']}:{mem} {temp}")
    return " ".join(parts) or "-"


def _identity(live: dict[str, Any]) -> str:
    """Whether commands must be signed, and how many were refused for their signature."""
    forged = (live.get("counters") or {}).get("forged", 0)
    if not live.get("identity") and not forged:
        return ""
    mode = "signed commands only" if live.get("identity") else "unsigned commands allowed"
    return f"; identity: {mode}, {forged} forged command(s) dead-lettered"


def _journal_lines(body: dict[str, Any]) -> list[str]:
    """Where the journal's facts are: how many Redis holds, and what storage does."""
    journal = body.get("journal")
    if not journal or journal["in_redis"] is None:
        return []
    size = f" ({_bytes(journal['redis_bytes'])})" if journal["redis_bytes"] else ""
    if not journal["segments"]:
        return [
            f"[bold]journal[/] {journal['facts']:,} facts, all in Redis{size}: nothing "
            "archived (a coordinator with --archive-uri or a --checkpoint-uri keeps Redis flat)"
        ]
    held = f"{journal['in_redis']:,} in Redis{size}"
    return [
        f"[bold]journal[/] {journal['facts']:,} facts: {held}, {journal['archived_facts']:,} "
        f"archived in {journal['segments']} segments ({_bytes(journal['archived_bytes'])}) "
        f"at {journal['archive']}"
    ]


def _bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def status_view(body: dict[str, Any], recent: list[tuple[str, str]] | None = None) -> Group:
    """Leader, world, one row per worker and (with --watch) the latest facts."""
    rows: list[Any] = [Text.from_markup(line) for line in _summary_lines(body)]
    live = body.get("leader_view") or {}
    workers_live = live.get("workers", {})
    if live:
        rows.append(
            Text(
                f"leader view: {live.get('coordinator')} at journal {live.get('journal_id')}, "
                f"inbox lag {live.get('inbox_lag_ms', 0)} ms" + _identity(live)
            )
        )
    elif body["phase"] == "finished":
        rows.append(Text("no live leader view: the coordinators end with the job"))
    else:
        rows.append(
            Text.from_markup("[yellow]no live leader view (no coordinator leads right now?)[/]")
        )
    at = live.get("at")
    shards = body.get("shards", [])
    config = body.get("config") or {}
    done = max(0, body["next_step"] - body.get("base_step", 0))
    counts = deal.counts(JobConfig.model_validate(config), len(shards)) if config else ()
    strided = config.get("placement") == "strided"
    cells: list[tuple[str, ...]] = []
    for worker, member in body["members"].items():
        seen = workers_live.get(worker, {})
        last = seen.get("last_seen")
        rank = member.get("rank")
        shard = shards[rank] if rank is not None and rank < len(shards) else []
        size = sum(b - a for a, b in shard)
        # a strided rank holds the world's whole rest and uses its turn of each step
        used = done * (sum(counts) if strided else counts[rank]) if shard and counts else 0
        progress = seen.get("progress") or [-1, -1]
        step_time = seen.get("step_time")
        cells.append(
            (
                worker,
                member["status"],
                node_text(member.get("node")),
                "-" if rank is None else str(rank),
                _shard(shard),
                f"{min(used, size)}/{size}" if shard else "-",
                f"{at - last:.1f}s ago" if last and at else "-",
                str(progress[1]) if progress[1] >= 0 else "-",
                f"{step_time:.3f}s" if step_time is not None else "-",
                _gpu(seen.get("gpu") or []),
                _flags(worker, member, body, seen),
            )
        )
    rows.extend(_fitted(WORKER_COLUMNS, cells))
    rows.extend(Text(line) for line in _figure_lines(workers_live))
    rows.extend(Text(line) for line in _evaluation_lines(body))
    rows.extend(Text(line) for line in _workload_lines(body, workers_live))
    if recent:
        facts = Table("journal id", "fact", title="recent facts", title_justify="left")
        for entry_id, text in recent[-10:]:
            facts.add_row(entry_id, text)
        rows.append(facts)
    return Group(*rows)


def _flags(worker: str, member: dict[str, Any], body: dict[str, Any], seen: dict[str, Any]) -> str:
    """The chief (rank 0: every new world's weights come from it), evaluators, stragglers,
    and a member whose connections closed (failed unless they come back within the grace)."""
    flags = []
    if seen.get("connections") == "closed":
        flags.append("[red]connections closed[/]")
    if worker == body.get("chief"):
        flags.append("[bold]chief[/]")
    if member.get("role") == "evaluator":
        flags.append("evaluator")
    if member.get("spare"):
        flags.append("spare")
    if member.get("straggler"):
        flags.append("[red]straggler[/]")
    return " ".join(flags)


def _workload_lines(body: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """Each worker's registered GPU workloads and, as it last said, its transfer queue."""
    lines = []
    for worker, member in body["members"].items():
        parts = [
            f"{w['name']} (pid {w['pid']}, gpu {','.join(map(str, w['devices'])) or '-'}, "
            f"{w['memory'] / 2**30:.1f} GiB, priority {w['priority']})"
            for w in member.get("workloads") or ()
        ]
        queue = (live.get(worker) or {}).get("transfers")
        if queue:
            parts.append(
                f"transfers: {queue['pending']} pending, {queue['staged']} staged, "
                f"waited {queue['delayed']:.0f} s"
            )
        if parts:
            lines.append(f"{worker}: " + "; ".join(parts))
    return lines


def _figure_lines(live: dict[str, Any]) -> list[str]:
    """Each worker's latest figures of its own (`job.record`), loss first."""
    lines = []
    for worker, seen in sorted(live.items()):
        said = dict(seen.get("figures") or {})
        if seen.get("loss") is not None:
            said = {"loss": seen["loss"], **said}
        if said:
            figures = "  ".join(f"{name} {value:.4g}" for name, value in said.items())
            lines.append(f"{worker} recorded: {figures}")
    return lines


def _evaluation_lines(body: dict[str, Any]) -> list[str]:
    """Each evaluator's latest evaluation: the step it evaluated and its metrics."""
    latest: dict[str, dict[str, Any]] = {}
    for report in body.get("evals") or ():
        latest[report["worker"]] = report
    return [
        f"evaluation by {worker} of step {report['step']}: "
        + "  ".join(f"{name} {value:.4g}" for name, value in sorted(report["metrics"].items()))
        for worker, report in sorted(latest.items())
    ]


WORKER_COLUMNS = (
    "worker",
    "state",
    "node",
    "rank",
    "shard",
    "used",
    "heartbeat",
    "step",
    "step time",
    "GPU mem/temp",
    "flags",
)
KEPT = 2
"""Columns shown even when empty: the worker and its state."""
DROPPED_FIRST = (
    "used",
    "step",
    "step time",
    "heartbeat",
    "GPU mem/temp",
    "node",
    "shard",
    "rank",
)
"""What a narrow terminal leaves out first, until the table fits."""


def _fitted(headers: tuple[str, ...], cells: list[tuple[str, ...]]) -> list[Any]:
    """A table of `cells` that fits the console, and a line naming what it left out.

    A column no row fills ("-" or "" in every row, e.g. GPUs on a CPU-only job) is left
    out; then, while the table cannot fit even with its words wrapped, the columns of
    DROPPED_FIRST, in order. What still does not fit wraps rather than being cut."""
    shown = [
        i for i in range(len(headers)) if i < KEPT or any(row[i] not in ("-", "") for row in cells)
    ]
    left_out: list[str] = []
    while True:
        whole_words = _table(headers, cells, shown, "ellipsis")  # its minimum: the longest words
        wide = console.options.update_width(10_000)  # a measurement is capped at the width
        need = Measurement.get(console, wide, whole_words).minimum
        drop = [i for i in shown if headers[i] in DROPPED_FIRST]
        if need <= console.width or not drop:
            break
        worst = min(drop, key=lambda i: DROPPED_FIRST.index(headers[i]))
        shown.remove(worst)
        left_out.append(headers[worst])
    table = _table(headers, cells, shown, "fold")
    if not left_out:
        return [table]
    note = f"[dim]{console.width} columns: {', '.join(left_out)} not shown (widen to see)[/]"
    return [table, Text.from_markup(note)]


def _table(
    headers: tuple[str, ...], cells: list[tuple[str, ...]], shown: list[int], overflow: Any
) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for i in shown:
        table.add_column(headers[i], overflow=overflow, no_wrap=i == 0)
    for row in cells:
        table.add_row(*(row[i] for i in shown))
    return table


def status_table(body: dict[str, Any]) -> None:
    console.print(status_view(body))


def audit_table(report: Any) -> None:
    if report.launcher is not None:
        _launcher_audit(report.launcher)
    else:
        _epochs_table(report)
    for problem in report.problems:
        console.print(f"[red]{problem}[/]")
    _refusals_table(report)
    console.print("[green]audit passed[/]" if report.ok else "[red]audit failed[/]")


def _epochs_table(report: Any) -> None:
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


def _launcher_audit(launcher: Any) -> None:
    """A torchrun job's audit: what it covers, its rounds, how each agent of the last run
    ended."""
    console.print(f"[bold]torchrun job[/]: the audit covers {launcher.covers}")
    console.print(
        f"rounds {launcher.rounds}  runs {launcher.runs}  restarts {launcher.restarts}  "
        f"agents running {len(launcher.running)}"
    )
    if launcher.ended:
        table = Table("agent of the last run", "ended")
        for agent, how in sorted(launcher.ended.items()):
            table.add_row(agent, how)
        console.print(table)


def _refusals_table(report: Any) -> None:
    """What the leaders refused at the inbox, by sender, and each inbox repair: evidence of a
    hostile or broken sender (it changes no training, so not the verdict)."""
    if report.refused.total:
        table = Table("refused from", "proven by", "kind", "entries", "bytes")
        for sender, verified, kind, count, size in report.refused.rows():
            proof = "its signature" if verified else "claimed"
            table.add_row(sender, proof, kind, str(count), str(size))
        console.print(table)
        console.print(
            f"[yellow]{report.refused.total} inbox entries refused "
            f"({report.refused.forged} forged); the dead-letter stream keeps the latest[/]"
        )
    for fact in report.repairs:
        by = f" (first by {fact.sender})" if fact.sender else ""
        console.print(
            f"[yellow]inbox repaired: {fact.trouble}, {fact.reason} at {fact.entry}{by}[/]"
        )
