"""Random joins (spares among them), leaves, failures, steps, heartbeats, checkpoints and
resumes keep the invariants 1-3, 9, 10 and 11 of docs/design.md."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cohort.coordinator.audit import audit
from cohort.coordinator.fold import evolve, fold
from cohort.coordinator.state import JobState, dump, load
from cohort.events.models import (
    Dataset,
    Fact,
    Join,
    LeaderElected,
    Node,
    Rewound,
    SparePromoted,
    WorkerFailed,
    WorkerLeft,
    WorldChanged,
)
from tests.unit.job import Job

NAMES = [f"w{i}" for i in range(6)]


class Membership(RuleBasedStateMachine):
    PLACEMENT: dict[str, Any] = {"dataset_size": 13}
    """The data and how it is dealt: what each variant below changes."""

    def __init__(self) -> None:
        super().__init__()
        self.job = Job(
            min_workers=2,
            max_workers=4,
            heartbeat_interval=1,
            heartbeat_timeout=3,
            batch_size=2,
            straggler_steps=2,
            checkpoint_uri="file:///ckpt",
            checkpoint_every=3,
            checkpoint_keep=2,
            **self.PLACEMENT,
        )
        self.crashed: set[str] = set()

    # ------------------------------------------------------------ what happens
    @rule(name=st.sampled_from(NAMES))
    def join(self, name: str) -> None:
        self.crashed.discard(name)
        self.job.join(name)

    @rule(name=st.sampled_from(NAMES))
    def join_as_a_spare(self, name: str) -> None:
        self.crashed.discard(name)
        job = self.job
        job.send(Join(at=job.now, job=job.state.job, worker=name, node=job.nodes(name),
                      dataset=job.dataset, spare=True))  # fmt: skip

    @rule(data=st.data())
    def load_weights(self, data: st.DataObject) -> None:
        syncing = [w for w, m in self.job.state.members.items() if m.status == "syncing"]
        if syncing:
            self.job.ready(data.draw(st.sampled_from(sorted(syncing))))

    @rule(data=st.data(), slow=st.booleans())
    def finish_step(self, data: st.DataObject, slow: bool) -> None:
        ranks = [w for w in self.job.state.ranks if w not in self.crashed]
        if ranks:
            worker = data.draw(st.sampled_from(ranks))
            self.job.done(worker, step_time=3.0 if slow else 1.0)

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=2, max_size=3, unique=True))
    def start_workers(self, names: list[str]) -> None:
        for name in names:
            self.crashed.discard(name)
            self.job.join(name)
        for name in names:
            self.job.ready(name)

    @rule(steps=st.integers(1, 4))
    def whole_steps(self, steps: int) -> None:
        for _ in range(steps):
            for worker in self.job.state.ranks:
                if worker not in self.crashed:
                    self.job.done(worker)

    @rule(data=st.data(), when=st.sampled_from(["now", "after_next", "none"]))
    def leave(self, data: st.DataObject, when: str) -> None:
        members = sorted(self.job.state.members)
        if not members:
            return
        worker = data.draw(st.sampled_from(members))
        after = {"now": max(self.job.state.last_committed, 0), "none": None}.get(
            when, self.job.state.next_step
        )
        self.job.leave(worker, after_step=after)

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        members = sorted(set(self.job.state.members) - self.crashed)
        if members:
            self.crashed.add(data.draw(st.sampled_from(members)))

    @rule(data=st.data())
    def write_a_checkpoint(self, data: st.DataObject) -> None:
        writers = [r for r in self.job.state.requested if r.worker not in self.crashed]
        if writers:
            self.job.checkpoint_written(data.draw(st.sampled_from(writers)))

    @rule()
    def resume_from_scratch(self) -> None:
        self.job.resume()

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5]))
    def time_passes(self, seconds: float) -> None:
        for worker in self.job.state.members:
            if worker not in self.crashed:
                self.job.heartbeat(worker)
        self.only_silent_workers_fail(self.job.advance(seconds))

    @rule(names=st.lists(st.sampled_from(NAMES), max_size=3, unique=True), beats=st.integers(2, 4))
    def leader_decides_a_backlog(self, names: list[str], beats: int) -> None:
        """No leader for a while (none started yet, or the last one died): Joins of workers
        started meanwhile and everyone's heartbeats (every 2 s; the timeout is 3 s) queue up,
        are decided as of their arrival, and only then is silence judged."""
        for name in names:
            self.crashed.discard(name)
            self.job.join(name)
        for _ in range(beats):
            self.job.now += 2
            for worker in sorted(set(self.job.state.members) | set(names)):
                if worker not in self.crashed:
                    self.job.heartbeat(worker)
        self.only_silent_workers_fail(self.job.advance(0.5))

    def only_silent_workers_fail(self, facts: tuple[Fact, ...]) -> None:
        """Invariant 10: a worker that is sending heartbeats is never declared failed."""
        failed = {f.worker for f in facts if isinstance(f, WorkerFailed)}
        assert failed <= self.crashed, failed - self.crashed

    @precondition(lambda self: bool(self.job.journal))
    @rule()
    def new_leader_from_snapshot(self) -> None:
        """A leader change: a snapshot round trip loses nothing of the state."""
        self.job.core.restore(load(dump(self.job.core.state)))

    # ------------------------------------------------------------ what must hold
    @invariant()
    def replay_equals_live_state(self) -> None:
        assert self.job.replayed() == self.job.state

    @invariant()
    def the_batched_fold_equals_evolving_fact_by_fact(self) -> None:
        state = JobState()
        for fact in self.job.journal:
            state = evolve(state, fact)
        assert state == fold(self.job.journal)

    @invariant()
    def ranks_are_a_permutation_of_active_members(self) -> None:
        state = self.job.state
        assert len(set(state.ranks)) == len(state.ranks)
        for worker in state.ranks:
            assert state.members[worker].status in ("active", "draining"), worker
        assert len(state.shards) == len(state.ranks)
        if not state.paused:
            assert len(state.ranks) >= 2

    @invariant()
    def a_spare_holds_no_rank_and_is_promoted_only_for_a_rank_just_lost(self) -> None:
        state = self.job.state
        assert not [m.worker for m in state.spares if m.worker in state.ranks]
        removed: set[str] = set()  # removed since the last world: this decision's losses
        for fact in self.job.journal:
            if isinstance(fact, WorldChanged):
                removed = set()
            elif isinstance(fact, WorkerFailed | WorkerLeft):
                removed.add(fact.worker)
            elif isinstance(fact, SparePromoted) and fact.replaces is not None:
                assert fact.replaces in removed, fact

    @invariant()
    def world_versions_and_leader_epochs_only_grow(self) -> None:
        versions = [f.version for f in self.job.journal if isinstance(f, WorldChanged)]
        assert versions == sorted(set(versions))
        epochs = [f.epoch for f in self.job.journal if isinstance(f, LeaderElected)]
        assert epochs == sorted(epochs)
        data_epochs: list[int] = []  # on each lineage: a rewind may go back to an older epoch
        for fact in self.job.journal:
            if isinstance(fact, Rewound):
                data_epochs = []
            elif isinstance(fact, WorldChanged):
                data_epochs.append(fact.epoch)
                assert data_epochs == sorted(data_epochs)

    @invariant()
    def every_sample_is_used_by_exactly_one_committed_step(self) -> None:
        report = audit(self.job.journal)
        assert report.ok, (report.problems, report.epochs)

    def teardown(self) -> None:
        counters = self.job.state.counters
        # What the run reached, shown by --hypothesis-show-statistics.
        event(f"epochs finished: {min(counters.epochs_finished, 2)}")
        event(f"failures: {min(counters.failed, 2)}")
        event(f"world changes > 3: {counters.world_changes > 3}")
        event(f"checkpoints: {min(counters.checkpoints, 2)}")
        event(f"rewinds: {min(counters.rewinds, 2)}")
        event(f"promotions: {min(counters.promotions, 2)}")


Membership.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_membership_invariants = Membership.TestCase

FILES = Dataset(size=13, fingerprint="thirteen", files=(3, 1, 4, 2, 3))
"""Five files of uneven sizes: pieces are cut where a rank's share runs out."""


def _node(worker: str) -> Node:
    """Each worker's node holds two of the files, some of them the same."""
    index = int(worker[1:])
    return Node(host=f"h{index % 3}", gpus=index % 3, files=((index % 5, index % 5 + 2),))


class StridedMembership(Membership):
    PLACEMENT = {"dataset_size": 13, "placement": "strided"}


class GlobalBatchMembership(Membership):
    PLACEMENT = {"dataset_size": 13, "global_batch": 5}


class StridedGlobalBatchMembership(Membership):
    PLACEMENT = {"dataset_size": 13, "placement": "strided", "global_batch": 5}


class ShardGroupMembership(Membership):
    PLACEMENT = {"dataset_size": 13, "shard_group": 2}
    """Worlds ranked in places (coordinator/decide.py `_ranked`): the same invariants."""


class HashMembership(Membership):
    PLACEMENT = {"placement": "hash", "dataset": FILES}


class LocalityMembership(Membership):
    PLACEMENT = {"placement": "locality", "global_batch": 3, "dataset": FILES, "nodes": _node}


_variants = settings(
    max_examples=40,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
for _machine in (
    StridedMembership,
    GlobalBatchMembership,
    StridedGlobalBatchMembership,
    ShardGroupMembership,
    HashMembership,
    LocalityMembership,
):
    _machine.TestCase.settings = _variants
test_strided_invariants = StridedMembership.TestCase
test_global_batch_invariants = GlobalBatchMembership.TestCase
test_strided_global_batch_invariants = StridedGlobalBatchMembership.TestCase
test_shard_group_invariants = ShardGroupMembership.TestCase
test_hash_invariants = HashMembership.TestCase
test_locality_invariants = LocalityMembership.TestCase
