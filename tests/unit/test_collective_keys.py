"""Every collective key names its writer, and a worker's own ACL user writes only its own
(issue 33): the pure key and rule functions, and a joiner's check of the weights it takes."""

from __future__ import annotations

import fnmatch
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cohort import acl
from cohort.events.errors import InvalidValueError
from cohort.events.keys import WRITER, Keys, by
from cohort.events.models import Weights
from cohort.events.shards import Shard
from cohort.worker.errors import WeightsRefusedError
from cohort.worker.loop.elastic import Elastic
from cohort.worker.membership.view import Assignment, WorldPlan

KEYS = Keys("J")
WORKER = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,20}", fullmatch=True)


def every_key(keys: Keys, writer: str) -> list[str]:
    """One key of each kind a rank writes in a collective, by `writer`."""
    return [
        keys.grad(3, 7, 1, 2, writer),
        keys.grad(3, 7, 1, 2, writer, "g5"),
        keys.grad_reduced(3, 7, 2, writer),
        keys.grad_reduced(3, 7, 2, writer, "g5"),
        keys.grad_broadcast(3, 7, 0, writer),
        keys.grad_broadcast(3, 7, 0, writer, "g5"),
        keys.step_events(3, 7, "allreduce-hosts", writer),
        keys.weights(7, writer),
    ]


def writes(patterns: tuple[str, ...], key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def test_a_collective_key_ends_in_its_writer_s_name() -> None:
    assert KEYS.grad(3, 7, 1, 2, "w1") == "cohort:{J}:grad:3:7:1:2/w1"
    assert KEYS.grad(3, 7, 1, 2, "w1", "g5") == "cohort:{J/g5}:grad:3:7:1:2/w1"
    assert KEYS.grad_reduced(3, 7, 2, "w1") == "cohort:{J}:grad:3:7:reduced:2/w1"
    assert KEYS.step_events(3, 7, "barrier", "a@b") == "cohort:{J}:grad:3:7:barrier:events/a@b"
    assert all(key.endswith(f"{WRITER}w1") for key in every_key(KEYS, "w1"))


@pytest.mark.parametrize("bad", ["", "a/b", "a*", "a?", "[a]", "a\\b"])
def test_a_name_that_could_be_confused_cannot_name_a_writer(bad: str) -> None:
    with pytest.raises(InvalidValueError):
        by("cohort:{J}:grad:1", bad)


@given(mine=WORKER, theirs=WORKER)
def test_a_worker_s_write_patterns_match_its_keys_and_no_other_worker_s(
    mine: str, theirs: str
) -> None:
    """'@' is allowed in names ('a@b'), so the separator is '/', which no name holds."""
    patterns = KEYS.writable(mine)
    assert all(writes(patterns, key) for key in every_key(KEYS, mine))
    if theirs != mine:
        assert not any(writes(patterns, key) for key in every_key(KEYS, theirs))
    other_job = Keys("J2")
    assert not any(writes(patterns, key) for key in every_key(other_job, mine))


def test_at_would_not_do_as_the_separator() -> None:
    assert fnmatch.fnmatchcase("cohort:{J}:grad:1:0:0:0@a@b", "cohort:{J}:grad:*@b")


def test_a_worker_s_own_user_reads_every_collective_key_and_writes_only_its_own() -> None:
    rules = acl.rules("J", "worker", worker="a")
    reads = [r[3:] for r in rules if r.startswith("%R~")]
    written = [r[3:] for r in rules if r.startswith("%W~")]
    assert not [r for r in rules if r.startswith("~")]  # nothing both ways for every key
    assert {"cohort:{J}:grad:*", "cohort:{J/g*}:grad:*", "cohort:{J}:weights:*"} <= set(reads)
    assert written == list(KEYS.writable("a"))  # the inbox: XADD only, by its own selector
    assert "(%W~cohort:{J}:inbox +xadd)" in rules
    assert acl.worker_setuser("J", "a", "secret")[6:] == [
        *rules,
        f"%R~{Keys('J').credential('a')}",  # its new secret while the job key rotates
    ]


def test_the_shared_worker_role_keeps_its_broad_patterns() -> None:
    rules = acl.rules("J", "worker")
    assert "~cohort:{J}:grad:*" in rules and "~cohort:{J/g*}:grad:*" in rules
    assert "~cohort:{J}:weights:*" in rules


# ---------------------------------------------------------------- a joiner's weights


def _joiner(digest_now: str, journaled: str | None, rank: int = 1) -> tuple[Any, Assignment]:
    weights = Weights(step=9, source="rank", digest=journaled)
    plan = WorldPlan(2, 10, 10, 0, ("a", "b"), (Shard(), Shard()), weights)
    assignment = plan.assignment_of(("a", "b")[rank])
    assert assignment is not None
    left: list[str] = []
    worker = SimpleNamespace(
        id=("a", "b")[rank],
        view=SimpleNamespace(plans=(plan,)),
        leave=lambda reason: left.append(reason),
    )
    loop = SimpleNamespace(
        state=SimpleNamespace(digest=lambda: digest_now), worker=worker, left=left
    )
    return loop, assignment


def test_a_joiner_refuses_weights_whose_digest_is_not_the_journaled_one_and_leaves() -> None:
    loop, assignment = _joiner("f" * 32, "0" * 32)
    with pytest.raises(WeightsRefusedError) as refused:
        Elastic._check_weights(loop, assignment)  # type: ignore[arg-type]
    error = refused.value
    assert (error.sender, error.step, error.got, error.journaled) == ("a", 9, "f" * 32, "0" * 32)
    assert "worker 'a' (rank 0)" in str(error)
    assert loop.left and "refused the weights of step 9" in loop.left[0]


@pytest.mark.parametrize(
    "digest_now, journaled, rank",
    [("0" * 32, "0" * 32, 1), ("f" * 32, None, 1), ("f" * 32, "0" * 32, 0)],
)
def test_a_joiner_takes_weights_of_the_journaled_digest_or_when_none_was_journaled(
    digest_now: str, journaled: str | None, rank: int
) -> None:
    loop, assignment = _joiner(digest_now, journaled, rank)
    Elastic._check_weights(loop, assignment)  # type: ignore[arg-type]
    assert loop.left == []
