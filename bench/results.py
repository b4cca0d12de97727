"""What a benchmark returns, and how BENCHMARKS.md is written from them.

Every benchmark returns a `Section`: a table of medians (each beside its peer
measured in the same run, and the issue's target), the command that produced
it, notes that read the numbers, and the raw medians for anyone who wants to
recompute a ratio.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Section:
    key: str
    title: str
    command: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    machine: str = ""
    """The machine it ran on ("": a section stored before machines were recorded)."""

    def markdown(self) -> str:
        where = f", {self.machine}" if self.machine else ""
        lines = [f"## {self.title}", "", f"`{self.command}` ({self.date}{where})", ""]
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "---|" * len(self.header))
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += self.notes
        lines += ["", "<details><summary>raw medians</summary>", "", "```json"]
        lines.append(json.dumps(self.raw, indent=1, sort_keys=True, default=str))
        lines += ["```", "", "</details>", ""]
        return "\n".join(lines)


def median_seconds(fn: Callable[[], Any], runs: int, number: int = 1) -> float:
    """The median over `runs` of one call's seconds (each run timing `number` calls)."""
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        took.append((time.perf_counter() - start) / number)
    return statistics.median(took)


def verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "**missed**"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "unknown"


def environment() -> dict[str, str]:
    try:
        redis_server = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.split()[2]
    except (OSError, IndexError):
        redis_server = "not found"
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores ({_cpu()}), {_memory_gib()}",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis-server": redis_server.removeprefix("v="),
        "redis-py": _version("redis"),
        "hiredis": _version("hiredis"),
        "pydantic": _version("pydantic"),
        "msgpack": _version("msgpack"),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "torchft": _version("torchft"),
    }


def load(path: Path) -> dict[str, Section]:
    """The sections stored at `path` (JSON), by key, in their stored order ({}: no file)."""
    if not path.exists():
        return {}
    return {body["key"]: Section(**body) for body in json.loads(path.read_text())}


def merge(path: Path, sections: list[Section]) -> list[Section]:
    """The sections stored at `path` (JSON) with `sections` replacing those of the same key,
    in the suite's order; stores the result."""
    stored = load(path)
    for section in sections:
        stored[section.key] = section
    path.write_text(json.dumps([asdict(s) for s in stored.values()], indent=1, default=str))
    return list(stored.values())


def publish(out: Path, sections: list[Section], command: str, order: Sequence[str]) -> None:
    """Store `sections` beside the page `out` (`--only` runs replace their own sections
    only), and write the page from every stored section, in `order` (the suite's)."""
    env = environment()
    for section in sections:
        section.machine = section.machine or env["machine"]
    every = merge(out.with_suffix(".json"), sections)
    every.sort(key=lambda s: order.index(s.key) if s.key in order else len(order))
    out.write_text(document(every, env, command))


def rewrite(out: Path, order: Sequence[str]) -> None:
    """Write the page `out` again from its JSON, running nothing: the machine table and the
    command of its last run stay as the page has them."""
    out.write_text(again(out.read_text(), list(load(out.with_suffix(".json")).values()), order))


def again(page: str, sections: list[Section], order: Sequence[str]) -> str:
    """The page `page` as `document` writes it from `sections`, in `order`, with the machine
    table and the command of its last run read from `page`."""
    ran = re.search(r"^Last written by `(.+?)` on ", page, re.MULTILINE)
    if ran is None:
        raise ValueError("the page says no 'Last written by `COMMAND` on DATE'")
    table = page.split("| | |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    env: dict[str, str] = {}
    for line in table.splitlines():
        name, value = line.strip("| ").split(" | ", 1)
        env[name] = value
    ordered = sorted(sections, key=lambda s: order.index(s.key) if s.key in order else len(order))
    return document(ordered, env, ran.group(1))


def document(sections: list[Section], env: dict[str, str], command: str) -> str:
    from bench.headline import table  # it reads Sections: imported here, not in a cycle

    head = [
        "# Benchmarks",
        "",
        "How cohort compares, in one table: each headline figure beside its peer measured in",
        "the same run, cohort's figure over the peer's, the target and the section below it",
        "comes from (made from BENCHMARKS.json by bench/headline.py).",
        "",
        *table(sections, strict=False),
        "",
        f"Last written by `{command}` on {env['date']}; each section names the command that",
        "produced it and its date. Every figure is a median of several runs;",
        "where a peer exists it was measured in the same run, on the same machine and data,",
        "and the ratio is what to compare across machines. Targets are issue 7's. The table",
        "is the last run's machine and versions; a section names the machine it ran on (those",
        "that name none ran before machines were recorded per section).",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in env.items()),
        "",
    ]
    return "\n".join(head + [s.markdown() for s in sections])
