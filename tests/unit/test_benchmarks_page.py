"""BENCHMARKS.md opens with the headline table that bench/headline.py makes from
BENCHMARKS.json, and the whole page is what bench/results.py writes from that JSON: no
figure on it is typed in by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import FULL
from bench.headline import HEADLINES, Headline, HeadlineError, anchor, table
from bench.results import Section, again, load

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"


def test_the_page_is_what_the_code_writes_from_the_json() -> None:
    page = PAGE.read_text()
    assert page == again(page, list(load(PAGE.with_suffix(".json")).values()), list(FULL)), (
        "BENCHMARKS.md differs from BENCHMARKS.json: write it again with `python -m bench --page`"
    )


def test_the_page_opens_with_every_headline_within_a_screen() -> None:
    sections = list(load(PAGE.with_suffix(".json")).values())
    rows = table(sections)
    assert len(rows) == 2 + len(HEADLINES)  # every headline found its section, row and columns
    lines = PAGE.read_text().splitlines()
    start = lines.index(rows[0])
    assert start < 8 and lines[start : start + len(rows)] == rows
    assert start + len(rows) <= 40  # one screen
    titles = {section.title for section in sections}
    for row in rows[2:]:
        link = row.rsplit("](", 1)[1].rstrip(" |)")
        assert link in {anchor(title) for title in titles}, row


def test_a_headline_takes_cohorts_figure_its_peer_the_ratio_and_the_target() -> None:
    section = Section(
        key="k",
        title="Kill: to training (again)",
        command="c",
        header=["what", "median s", "x cohort", "target (cohort)", ""],
        rows=[["cohort", "2.0", "1.0", "<= 3", "met"], ["torchrun", "8.0", "4.0", "", ""]],
    )
    headline = Headline(
        "kill to training", "k", ("cohort",), "median s", "median s", "torchrun",
        ("torchrun",), "x cohort", ("torchrun",), inverted=True,
    )  # fmt: skip
    (row,) = table([section], [headline])[2:]
    cells = "| kill to training | 2.0 | torchrun: 8.0 | 0.25 | <= 3 | met |"
    assert row == cells + " [k](#kill-to-training-again) |"


def test_a_headline_whose_row_is_gone_says_so() -> None:
    section = Section(key="k", title="K", command="c", header=["what", "v"], rows=[["a", "1"]])
    with pytest.raises(HeadlineError, match="no row \\('b',\\) in 'k'"):
        table([section], [Headline("b", "k", ("b",), "v")])
    assert table([section], [Headline("b", "other", ("b",), "v")])[2:] == []  # not run: left out
    assert table([section], [Headline("b", "k", ("b",), "v")], strict=False)[2:] == []  # quick
