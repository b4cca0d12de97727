"""Rebuild and explain a past run: from Redis or from an exported file, without a leader.

An export file is a msgpack stream of maps: first a header
`{"format": "cohort-export", "v": 1, "job": J, "exported_at": T}`, then one map per
stream entry `{"stream": "journal"|"inbox"|"dead", "id": ID, "fields": {name: bytes}}`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgpack

from cohort.coordinator import spares
from cohort.coordinator.errors import CoordinatorError
from cohort.coordinator.fold import fold
from cohort.coordinator.state import JobState, dump, state_hash
from cohort.events.archive import ArchiveError, History
from cohort.events.codec import gc_paused
from cohort.events.connection import Client
from cohort.events.errors import DecodeError
from cohort.events.keys import Keys
from cohort.events.models import Fact, WorkerFailed, WorldChanged
from cohort.events.streams import ZERO, Entry, Journal, Stream, id_after

EXPORT_FORMAT = "cohort-export"
EXPORT_VERSION = 1
STREAMS = ("journal", "inbox", "dead")


class ReplayError(CoordinatorError):
    pass


@dataclass
class Run:
    """A job's streams as read from Redis or a file."""

    job: str
    journal: list[Entry] = field(default_factory=list)
    inbox: list[Entry] = field(default_factory=list)
    dead: list[Entry] = field(default_factory=list)

    def facts(self, until: str | None = None, batch: int = 4096) -> Iterator[tuple[str, Fact]]:
        for page, facts in self.pages(until, batch):
            yield from zip([entry.id for entry in page], facts, strict=True)

    def pages(
        self, until: str | None = None, batch: int = 4096
    ) -> Iterator[tuple[list[Entry], list[Fact]]]:
        """The journal up to `until`, a page of entries and their facts at a time."""
        entries = self.journal
        if until is not None:
            entries = list(itertools.takewhile(lambda e: not id_after(e.id, until), entries))
        for start in range(0, len(entries), batch):
            page = entries[start : start + batch]
            try:
                facts = Journal.decode_page(page)
            except DecodeError as exc:
                bad = page[exc.index or 0].id
                raise ReplayError(f"journal entry {bad} cannot be read: {exc.reason}") from None
            yield page, facts


def from_redis(conn: Client, job: str, with_inbox: bool = True) -> Run:
    """JOB's run as Redis and its archive hold it: the whole journal (archived segments, each
    checked against its journaled sha256, then Redis's part), the inbox and dead letters."""
    keys = Keys(job)
    with gc_paused():
        try:
            journal = [entry for page in History.of(conn, job).pages() for entry in page]
        except ArchiveError as exc:
            raise ReplayError(f"the journal of job {job!r} cannot be read whole: {exc}") from None
        run = Run(job, journal=journal)
        if with_inbox:
            run.inbox = _all(Stream(conn, keys.inbox))
            run.dead = _all(Stream(conn, keys.dead))
    return run


def _all(stream: Stream, batch: int = 10_000) -> list[Entry]:
    return [entry for page in stream.pages(count=batch) for entry in page]


def export(run: Run, out: IO[bytes], exported_at: float) -> int:
    """Write `run` to `out`; returns the number of entries written."""
    packer = msgpack.Packer(use_bin_type=True)
    header = {
        "format": EXPORT_FORMAT,
        "v": EXPORT_VERSION,
        "job": run.job,
        "exported_at": exported_at,
    }
    out.write(packer.pack(header))
    count = 0
    for name in STREAMS:
        for entry in getattr(run, name):
            out.write(packer.pack({"stream": name, "id": entry.id, "fields": entry.fields}))
            count += 1
    return count


def from_file(path: Path) -> Run:
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ReplayError(f"cannot open export file {str(path)!r}: {exc.strerror}") from None
    with handle:
        unpacker = msgpack.Unpacker(handle, raw=False, strict_map_key=False)
        try:
            header = next(unpacker)
        except StopIteration:
            raise ReplayError(f"{str(path)!r} is empty; expected a `cohort export` file") from None
        except Exception as exc:
            raise ReplayError(f"{str(path)!r} is not a `cohort export` file ({exc})") from None
        if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
            raise ReplayError(f"{str(path)!r} is not a `cohort export` file (no header)")
        if header.get("v") != EXPORT_VERSION:
            raise ReplayError(
                f"{str(path)!r} has export version {header.get('v')!r}; this cohort reads "
                f"version {EXPORT_VERSION}"
            )
        run = Run(str(header.get("job")))
        try:
            for record in unpacker:
                fields = {_as_bytes(k): _as_bytes(v) for k, v in record["fields"].items()}
                getattr(run, record["stream"]).append(Entry(record["id"], fields))
        except Exception as exc:
            raise ReplayError(f"{str(path)!r} is truncated or corrupt: {exc}") from None
        return run


def _as_bytes(value: Any) -> bytes:
    """A field name or value of an export file as bytes, as `Entry` holds them (text: UTF-8)."""
    return value if isinstance(value, bytes) else str(value).encode()


@dataclass
class JournalWatch:
    """A live fold of a job's journal, archived segments and all, for viewers (status
    --watch, the demo, `cohort run`)."""

    history: History
    state: JobState = field(default_factory=JobState)
    journal_id: str = ZERO
    facts: list[tuple[str, Fact]] = field(default_factory=list)

    def pull(self, block_ms: int = 200) -> list[Fact]:
        """Fold what the journal gained; waits up to `block_ms` for the first new fact."""
        new = []
        for entries in self.history.pages(self.journal_id, block_ms=block_ms):
            facts = Journal.decode_page(entries)
            self.state = fold(facts, self.state)
            self.journal_id = entries[-1].id
            self.facts.extend(zip((entry.id for entry in entries), facts, strict=True))
            new.extend(facts)
        return new

    @classmethod
    def of(cls, conn: Client, job: str) -> JournalWatch:
        return cls(History.of(conn, job))


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Around a process's reading of a whole run that it then reports on and exits
    (`cohort replay`, `status`, `report`, `export`): nothing it reads is cycle-collected.

    A journal of a million facts is some four million tracked objects, none in a cycle.
    Pausing the collector per page only defers the work: the first collection after it
    walks every object made meanwhile (0.8 s of a 5 s replay of 1M facts), and the
    interpreter walks them all again at exit. Here what was read is frozen instead
    (`gc.freeze`), so no later collection walks it. Not for long-lived processes: a
    frozen object is never cycle-collected, only freed by reference counting.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def rebuild(run: Run, until: str | None = None) -> tuple[JobState, list[tuple[str, Fact]]]:
    timeline: list[tuple[str, Fact]] = []
    facts: list[Fact] = []
    with gc_paused():
        for page, decoded in run.pages(until):
            timeline += zip([entry.id for entry in page], decoded, strict=True)
            facts += decoded
    return fold(facts), timeline


def fact_details(fact: Fact) -> str:
    """One line a person reads in a timeline (fields that are unset are left out)."""
    if isinstance(fact, WorldChanged):
        sizes = [s.size for s in fact.shards]
        return (
            f"world {fact.version} from step {fact.start_step} (epoch {fact.epoch}): "
            f"ranks {list(fact.ranks)}, shard sizes {sizes}{_weights(fact)} - {fact.reason}"
        )
    if isinstance(fact, WorkerFailed):
        return f"worker={fact.worker} {fact.reason}"  # why, as journaled (cause, how, ...)
    body = fact.model_dump(exclude={"v", "at", "job", "type"}, exclude_none=True)
    parts = []
    for key, value in body.items():
        if key == "config":
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif key == "position":
            value = _position(value)
        parts.append(f"{key}={value}")
    return " ".join(parts)


def _weights(world: WorldChanged) -> str:
    weights = world.weights
    if weights is None:
        return ""
    if weights.source == "initial":
        return ", initial weights"
    held = f"rank 0's ({world.ranks[0]})" if weights.source == "rank" else weights.uri
    return f", weights of step {weights.step} from {held}"


def _position(body: dict[str, Any]) -> str:
    left = sum(stop - start for start, stop in body["rest"]["ranges"])
    return f"(epoch {body['epoch']}, {left} samples left)"


def launcher_view(state: JobState) -> dict[str, Any] | None:
    """What a launcher's job (torchrun's agents as members) is doing: its agents now, the
    latest rendezvous round, and how many rounds, runs and restarts; None for a job whose
    members train cohort's steps."""
    agents = sorted(w for w, m in state.members.items() if m.role == "agent")
    latest, counters = state.rendezvous, state.counters
    if not agents and latest is None:
        return None
    return {
        "agents": agents,
        "round": None if latest is None else latest.round,
        "round_agents": [] if latest is None else list(latest.agents),
        "rounds": counters.rounds,
        "runs": counters.runs,
        "restarts": counters.rounds - counters.runs,
    }


def _phase(state: JobState, launcher: dict[str, Any] | None) -> str:
    if state.finished:
        return "finished"
    if launcher is not None and not state.started:
        return "running" if launcher["agents"] else "ended"
    return "paused" if state.paused else "running"


def view(state: JobState) -> dict[str, Any]:
    """The state as plain data, for `--json` and for people."""
    body = dump(state)
    del body["commits"]  # the rate's raw window: `cohort status` gives the rate itself
    body["state_hash"] = state_hash(state)
    body["world_size"] = len(state.ranks)
    body["next_step"] = state.next_step
    body["chief"] = state.chief
    body["launcher"] = launcher_view(state)
    body["phase"] = _phase(state, body["launcher"])
    body["paused"] = state.paused and not state.finished  # a finished job waits for nothing
    for worker, member in body["members"].items():
        member["rank"] = state.rank_of(worker)
    body["spares"] = {
        "ready": [m.worker for m in spares.ready(state)],
        "syncing": [m.worker for m in state.spares if m.status == "syncing"],
    }
    body["shards"] = [s.model_dump(mode="json")["ranges"] for s in state.shards]
    if state.dataset is not None:  # the files' count, not 100,000 sizes in every status
        body["dataset"] = {
            "size": state.dataset.size,
            "fingerprint": state.dataset.fingerprint,
            "files": len(state.dataset.files),
        }
    return body
