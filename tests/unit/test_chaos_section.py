"""How the chaos-ha section is made from its runs: a column per run (topology and
--wait-replicas), a row per figure, a run that failed named as failed, and what "every check
passed" requires with and without WAIT (no Redis needed: made-up results)."""

from __future__ import annotations

from typing import Any

from bench.chaos import ha_section, passed


def run(topology: str, wait: int, **changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "topology": topology, "wait_replicas": wait, "minutes": 10.0, "seed": 1,
        "describe": f"{topology} servers", "kinds": ["kill-worker", "failover-primary"],
        "faults": {"kill-worker": 3, "failover-primary": 2}, "chaos_s": 600.0,
        "committed": 5000, "workers": 9, "epochs": 7, "worlds": 12, "grow": True,
        "lost": [], "twice": [], "finishers": 3, "agree": True, "replayed": 1e-15,
        "disagree": 0, "diverged": 0, "replay_ok": True, "audit_ok": True,
        "failovers": [
            {"promote_s": 2.0, "rejoin_s": 15.0, "killed": 1, "promoted": 2, "settled": 2},
            {"promote_s": 3.0, "rejoin_s": 16.0, "killed": 2, "promoted": 1, "settled": 1},
        ],
        "commit_gap_s": 6.0, "unreplicated": 0, "rolled_back": 0, "rolled_back_types": {},
        "acted_on": 0, "leaders_acted": 0, "folded_lost": 0, "noticed_coordinators": [],
        "noticed_workers": [], "unnoticed": [],
    }  # fmt: skip
    raw.update(changes)
    raw["ok"] = passed(raw)
    return raw


def test_each_run_is_a_column_and_a_failed_run_says_why() -> None:
    cells = {
        "sentinel/0": run("sentinel", 0),
        "sentinel/1": run("sentinel", 1),
        "cluster/1": {"topology": "cluster", "wait_replicas": 1, "minutes": 10.0,
                      "error": "TopologyError: no replica promoted", "ok": False},
    }  # fmt: skip
    section = ha_section(cells, "python -m bench --only chaos-ha")
    assert section.key == "chaos-ha" and section.raw == {"cells": cells}
    assert section.header == [
        "what",
        "sentinel, --wait-replicas 0",
        "sentinel, --wait-replicas 1",
        "cluster, --wait-replicas 1",
    ]
    rows = {row[0]: row[1:] for row in section.rows}
    assert rows["faults: failover-primary"] == ["2", "2", ""]
    assert rows["failover: kill to a replica promoted and followed, s (median, max)"][0] == (
        "2.5, 3.0"
    )
    assert rows["every check passed"] == [
        "yes",
        "yes",
        "**failed**: TopologyError: no replica promoted",
    ]
    assert "sentinel: sentinel servers" in section.notes[0]


def test_without_wait_a_noticed_rollback_is_reported_with_wait_it_fails_the_run() -> None:
    rolled = {"rolled_back": 3, "acted_on": 1, "noticed_workers": ["w4"], "acted_by": ["w4"]}
    assert run("sentinel", 0, **rolled)["ok"]
    assert not run("sentinel", 1, **rolled)["ok"]
    assert not run("sentinel", 1, leaders_acted=1)["ok"]
    assert not run("sentinel", 0, unnoticed=["w4"])["ok"]  # acted on a lost fact unawares
    assert not run("cluster", 0, failovers=[])["ok"]  # no failover: nothing was shown
    moved = run("sentinel", 0, failovers=[{**run("sentinel", 0)["failovers"][0], "settled": 3}])
    rows = {row[0]: row[1:] for row in ha_section({"s": moved}, "c").rows}
    assert rows["primary moved again, not by a fault"] == ["1"]
