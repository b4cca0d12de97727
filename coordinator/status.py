"""What `cohort status --json` prints: one documented schema (docs/status-json.md).

The state as `view` gives it, with the leadership named without ambiguity: `leader_id` is
the coordinator holding the lease now (the one to stop to test a failover), `lease_token`
its fencing token, `elected_id` the coordinator of the journal's last election.
"""

from __future__ import annotations

from typing import Any

from cohort.coordinator.progress import progress
from cohort.coordinator.replay import view
from cohort.coordinator.state import JobState
from cohort.coordinator.stores import coordinator_of

STATUS_VERSION = 1


def status(
    state: JobState,
    lease_token: str | None,
    leader_view: dict[str, Any] | None,
    now: float,
    held: tuple[int, int | None] | None = None,
) -> dict[str, Any]:
    """The status body: `state` as of the journal, its progress as of `now` (the Redis
    server's clock, which stamped the facts), the lease as Redis holds it now, the
    leader's volatile view (None when no leader published one) and where the journal's
    facts are: `held` is (entries, bytes or None) of the journal stream in Redis."""
    body = view(state)
    del body["archived"]  # every segment's record: `journal` sums them up
    elected = body.pop("leader")
    return {
        "version": STATUS_VERSION,
        "job": body.pop("job") or None,
        "leader_id": coordinator_of(lease_token) if lease_token else None,
        "lease_token": lease_token,
        "elected_id": elected,
        **body,
        "progress": progress(state, now).body(),
        "journal": journal(state, held),
        "leader_view": leader_view,
    }


def journal(state: JobState, held: tuple[int, int | None] | None) -> dict[str, Any]:
    """How large the journal is and where it is: in Redis, and archived in storage."""
    segments = state.archived
    return {
        "facts": state.facts,
        "in_redis": held[0] if held else None,
        "redis_bytes": held[1] if held else None,
        "archived_facts": state.archived_facts,
        "segments": len(segments),
        "archived_bytes": sum(s.bytes for s in segments),
        "archive": segments[-1].uri.rpartition("/")[0] if segments else None,
    }
