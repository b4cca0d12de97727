"""A journal that loses its last acknowledged entries, as a Sentinel or Cluster failover to a
lagging replica can make it do: coordinators notice, fold it again, and the next leader
re-decides the surviving inbox exactly once, under a new token, without split brain.

The loss is simulated on one server the way replication loses it: the tail of the journal
and the cursor go back to an earlier point together (a function's writes replicate as one
unit), while stream IDs keep growing (XADD after XDEL never reuses an ID, like the promoted
replica's clock moving on)."""

from __future__ import annotations

import pytest

from cohort.coordinator.fold import fold
from cohort.coordinator.service import Coordinator
from cohort.events.keys import Keys
from cohort.events.models import Heartbeat, LeaderElected, WorkerJoined
from cohort.events.streams import Inbox, Journal
from tests.contract.test_service import JOB, drive, join, settings

KEYS = Keys(JOB)


def facts(conn):  # type: ignore[no-untyped-def]
    return [f for _, f in Journal(conn, KEYS.journal).facts()]


def lose_after(conn, entry_id: str, cursor: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Drop every journal entry after `entry_id` and put the cursor back to `cursor`."""
    lost = [i.decode() for i, _ in conn.xrange(KEYS.journal, f"({entry_id}", "+")]
    assert lost, "nothing to lose: the test needs facts after the failover point"
    conn.xdel(KEYS.journal, *lost)
    conn.set(KEYS.cursor, cursor)
    return lost


def settle(*coordinators: Coordinator, turns: int = 40) -> None:
    for _ in range(turns):
        for coord in coordinators:
            drive(coord, 1)


@pytest.mark.parametrize("lease_survived", [True, False])
def test_a_rolled_back_journal_is_folded_again_and_re_decided_once_under_a_new_token(
    conn,  # type: ignore[no-untyped-def]
    lease_survived: bool,
) -> None:
    leader, follower = (
        Coordinator.on_redis(conn, settings("c1")),
        Coordinator.on_redis(conn, settings("c2")),
    )
    drive(leader, 1)
    drive(follower, 1)
    inbox = Inbox(conn, KEYS.inbox)
    join(inbox, "a")
    drive(leader)
    drive(follower)
    point, point_cursor, old_token = leader.journal_id, leader.cursor, leader.token
    assert old_token is not None
    join(inbox, "b")  # decided, acknowledged, folded by both ... and then lost
    drive(leader)
    drive(follower)
    assert "b" in leader.state.members and "b" in follower.state.members

    lost = lose_after(conn, point, point_cursor)
    if not lease_survived:
        conn.delete(KEYS.leader)
    inbox.send(Heartbeat(at=0, job=JOB, worker="a", step=None, world=leader.state.world_version))
    settle(leader, follower)

    assert leader.counters.rollbacks == 1  # it folded the lost entries: it must notice
    assert follower.counters.rollbacks == 1
    now = facts(conn)
    # every coordinator's state is the journal's, as Redis holds it now
    assert leader.state == fold(now) and follower.state == fold(now)
    # b's commands survived in the inbox: decided again, exactly once
    joined = [f.worker for f in now if isinstance(f, WorkerJoined)]
    assert sorted(joined) == ["a", "b"]
    # a new election after the loss, with a new token; the old one can never match again
    elected = [f for f in now if isinstance(f, LeaderElected)]
    assert [f.epoch for f in elected] == sorted({f.epoch for f in elected})
    holder = conn.get(KEYS.leader).decode()
    assert holder != old_token
    assert sum(c.leading for c in (leader, follower)) == 1
    assert all(i not in {e for e, _ in conn.xrange(KEYS.journal)} for i in lost)
