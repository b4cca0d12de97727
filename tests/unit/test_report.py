"""The HTML report: what it plots from a run, and that nothing in a run can break the page."""

from __future__ import annotations

import html
import io
import re
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.cli import main
from cohort.coordinator.fold import fold
from cohort.coordinator.replay import Run, export
from cohort.coordinator.series import MAX_POINTS, TIMELINE_ROWS, ReportData, Series, series
from cohort.events.codec import FIELD, encode
from cohort.events.models import (
    CommandsRefused,
    DataPosition,
    Event,
    GpuAdviceCleared,
    GpuAdviceIssued,
    GpuDevice,
    GpuReading,
    Heartbeat,
    InboxRepaired,
    JobConfig,
    JobConfigured,
    LeaderElected,
    Refusal,
    Rewound,
    StepCommitted,
    StepDone,
    TrainingPaused,
    TrainingResumed,
    WorkerFailed,
    WorkerJoined,
    WorkerLeft,
    WorldChanged,
)
from cohort.events.shards import Shard
from cohort.events.streams import Entry, Journal
from cohort.render.page import render

JOB = "rep"
T0 = 1_732_350_000.0
WORKERS = ("w1", "w2", "w3")
HOSTILE = '<script>alert("x")</script><img src=http://evil.example/x onerror=alert(1)>'
PLOTS = (
    "plot-membership",
    "plot-step-time",
    "plot-loss",
    "plot-gpu-memory",
    "plot-gpu-temperature",
    "plot-events",
)


class Streams:
    """Entries with the IDs Redis would give: server ms, and a sequence within one ms."""

    def __init__(self) -> None:
        self.run = Run(JOB)
        self._last: dict[str, tuple[int, int]] = {}

    def _entry(self, stream: str, at: float, raw: bytes) -> Entry:
        ms = int(at * 1000)
        last_ms, last_seq = self._last.get(stream, (0, -1))
        seq = last_seq + 1 if ms <= last_ms else 0
        ms = max(ms, last_ms)
        self._last[stream] = (ms, seq)
        return Entry(f"{ms}-{seq}", {FIELD: raw})

    def fact(self, fact: Event) -> None:
        self.run.journal.append(self._entry("journal", fact.at, encode(fact)))

    def command(self, command: Event) -> None:
        self.run.inbox.append(self._entry("inbox", command.at, encode(command)))

    def garbage(self, at: float) -> None:
        self.run.inbox.append(self._entry("inbox", at, b"\xc1 not msgpack"))


def _world(version: int, at: float, ranks: tuple[str, ...], reason: str) -> WorldChanged:
    shards = tuple(Shard(ranges=((i * 100, (i + 1) * 100),)) for i in range(len(ranks)))
    return WorldChanged(
        at=at, job=JOB, version=version, start_step=0, epoch=0, ranks=ranks, shards=shards,
        reason=reason,
    )  # fmt: skip


def _reading(worker: str, at: float, used: int, temperature: float) -> GpuReading:
    devices = tuple(
        GpuDevice(
            index=i,
            name=HOSTILE[:128],
            memory_total=16_000,
            memory_used=used + 1000 * i,
            temperature=temperature + i,
        )
        for i in range(2)
    )
    return GpuReading(at=at, job=JOB, worker=worker, devices=devices)


def a_run() -> Run:
    """Three workers train; w3 dies at +20 s, the leader changes at +25 s, w2 leaves."""
    s = Streams()
    s.fact(JobConfigured(at=T0, job=JOB, config=JobConfig(min_workers=2)))
    s.fact(LeaderElected(at=T0, job=JOB, coordinator="c1", epoch=1))
    for i, w in enumerate(WORKERS):
        s.fact(WorkerJoined(at=T0 + 1 + i, job=JOB, worker=w, host="h", pid=100 + i))
    s.fact(_world(1, T0 + 5, WORKERS, "3 workers ready"))
    s.fact(TrainingResumed(at=T0 + 5, job=JOB, active=3))
    for step in range(20):
        at = T0 + 5 + step
        alive = WORKERS if at < T0 + 20 else WORKERS[:2]
        for n, w in enumerate(alive):
            s.command(
                StepDone(
                    at=at, job=JOB, worker=w, step=step, world=1, step_time=0.1 * (n + 1),
                    samples=32, loss=2.0 / (step + 1) + n * 0.1,
                )
            )  # fmt: skip
            if step % 2 == 0:
                s.command(_reading(w, at, used=4000 + 100 * step, temperature=50 + step))
            s.command(Heartbeat(at=at, job=JOB, worker=w, step=step, world=1))
        if step == 3:
            s.garbage(at)
        if at < T0 + 20 or step >= 16:
            s.fact(StepCommitted(at=at + 0.5, job=JOB, step=step, world=1))
        if step == 15:
            s.fact(WorkerFailed(at=T0 + 20, job=JOB, worker="w3", last_seen=T0 + 15, timeout=5))
            s.fact(_world(2, T0 + 20, WORKERS[:2], "w3 failed"))
        if step == 12:
            s.fact(
                GpuAdviceIssued(
                    at=at, job=JOB, worker="w1", device=0, rule="mem-high",
                    action="reduce_prefetch", factor=0.5, metric="memory_pct", value=93.0,
                    threshold=90.0,
                )
            )  # fmt: skip
            s.fact(
                GpuAdviceCleared(
                    at=at + 2, job=JOB, worker="w1", device=0, rule="mem-high",
                    metric="memory_pct", value=60.0,
                )
            )  # fmt: skip
    s.fact(LeaderElected(at=T0 + 25, job=JOB, coordinator=HOSTILE[:128], epoch=2))
    s.fact(TrainingPaused(at=T0 + 26, job=JOB, reason=HOSTILE, active=1, min_workers=2))
    s.fact(WorkerLeft(at=T0 + 26, job=JOB, worker="w2", reason=HOSTILE))
    s.run.dead.append(Entry(f"{int((T0 + 9) * 1000)}-0", {b"inbox_id": b"1-0", b"raw": b"?"}))
    return s.run


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    plot: str | None


class Page(HTMLParser):
    """Every element of the page, each with the id of the plot (svg) it sits in."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[Element] = []
        self._plot: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self._plot = values.get("id")
        self.elements.append(Element(tag, values, self._plot))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._plot = None

    def within(self, plot: str, tag: str, cls: str | None = None) -> list[Element]:
        return [
            e
            for e in self.elements
            if e.plot == plot and e.tag == tag and (cls is None or cls in e.attrs["class"].split())
        ]


def parse(page: str) -> Page:
    parsed = Page()
    parsed.feed(page)
    parsed.close()
    return parsed


def lines_by_worker(page: Page, plot: str) -> Counter[str]:
    return Counter(e.attrs["data-worker"] for e in page.within(plot, "polyline", "series"))


# ---------------------------------------------------------------- what is extracted


def test_series_follow_membership_steps_losses_and_gpu_readings_of_each_worker() -> None:
    data = series(a_run())

    assert [s.label for s in data.membership] == ["active ranks", "members"]
    active = data.membership[0].points
    assert [v for _, v in active][0] == 3 and active[-1][1] == 2
    assert data.membership[1].points[-1] == (T0 + 26, 1.0)  # w3 failed, w2 left
    assert [s.worker for s in data.step_time] == list(WORKERS)
    assert len(data.step_time[0].points) == 20 and len(data.step_time[2].points) == 15
    assert {v for _, v in data.step_time[1].points} == {0.2}
    assert data.loss[0].points[0] == (T0 + 5, 2.0)
    assert [s.label for s in data.gpu_memory] == [f"{w} gpu{i}" for w in WORKERS for i in (0, 1)]
    assert data.gpu_memory[0].points[0] == (T0 + 5, 25.0)  # 4000 of 16000 used
    assert data.gpu_temperature[1].points[0] == (T0 + 5, 51.0)
    kinds = Counter(m.kind for m in data.markers)
    assert kinds["failure"] == 1 and kinds["leader"] == 2 and kinds["world"] == 2
    assert kinds["pause"] == 1 and kinds["resume"] == 1
    assert kinds["advice"] == 1 and kinds["advice-cleared"] == 1
    assert (data.start, data.end) == (T0, T0 + 26)


def test_summary_counts_steps_members_elections_dead_letters_and_unreadable_commands() -> None:
    summary = series(a_run()).summary
    assert summary.steps_committed == 19
    assert (summary.joined, summary.failed, summary.left) == (3, 1, 1)
    assert summary.elections == 2 and summary.world_changes == 2
    assert summary.dead_letters == 1 and summary.inbox_skipped == 1
    assert summary.final_world_size == 2


def test_long_series_are_thinned() -> None:
    s = Streams()
    for i in range(3 * MAX_POINTS):
        s.command(StepDone(at=T0 + i / 10, job=JOB, worker="w1", step=i, world=1, step_time=1))
    data = series(s.run)

    assert len(data.step_time[0].points) <= MAX_POINTS + 1
    assert data.step_time[0].points[-1][0] == s.run.inbox[-1].ms / 1000


def test_the_timeline_folds_runs_of_commits_and_keeps_every_membership_fact() -> None:
    """Commits flooded the timeline and pushed an early WorkerFailed out of its last rows."""
    s = Streams()
    s.fact(WorkerJoined(at=T0, job=JOB, worker="w1"))
    s.fact(WorkerFailed(at=T0 + 1, job=JOB, worker="w1", last_seen=T0, timeout=5))
    rounds = TIMELINE_ROWS + 100
    for i in range(rounds):  # a run of three commits, then a pause: two lines a round
        for step in range(3 * i, 3 * i + 3):
            s.fact(StepCommitted(at=T0 + 2 + step, job=JOB, step=step, world=1))
        s.fact(TrainingPaused(at=T0 + 2 + 3 * i, job=JOB, reason="r", active=1, min_workers=2))
    data = series(s.run)

    assert data.timeline_total == 2 + 2 * rounds
    assert [line.type for line in data.timeline[:2]] == ["WorkerJoined", "WorkerFailed"]
    assert len(data.timeline) == 2 + TIMELINE_ROWS
    last_run = data.timeline[-2]
    first_step = 3 * (rounds - 1)
    assert last_run.text == f"steps {first_step}–{first_step + 2} committed (3 commits, world 1)"
    assert data.summary.facts == 2 + 4 * rounds
    page = render(data, "t")
    assert "w1 failed" in page or "worker=w1" in page
    assert f"Showing the last lines of {data.timeline_total}" in page


# ---------------------------------------------------------------- what is drawn


def test_every_plot_draws_one_line_per_worker_on_the_same_time_axis() -> None:
    page = parse(render(series(a_run()), "run"))

    svgs = {e.attrs["id"]: e.attrs for e in page.elements if e.tag == "svg"}
    assert set(svgs) == set(PLOTS)
    axes = {(a["data-t0"], a["data-t1"], a["width"]) for a in svgs.values()}
    assert len(axes) == 1, axes
    assert lines_by_worker(page, "plot-membership") == {"active ranks": 1, "members": 1}
    for plot in ("plot-step-time", "plot-loss"):
        assert lines_by_worker(page, plot) == dict.fromkeys(WORKERS, 1), plot
    for plot in ("plot-gpu-memory", "plot-gpu-temperature"):
        assert lines_by_worker(page, plot) == dict.fromkeys(WORKERS, 2), plot
    colors = {
        e.attrs["data-worker"]: e.attrs["stroke"]
        for e in page.within("plot-step-time", "polyline", "series")
    }
    assert len(set(colors.values())) == 3
    for e in page.within("plot-loss", "polyline", "series"):
        assert e.attrs["stroke"] == colors[e.attrs["data-worker"]]
        assert len(e.attrs["points"].split()) >= 15


def test_failure_and_leader_change_are_marked_on_the_event_lanes_and_every_plot() -> None:
    page = parse(render(series(a_run()), "run"))

    assert len(page.within("plot-events", "line", "marker-failure")) == 1
    assert len(page.within("plot-events", "line", "marker-leader")) == 2
    assert len(page.within("plot-events", "line", "marker-world")) == 2
    assert len(page.within("plot-events", "line", "marker-advice")) == 1
    for plot in PLOTS[:-1]:
        failures = page.within(plot, "line", "marker-failure")
        assert len(failures) == 1, plot
    xs = {e.attrs["x1"] for p in PLOTS for e in page.within(p, "line", "marker-failure")}
    assert len(xs) == 1  # the same instant at the same x everywhere


def test_untrusted_text_is_escaped_and_the_page_loads_nothing_from_elsewhere() -> None:
    text = render(series(a_run()), HOSTILE)
    page = parse(text)

    tags = Counter(e.tag for e in page.elements)
    assert tags["script"] == 1 and tags["img"] == 0
    assert all(e.attrs.get("src") is None for e in page.elements)
    assert not [e for e in page.elements if "href" in e.attrs or e.tag in ("link", "iframe")]
    assert not [e for e in page.elements if any(k.startswith("on") for k in e.attrs)]
    assert "&lt;script&gt;alert(&quot;x&quot;)" in text
    for hostile in (HOSTILE, HOSTILE[:128]):
        text = text.replace(html.escape(hostile), "")
    assert "http" not in text  # only ever inside the escaped hostile texts


def test_worker_names_from_any_source_are_escaped_in_lines_and_legends() -> None:
    name = '"><script>alert(1)</script>'
    data = ReportData(
        job=JOB, start=T0, end=T0 + 1, step_time=(Series(name, name, ((T0, 1.0), (T0 + 1, 2.0))),)
    )
    text = render(data, "t")
    page = parse(text)

    assert Counter(e.tag for e in page.elements)["script"] == 1
    assert [e.attrs["data-worker"] for e in page.within("plot-step-time", "polyline")] == [name]
    assert [e.attrs["data-worker"] for e in page.elements if e.tag == "li"] == [name]


def test_an_empty_run_renders_every_plot_with_no_data_and_says_it_had_no_gpu() -> None:
    text = render(series(Run(JOB)), "empty")
    page = parse(text)

    gpu = {"plot-gpu-memory", "plot-gpu-temperature"}
    assert {e.attrs["id"] for e in page.elements if e.tag == "svg"} == set(PLOTS) - gpu
    assert not [e for e in page.elements if e.tag == "polyline"]
    assert text.count(">no data<") == 3 and ">no events<" in text
    assert 'id="no-gpu"' in text and "No GPU readings in this run" in text


def test_a_run_with_gpu_readings_has_its_gpu_plots_and_no_such_note() -> None:
    text = render(series(a_run()), "run")
    assert 'id="plot-gpu-memory"' in text and 'id="no-gpu"' not in text


def test_a_single_sample_or_a_flat_series_still_draws() -> None:
    data = ReportData(
        job=JOB,
        start=T0,
        end=T0,
        loss=(Series("w1", "w1", ((T0, 0.0),)), Series("w2", "w2", ((T0, 0.0),))),
    )
    page = parse(render(data, "t"))
    assert len(page.within("plot-loss", "polyline")) == 2
    assert len(page.within("plot-loss", "circle")) == 2


@settings(max_examples=60, deadline=None)
@given(
    coordinator=st.text(max_size=128),
    reason=st.text(max_size=200),
    device=st.text(max_size=128),
)
def test_no_text_in_a_run_can_add_elements_to_the_page(
    coordinator: str, reason: str, device: str
) -> None:
    s = Streams()
    s.fact(LeaderElected(at=T0, job=JOB, coordinator=coordinator, epoch=1))
    s.fact(TrainingPaused(at=T0 + 1, job=JOB, reason=reason, active=0, min_workers=1))
    s.command(
        GpuReading(
            at=T0 + 2,
            job=JOB,
            worker="w1",
            devices=(GpuDevice(index=0, name=device, memory_total=2, memory_used=1),),
        )
    )
    baseline = Counter(e.tag for e in parse(render(series(_plain(s.run)), "t")).elements)
    assert Counter(e.tag for e in parse(render(series(s.run), "t")).elements) == baseline


def _plain(run: Run) -> Run:
    """The same run with every text replaced by a harmless one."""
    s = Streams()
    s.fact(LeaderElected(at=T0, job=JOB, coordinator="c", epoch=1))
    s.fact(TrainingPaused(at=T0 + 1, job=JOB, reason="r", active=0, min_workers=1))
    s.command(
        GpuReading(
            at=T0 + 2,
            job=JOB,
            worker="w1",
            devices=(GpuDevice(index=0, name="d", memory_total=2, memory_used=1),),
        )
    )
    return s.run


# ---------------------------------------------------------------- the command


def test_report_command_writes_the_page_from_an_export_file(tmp_path: Path) -> None:
    exported = io.BytesIO()
    export(a_run(), exported, T0 + 30)
    source = tmp_path / "run.cohort"
    source.write_bytes(exported.getvalue())
    out = tmp_path / "report.html"

    result = CliRunner().invoke(main, ["report", "--file", str(source), "-o", str(out)])

    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out)
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "cohort report: rep" in text
    assert not (tmp_path / "report.html.part").exists()


def test_report_command_needs_exactly_one_source(tmp_path: Path) -> None:
    runner = CliRunner()
    for args in ([], ["--job", "a", "--file", str(tmp_path / "f")]):
        result: Any = runner.invoke(main, ["report", *args, "-o", str(tmp_path / "r.html")])
        assert result.exit_code == 2
        assert "exactly one source: --job J" in result.output
    missing = runner.invoke(main, ["report", "--file", str(tmp_path / "nope"), "-o", "r.html"])
    assert missing.exit_code == 4 and "cannot open export file" in missing.output


def test_what_scripts_record_is_plotted_per_name_with_a_line_per_worker() -> None:
    s = Streams()
    for step in range(6):
        for n, worker in enumerate(("w1", "w2")):
            figures = {"accuracy": 0.5 + step / 20, "lr": 0.1 / (step + 1)}
            if step == 5:
                figures["val/acc"] = 0.8 + n / 100  # a name first said late, by both
            s.command(
                StepDone(
                    at=T0 + step, job=JOB, worker=worker, step=step, world=1, step_time=0.1,
                    loss=1.0, metrics=figures,
                )
            )  # fmt: skip
    data = series(s.run)

    assert [name for name, _ in data.figures] == ["accuracy", "lr", "val/acc"]
    accuracy = dict(data.figures)["accuracy"]
    assert [line.worker for line in accuracy] == ["w1", "w2"]
    assert accuracy[0].points[-1] == (s.run.inbox[-2].ms / 1000, 0.75)
    html = render(data, "run")
    assert all(f"{name} per worker" in html for name in ("accuracy", "lr", "val/acc"))
    page = parse(html)
    for index in range(3):
        assert lines_by_worker(page, f"plot-figure-{index}") == {"w1": 1, "w2": 1}


def labels(page: str, plot: str) -> list[str]:
    """The marker labels written on `plot`."""
    inside = page.split(f'<svg id="{plot}"', 1)[1].split("</svg>", 1)[0]
    return re.findall(r'<text class="marker-label"[^>]*>([^<]*)</text>', inside)


def test_a_stall_and_a_rewind_break_the_lines_and_the_rewind_is_named_on_the_loss_plot() -> None:
    s = Streams()
    at = T0
    for step in range(30):
        at += 0.1 if step != 10 else 8.0  # step 10 comes after an 8 s stall (a failover)
        s.command(StepDone(at=at, job=JOB, worker="w1", step=step, world=1, loss=1 / (step + 1)))
        if step == 20:
            position = DataPosition(epoch=0, rest=Shard(ranges=((0, 8),)))
            s.fact(
                Rewound(
                    at=at + 0.05, job=JOB, from_step=20, to_step=15, source="checkpoint",
                    uri="file:///c/step-000000000015.ckpt", position=position,
                )
            )  # fmt: skip
    page = render(series(s.run), "run")
    parsed = parse(page)

    assert lines_by_worker(parsed, "plot-step-time") == {"w1": 3}  # the stall, the rewind
    assert lines_by_worker(parsed, "plot-loss") == {"w1": 3}
    assert labels(page, "plot-loss") == ["rewound from step 20 to 15 (checkpoint)"]


def test_failures_at_one_instant_are_all_named_on_the_failures_lane() -> None:
    s = Streams()
    s.command(StepDone(at=T0, job=JOB, worker="w1", step=0, world=1))
    for worker in WORKERS:
        s.fact(WorkerFailed(at=T0 + 5, job=JOB, worker=worker, last_seen=T0, timeout=5))
    s.command(StepDone(at=T0 + 60, job=JOB, worker="w1", step=1, world=1))
    named = labels(render(series(s.run), "run"), "plot-events")

    assert len(named) == 1 and all(worker in named[0] for worker in WORKERS), named


def test_what_the_leaders_refused_is_listed_by_sender_with_the_inbox_repairs() -> None:
    s = Streams()
    s.fact(JobConfigured(at=T0, job=JOB, config=JobConfig(min_workers=2)))
    for at, count in ((T0 + 5, 30), (T0 + 10, 12)):
        s.fact(
            CommandsRefused(
                at=at, job=JOB, first="1-0", last="2-0",
                refusals=(
                    Refusal(sender="b", kind="forged", count=count, bytes=100 * count),
                    Refusal(sender="m", verified=True, kind="forged", count=1, bytes=90),
                ),
            )
        )  # fmt: skip
    s.fact(InboxRepaired(at=T0 + 6, job=JOB, trouble="ahead", entry="9-0", ahead_s=3600.0))
    s.fact(InboxRepaired(at=T0 + 11, job=JOB, trouble="ahead", entry="19-0", more=3))

    data = series(s.run)
    page = render(data, "t")

    assert data.refused == (("b", False, "forged", 42, 4200), ("m", True, "forged", 2, 180))
    assert data.summary.inbox_repairs == 5  # the second counts 3 more it was held back for
    assert fold(Journal.decode_page(s.run.journal)).counters.inbox_repairs == 5
    table = page[page.index('<table id="refused">') :]
    assert "<td>b</td><td>claimed</td><td>forged</td>" in table
    assert "<td>m</td><td>its signature</td>" in table
