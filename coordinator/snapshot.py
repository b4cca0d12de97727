"""Snapshots: a state and the journal ID it covers. A cache only: folding the facts after
it must give what folding from zero gives (invariant 1 of docs/design.md), so a bad one is
simply ignored."""

from __future__ import annotations

import msgpack

from cohort.coordinator.errors import CoordinatorError
from cohort.coordinator.state import JobState, dump, load

VERSION = 6
"""2: the state knows its weight lineage (holders, checkpoints); 3: its config says whether
epochs are shuffled (a v2 snapshot's config would read with today's default, shuffled, so
it is refolded, and the journal's upcaster gives it its old meaning); 5: the state keeps
its last commits' times (the job's rate); 6: its archived journal segments. Older ones
are refolded."""


class SnapshotUnusable(CoordinatorError):
    """The snapshot cannot be used; the caller folds from zero instead. Control flow inside
    the coordinator, never raised to a caller."""


def encode(state: JobState, journal_id: str) -> bytes:
    return msgpack.packb({"v": VERSION, "id": journal_id, "state": dump(state)}, use_bin_type=True)


def decode(blob: bytes) -> tuple[JobState, str]:
    try:
        body = msgpack.unpackb(blob, raw=False)
        if not isinstance(body, dict) or body.get("v") != VERSION:
            version = body.get("v") if isinstance(body, dict) else None
            raise SnapshotUnusable(f"snapshot schema version {version!r}, expected {VERSION}")
        return load(body["state"]), str(body["id"])
    except SnapshotUnusable:
        raise
    except Exception as exc:  # any corruption means: fold from zero
        raise SnapshotUnusable(f"snapshot unreadable: {type(exc).__name__}: {exc}") from exc
