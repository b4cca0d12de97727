"""The headline figures that open BENCHMARKS.md: one row each, taken from the stored sections.

Each `Headline` names the section it comes from, the row of that section that holds
cohort's figure (by its leading cells), and the columns of the figure, of its peer (in the
same row, or in a row of its own), of the ratio and of the target. The ratio is always
cohort's figure over the peer's: where a section gives it the other way round (`x cohort`),
it is inverted here. Nothing is typed in by hand: the table is made from BENCHMARKS.json
each time the page is written (`python -m bench`, or `--page` to write it again without
running anything), and a headline whose row or column is gone says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.results import Section


class HeadlineError(LookupError):
    """A headline names a section, row or column the stored results do not have."""


@dataclass(frozen=True)
class Headline:
    what: str
    key: str
    """The section's key."""
    row: tuple[str, ...]
    """The leading cells of the row with cohort's figure (each cell starts with its text; ""
    matches any)."""
    figure: str
    """The column of cohort's figure."""
    peer: str = ""
    """The column of the peer's figure ("": none)."""
    peer_name: str = ""
    """What the peer is, where its cell does not say (a bare number)."""
    peer_row: tuple[str, ...] = ()
    """The peer's own row (empty: cohort's row)."""
    ratio: str = ""
    """The column of the ratio ("": none), in `ratio_row`, else in cohort's row."""
    ratio_row: tuple[str, ...] = ()
    inverted: bool = False
    """The section's ratio is peer over cohort: it is inverted here."""
    target_row: tuple[str, ...] = ()
    """The row whose target and verdict the headline shows (empty: cohort's row)."""


HEADLINES = (
    Headline(
        "coordinator ingest, commands decided and journaled /s", "ingest", ("100,000",),
        "median per second", "peer (same run)", ratio="ratio",
    ),
    Headline(
        "replay of 1,000,000 facts from zero, facts/s", "replay", ("from zero: XRANGE",),
        "median", "peer (same run)", ratio="ratio",
    ),
    Headline(
        "inbox lag p99 (p50), 1,000 workers at 1 Hz", "soak", ("inbox lag p99",), "measured"
    ),
    Headline(
        "per-step coordination, 64 workers, ms", "overhead", ("64",),
        "StepDone -> StepCommitted seen, ms", "peer: Redis round trips, ms",
        peer_name="Redis round trips", ratio="ratio",
    ),
    Headline(
        "leader SIGKILL to a new leader appending, s", "failover", ("lease 1 s",), "median s"
    ),
    Headline(
        "a worker SIGKILLed: survivors training again, s", "peer_death", ("cohort:",),
        "median s", "median s", "torchrun (restarts every worker)",
        ("torchrun: every worker restarted",), "x cohort", ("torchrun: every worker",),
        inverted=True,
    ),
    Headline(
        "goodput, a worker SIGKILLed every 60 s", "goodput", ("cohort (ElasticJob",),
        "goodput", "goodput", "torchrun c10d", ("torchrun c10d",), "goodput",
        ("cohort / torchrun",),
    ),
    Headline(
        "goodput under each side's launcher", "launched", ("cohort run",), "goodput",
        "goodput", "the better torchrun", ("torchrun --standalone, TORCH_DISABLE",),
        "goodput", ("cohort / the better",), target_row=("cohort / the better",),
    ),
    Headline(
        "a rank's SIGKILL to the next committed step (a spare), s", "healing",
        ("cohort run --spares 1 (defaults",), "kill to next committed step, s (median)",
        "kill to next committed step, s (median)", "torchrun", ("torchrun",),
        "x cohort with a spare", ("torchrun",), inverted=True,
    ),
    Headline(
        "allreduce through Redis, 4 ranks x 64 MiB float32, ms", "allreduce",
        ("4", "64", "float32"), "cohort ms", "gloo ms", "gloo", ratio="cohort/gloo",
    ),
    Headline(
        "training, 1M-parameter model, 4 ranks, gloo route, samples/s", "throughput",
        ("1m", "4", "", "torch.distributed"), "ElasticJob samples/s", "DDP samples/s", "DDP",
        ratio="ratio",
    ),
    Headline(
        "training, 25M-parameter model, 4 ranks, gloo route, samples/s", "throughput",
        ("25m", "4", "", "torch.distributed"), "ElasticJob samples/s", "DDP samples/s", "DDP",
        ratio="ratio",
    ),
    Headline(
        "training, 25M-parameter model, 4 ranks, Redis route, samples/s", "throughput",
        ("25m", "4", "", "Redis"), "ElasticJob samples/s", "DDP samples/s", "DDP", ratio="ratio",
    ),
    Headline(
        "a 201 MB checkpoint's cost to 10 CPU training steps, s", "checkpoint", ("torch, 25.1M",),
        "cohort", "peer (same run)", "torch.save", ratio="ratio",
    ),
    Headline(
        "a step with job.record(5 scalars), Redis route, ms", "figures", ("redis",),
        "with record(5 scalars), ms", "plain step, ms (peer)", "a plain step", ratio="ratio",
    ),
    Headline(
        "chaos (random faults while a model trains): commands lost", "chaos",
        ("commands lost",), "value",
    ),
    Headline(
        "a rank's SIGKILL to the survivors' next committed step vs TorchFT, s",
        "torchft-healing", ("cohort run --spares 1",),
        "kill to survivors' next committed step, s (median)",
        "kill to survivors' next committed step, s (median)", "TorchFT, lighthouse defaults",
        ("TorchFT, lighthouse defaults (heartbeat 5 s)",), "x cohort run with a spare",
        ("TorchFT, lighthouse defaults (heartbeat 5 s)",), inverted=True,
    ),
    Headline(
        "goodput, a rank SIGKILLed each period, vs TorchFT", "torchft-healing",
        ("cohort run --spares 1",), "goodput", "goodput", "TorchFT, lighthouse defaults",
        ("TorchFT, lighthouse defaults (heartbeat 5 s)",), "goodput", ("cohort / TorchFT",),
    ),
    Headline(
        "training, 1M-parameter model, 2 ranks, gloo route vs TorchFT, samples/s",
        "torchft-throughput", ("cohort ElasticJob",), "samples/s (median)",
        "samples/s (median)", "TorchFT", ("TorchFT",), "x cohort's gloo route", ("TorchFT",),
        inverted=True,
    ),
)  # fmt: skip
"""The page's headlines, in the order they are shown."""

COLUMNS = ("what", "cohort", "peer", "cohort / peer", "target", "", "section")


def table(
    sections: Sequence[Section], headlines: Sequence[Headline] = HEADLINES, strict: bool = True
) -> list[str]:
    """The headline table's Markdown lines, from `sections` (a headline whose section is not
    among them is left out: a page of part of the suite); HeadlineError names a headline
    whose row or column its section does not have. Not `strict`: such a headline is left out
    too (a quick run measures other rows than the page's; the page's own test holds every
    headline present)."""
    by_key = {section.key: section for section in sections}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for headline in headlines:
        if headline.key not in by_key:
            continue
        try:
            cells = _cells(headline, by_key[headline.key])
        except HeadlineError:
            if strict:
                raise
            continue
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def anchor(title: str) -> str:
    """The link GitHub gives a `## title` heading."""
    return "#" + re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _cells(headline: Headline, section: Section) -> list[str]:
    def cell(row: tuple[str, ...], column: str) -> str:
        return _row(headline, section, row or headline.row)[_column(headline, section, column)]

    peer = cell(headline.peer_row, headline.peer) if headline.peer else ""
    if peer and headline.peer_name:
        peer = f"{headline.peer_name}: {peer}"
    ratio = cell(headline.ratio_row, headline.ratio) if headline.ratio else ""
    if ratio and headline.inverted:
        ratio = f"{1 / float(ratio):.2f}"
    targets = [h for h in section.header if h.startswith("target")]  # "target (cohort)"
    target = cell(headline.target_row, targets[0]) if targets else ""
    verdict = cell(headline.target_row, "") if "" in section.header else ""  # met / missed
    link = f"[{section.key}]({anchor(section.title)})"
    return [headline.what, cell(headline.row, headline.figure), peer, ratio, target, verdict, link]


def _row(headline: Headline, section: Section, leading: tuple[str, ...]) -> list[str]:
    for row in section.rows:
        cells = row[: len(leading)]
        if len(cells) == len(leading) and all(
            c.startswith(t) for c, t in zip(cells, leading, strict=True)
        ):
            return row
    raise HeadlineError(f"headline {headline.what!r}: no row {leading} in {section.key!r}")


def _column(headline: Headline, section: Section, column: str) -> int:
    if column not in section.header:
        raise HeadlineError(f"headline {headline.what!r}: no column {column!r} in {section.key!r}")
    return section.header.index(column)
