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
    state: JobState, lease_token: str | None, leader_view: dict[str, Any] | None, now: float
) -> dict[str, Any]:
    """The status body: `state` as of the journal, its progress as of `now` (the Redis
    server's clock, which stamped the facts), the lease as Redis holds it now, and the
    leader's volatile view (None when no leader published one)."""
    body = view(state)
    elected = body.pop("leader")
    return {
        "version": STATUS_VERSION,
        "job": body.pop("job") or None,
        "leader_id": coordinator_of(lease_token) if lease_token else None,
        "lease_token": lease_token,
        "elected_id": elected,
        **body,
        "progress": progress(state, now).body(),
        "leader_view": leader_view,
    }
