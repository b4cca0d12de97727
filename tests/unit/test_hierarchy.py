"""How ranks sit on hosts for the hierarchical allreduce, and where a worker learns it."""

from __future__ import annotations

from cohort.events.models import Node, WorkerJoined, WorldChanged
from cohort.events.shards import Shard
from cohort.worker.collective.hierarchy import Hosts, job_segments_prefix, segment_name
from cohort.worker.membership import view as views


def test_each_hosts_lowest_rank_leads_and_hosts_are_ordered_by_it() -> None:
    hosts = Hosts.of(["b", "a", "b", "a", "c"])
    assert hosts.groups == ((0, 2), (1, 3), (4,))
    assert hosts.group_of(3) == (1, 3) and hosts.index_of(4) == 2 and not hosts.flat
    assert Hosts.of(["a", "b", "c"]).flat


def test_segment_names_are_fixed_by_the_call_and_differ_between_calls() -> None:
    name = segment_name("job", 3, 7, (0, 1), 1, "c")
    assert name == segment_name("job", 3, 7, (0, 1), 1, "c")
    assert name.startswith(job_segments_prefix("job"))
    others = {segment_name("job", 4, 7, (0, 1), 1, "c"), segment_name("job", 3, 8, (0, 1), 1, "c")}
    assert name not in others and len(name) < 32  # short enough for macOS's 31 too


def test_a_worker_knows_the_host_of_every_rank_from_the_joins() -> None:
    facts = [
        WorkerJoined(at=1, job="j", worker="a", node=Node(host="h1")),
        WorkerJoined(at=1, job="j", worker="b", host="h2"),
        WorkerJoined(at=1, job="j", worker="c"),
        WorldChanged(
            at=2, job="j", version=1, start_step=0, epoch=0, ranks=("c", "b", "a"),
            shards=(Shard(),) * 3,
        ),
    ]  # fmt: skip
    seen = views.fold(facts, views.View(worker="a"))
    assert seen.rank_hosts() == ("c", "h2", "h1")  # c named no host: a host of its own
