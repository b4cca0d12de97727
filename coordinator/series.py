"""What happened in a run and when: the series and markers its report plots.

`series(run)` is pure: it reads the journal's facts and the retained inbox's commands and
returns frozen data. `cohort.render.page` draws it; this package never draws.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cohort.coordinator.refusals import Totals
from cohort.coordinator.replay import Run
from cohort.coordinator.timeline import Folder, Line, recent
from cohort.events.codec import decode_command
from cohort.events.errors import DecodeError
from cohort.events.models import (
    CheckpointSaved,
    CommandsRefused,
    EvalReported,
    Fact,
    GpuAdviceCleared,
    GpuAdviceIssued,
    GpuReading,
    InboxRepaired,
    JobFinished,
    LeaderElected,
    Rewound,
    SparePromoted,
    StepDone,
    StragglerDetected,
    TrainingPaused,
    TrainingResumed,
    TransfersWaiting,
    WeightsDiverged,
    WeightsLost,
    WorkerFailed,
    WorkerJoined,
    WorkerLeft,
    WorldChanged,
)
from cohort.events.streams import Entry

TIMELINE_ROWS = 500
MAX_POINTS = 2000  # per series; more only makes the page heavier, not the plot clearer

Point = tuple[float, float]


@dataclass(frozen=True)
class Series:
    """One line: `worker` picks its colour ("" for job-wide lines), `label` names it."""

    label: str
    worker: str
    points: tuple[Point, ...]
    dashed: bool = False
    tooltip: str = ""


@dataclass(frozen=True)
class Marker:
    """Something that happened at one instant, drawn as a vertical line on every plot."""

    at: float
    kind: str  # failure, leader, world, promotion, pause, resume, straggler, diverged, advice, …
    label: str
    entry_id: str


@dataclass(frozen=True)
class Summary:
    facts: int = 0
    steps_committed: int = 0
    epochs_finished: int = 0
    joined: int = 0
    failed: int = 0
    left: int = 0
    refused: int = 0
    promotions: int = 0
    """Spares promoted into a world in a lost rank's place (SparePromoted)."""
    elections: int = 0
    world_changes: int = 0
    divergences: int = 0
    checkpoints: int = 0
    rewinds: int = 0
    discarded_steps: int = 0
    dead_letters: int = 0
    inbox_repairs: int = 0
    inbox_entries: int = 0
    inbox_skipped: int = 0
    final_world_size: int = 0


@dataclass(frozen=True)
class ReportData:
    job: str
    start: float
    end: float
    membership: tuple[Series, ...] = ()
    step_time: tuple[Series, ...] = ()
    loss: tuple[Series, ...] = ()
    figures: tuple[tuple[str, tuple[Series, ...]], ...] = ()
    """The scripts' own figures (`job.record`: with the steps' reports in the retained inbox,
    and those recorded after a trainer's last step as journaled): (name, a line per worker),
    by name."""
    evaluation: tuple[Series, ...] = ()
    """Each evaluator's metrics (journaled, so never trimmed), one line per evaluator and
    metric, at the time the leader journaled them."""
    gpu_memory: tuple[Series, ...] = ()
    gpu_temperature: tuple[Series, ...] = ()
    transfers: tuple[Series, ...] = ()
    """Transfers each worker waited to start, as its TransfersWaiting said (retained inbox)."""
    markers: tuple[Marker, ...] = ()
    summary: Summary = field(default_factory=Summary)
    timeline: tuple[Line, ...] = ()
    """The last TIMELINE_ROWS lines, runs of commits folded, every membership fact kept."""
    timeline_total: int = 0
    """Lines in the whole timeline."""
    refused: tuple[tuple[str, bool, str, int, int], ...] = ()
    """What the leaders refused at the inbox (CommandsRefused): (sender, proven by its
    signature, kind, entries, bytes), most entries first."""


# ---------------------------------------------------------------- extraction


def series(run: Run) -> ReportData:
    """Everything the page plots, from `run`'s facts and its retained inbox commands.

    Facts are placed at their `at` (the leader's decision time, on the Redis server clock);
    commands at their inbox entry ID's milliseconds (the same server clock, unlike the
    producer's own `at`, which a skewed worker clock would shift). Undecodable inbox
    entries are skipped and counted; an unreadable journal entry raises ReplayError.
    The summary counts facts by type rather than folding them: a report must not depend
    on `evolve` knowing every fact (it reads journals of newer coordinators too).
    """
    facts = _FactSeries()
    for entry_id, fact in run.facts():
        facts.add(entry_id, fact)
    inbox = _InboxSeries()
    for entry in run.inbox:
        inbox.add(entry)
    inbox.take(facts.recorded)
    times = facts.times + inbox.times
    end = max(times, default=0.0)
    timeline = facts.timeline.done()
    return ReportData(
        job=run.job,
        start=min(times, default=0.0),
        end=end,
        membership=facts.membership(end),
        step_time=_per_worker(inbox.step_time),
        loss=_per_worker(inbox.loss),
        figures=tuple(
            (name, _per_worker(by_worker)) for name, by_worker in sorted(inbox.figures.items())
        ),
        evaluation=tuple(
            Series(f"{worker} {name}", worker, tuple(points[-MAX_POINTS:]))
            for (worker, name), points in sorted(facts.evals.items())
        ),
        gpu_memory=_per_device(inbox.memory, inbox.device_names),
        gpu_temperature=_per_device(inbox.temperature, inbox.device_names),
        transfers=_per_worker(inbox.transfers),
        markers=tuple(facts.markers),
        summary=_summary(facts, inbox, run),
        timeline=tuple(recent(timeline, TIMELINE_ROWS)),
        timeline_total=len(timeline),
        refused=facts.refused.rows(),
    )


@dataclass
class _FactSeries:
    """What the journal says, fact by fact: timeline rows, markers, membership, counts."""

    timeline: Folder = field(default_factory=Folder)
    markers: list[Marker] = field(default_factory=list)
    active: list[Point] = field(default_factory=list)
    members: list[Point] = field(default_factory=list)
    present: set[str] = field(default_factory=set)
    times: list[float] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    world_size: int = 0
    discarded: int = 0
    evals: dict[tuple[str, str], list[Point]] = field(default_factory=lambda: defaultdict(list))
    recorded: dict[str, dict[str, list[Point]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    """name -> trainer -> (time, value) of the figures a trainer recorded after its last
    step (journaled as EvalReported: they had no next step's report to ride on)."""
    evaluators: set[str] = field(default_factory=set)
    refused: Totals = field(default_factory=Totals)
    repairs: int = 0
    """Inbox repairs: one per InboxRepaired, and those it counts (`more`)."""

    def add(self, entry_id: str, fact: Fact) -> None:
        at = fact.at
        name = type(fact).__name__
        self.counts[name] += 1
        if isinstance(fact, InboxRepaired):
            self.repairs += 1 + fact.more
        self.times.append(at)
        self.timeline.add(entry_id, fact)
        if isinstance(fact, WorkerJoined | WorkerLeft | WorkerFailed):
            before = len(self.present)
            if isinstance(fact, WorkerJoined):
                self.present.add(fact.worker)
                if fact.role == "evaluator":
                    self.evaluators.add(fact.worker)
            else:
                self.present.discard(fact.worker)
            if len(self.present) != before or not self.members:
                self.members.append((at, float(len(self.present))))
        if isinstance(fact, Rewound):
            self.discarded += fact.from_step - fact.to_step
        if isinstance(fact, EvalReported):
            self._evaluated(fact)
        if isinstance(fact, CommandsRefused):
            self.refused.add(fact)
        if isinstance(fact, WorldChanged):
            self.world_size = len(fact.ranks)
            self.active.append((at, float(len(fact.ranks))))
        marker = _marker(entry_id, fact)
        if marker is not None:
            self.markers.append(marker)

    def _evaluated(self, fact: EvalReported) -> None:
        """An evaluator's metrics are its own lines; a trainer's (recorded after its last
        step) join the figures it recorded with its steps."""
        trainer = fact.worker not in self.evaluators
        for name, value in fact.metrics.items():
            if not math.isfinite(value):
                continue
            if trainer:
                self.recorded[name][fact.worker].append((fact.at, value))
            else:
                self.evals[(fact.worker, name)].append((fact.at, value))

    def membership(self, end: float) -> tuple[Series, ...]:
        """Active ranks and members as step lines held up to `end`."""
        return tuple(
            Series(label, "", _stairs(points, end), dashed=dashed)
            for label, points, dashed in (
                ("active ranks", self.active, False),
                ("members", self.members, True),
            )
            if points
        )


@dataclass
class _InboxSeries:
    """What the retained inbox says: step times, losses and GPU readings per worker."""

    step_time: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    loss: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    figures: dict[str, dict[str, list[Point]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    """name -> worker -> (time, value) of what the scripts recorded."""
    memory: dict[tuple[str, int], list[Point]] = field(default_factory=lambda: defaultdict(list))
    temperature: dict[tuple[str, int], list[Point]] = field(
        default_factory=lambda: defaultdict(list)
    )
    device_names: dict[tuple[str, int], str] = field(default_factory=dict)
    transfers: dict[str, list[Point]] = field(default_factory=lambda: defaultdict(list))
    times: list[float] = field(default_factory=list)
    skipped: int = 0

    def add(self, entry: Entry) -> None:
        try:
            command = decode_command(entry.raw or b"")
        except DecodeError:
            self.skipped += 1
            return
        at = entry.ms / 1000.0
        if isinstance(command, StepDone):
            self.times.append(at)
            self.step_time[command.worker].append((at, command.step_time))
            if command.loss is not None and math.isfinite(command.loss):
                self.loss[command.worker].append((at, command.loss))
            for name, value in (command.metrics or {}).items():
                if math.isfinite(value):
                    self.figures[name][command.worker].append((at, value))
        elif isinstance(command, TransfersWaiting):
            self.times.append(at)
            self.transfers[command.worker].append((at, float(command.pending)))
        elif isinstance(command, GpuReading):
            self.times.append(at)
            for device in command.devices:
                key = (command.worker, device.index)
                self.device_names[key] = device.name
                if device.memory_total > 0:
                    self.memory[key].append((at, 100.0 * device.memory_used / device.memory_total))
                if device.temperature is not None:
                    self.temperature[key].append((at, device.temperature))

    def take(self, recorded: dict[str, dict[str, list[Point]]]) -> None:
        """The figures trainers recorded after their last step (journaled), in the lines of
        the figures they recorded with their steps: "loss" with the losses."""
        for name, by_worker in recorded.items():
            into = self.loss if name == "loss" else self.figures[name]
            for worker, points in by_worker.items():
                into[worker].extend(points)


def _summary(facts: _FactSeries, inbox: _InboxSeries, run: Run) -> Summary:
    counts = facts.counts
    return Summary(
        facts=len(facts.times),
        steps_committed=counts["StepCommitted"],
        epochs_finished=counts["EpochFinished"],
        joined=counts["WorkerJoined"],
        failed=counts["WorkerFailed"],
        left=counts["WorkerLeft"],
        refused=counts["JoinRefused"],
        promotions=counts["SparePromoted"],
        elections=counts["LeaderElected"],
        world_changes=counts["WorldChanged"],
        divergences=counts["WeightsDiverged"],
        checkpoints=counts["CheckpointSaved"],
        rewinds=counts["Rewound"],
        discarded_steps=facts.discarded,
        dead_letters=len(run.dead),
        inbox_repairs=facts.repairs,
        inbox_entries=len(run.inbox),
        inbox_skipped=inbox.skipped,
        final_world_size=facts.world_size,
    )


def _marker(entry_id: str, fact: Fact) -> Marker | None:
    """The marker a fact draws on the report's time axis; None for facts it does not mark."""
    drawn = _membership_marker(fact) or _weights_marker(fact)
    if drawn is None:
        return None
    kind, label = drawn
    return Marker(fact.at, kind, label, entry_id)


def _membership_marker(fact: Fact) -> tuple[str, str] | None:
    """(kind, label) of a fact about who trains: failures, leaders, worlds, pauses, stragglers."""
    match fact:
        case WorkerFailed():
            return "failure", f"{fact.worker} failed: {fact.reason}"
        case LeaderElected():
            return "leader", f"leader {fact.coordinator} (epoch {fact.epoch})"
        case SparePromoted():
            instead = f" for {fact.replaces}" if fact.replaces else " to make up min_workers"
            return "promotion", f"spare {fact.worker} promoted{instead}"
        case WorldChanged():
            return "world", f"world {fact.version}: {len(fact.ranks)} ranks - {fact.reason}"
        case TrainingPaused():
            return "pause", f"paused: {fact.reason}"
        case TrainingResumed():
            return "resume", f"resumed with {fact.active} active"
        case StragglerDetected():
            return (
                "straggler",
                f"{fact.worker} straggles ({fact.step_time:.3g}s vs median {fact.median:.3g}s)",
            )
    return None


def _weights_marker(fact: Fact) -> tuple[str, str] | None:
    """(kind, label) of a fact about the weights and the GPUs: divergence, advice,
    checkpoints, rewinds, losses and the end."""
    match fact:
        case WeightsDiverged():
            return "diverged", f"weights diverged at step {fact.step}"
        case GpuAdviceIssued():
            return "advice", f"advice {_advice(fact)}"
        case GpuAdviceCleared():
            return "advice-cleared", f"advice cleared {_advice(fact)}"
        case CheckpointSaved():
            return "checkpoint", f"checkpoint of step {fact.step} ({fact.bytes} bytes)"
        case Rewound():
            return "rewind", f"rewound from step {fact.from_step} to {fact.to_step} ({fact.source})"
        case WeightsLost():
            return "lost", f"weights of step {fact.step} lost"
        case JobFinished():
            return "finished", f"finished at step {fact.step}: {fact.reason}"
    return None


def _advice(fact: GpuAdviceIssued | GpuAdviceCleared) -> str:
    """worker/device, rule, action and evidence."""
    where = fact.worker + ("" if fact.device is None else f" gpu{fact.device}")
    parts = [where + ":", fact.rule]
    if isinstance(fact, GpuAdviceIssued):
        extra = (
            f" x{fact.factor:g}" if fact.factor else f" {fact.seconds:g}s" if fact.seconds else ""
        )
        parts.append(f"{fact.action}{extra}")
        parts.append(f"({fact.metric}={fact.value:g}, over {fact.threshold:g})")
    elif fact.metric:
        evidence = (
            f"{fact.metric}={fact.value:g}"
            if fact.value is not None
            else f"{fact.metric} unmeasured"
        )
        parts.append(f"({evidence})")
    return " ".join(parts)


def _stairs(points: Sequence[Point], end: float) -> tuple[Point, ...]:
    """A count that holds its value until the next change: a step line up to `end`."""
    out: list[Point] = []
    for at, value in points:
        if out:
            out.append((at, out[-1][1]))
        out.append((at, value))
    if out and end > out[-1][0]:
        out.append((end, out[-1][1]))
    return tuple(out)


def _thin(points: Sequence[Point]) -> tuple[Point, ...]:
    """At most MAX_POINTS points, evenly strided, keeping the last."""
    if len(points) <= MAX_POINTS:
        return tuple(points)
    stride = math.ceil(len(points) / MAX_POINTS)
    kept = list(points[::stride])
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return tuple(kept)


def _per_worker(by_worker: dict[str, list[Point]]) -> tuple[Series, ...]:
    return tuple(Series(w, w, _thin(sorted(p))) for w, p in sorted(by_worker.items()))


def _per_device(
    by_device: dict[tuple[str, int], list[Point]], names: dict[tuple[str, int], str]
) -> tuple[Series, ...]:
    return tuple(
        Series(
            f"{worker} gpu{index}",
            worker,
            _thin(sorted(points)),
            dashed=index % 2 == 1,
            tooltip=f"{worker} gpu{index} {names.get((worker, index), '')}".strip(),
        )
        for (worker, index), points in sorted(by_device.items())
    )
