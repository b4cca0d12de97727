"""A model sharded before `job.wrap` (FSDP2's DTensor parameters) is refused there, by
name, with the route and the fix: before this, the Redis route died deep in the first state
copy (`.numpy() is not supported for tensor subclasses`), and a backend route trained on
a DeviceMesh the next world does not keep."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import fakeredis
import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from cohort.events import models as m  # noqa: E402
from cohort.events.errors import InvalidValueError  # noqa: E402
from cohort.worker.pytorch.elastic import (  # noqa: E402
    SHARD_GROUP_ENV,
    ElasticJob,
    TorchState,
    refuse_shard_setting,
    refuse_sharded,
    say_float_sums,
    shard_group_setting,
    sharded_parameters,
)
from cohort.worker.pytorch.sharded import (  # noqa: E402
    digest_of,
    group_names,
    optimizer_by_name,
)
from tests.unit.test_worker_client import JOB, Leader, fact  # noqa: E402


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.fixture
def sharded() -> Iterator[torch.nn.Module]:
    """An MLP `fully_shard`ed over a one-rank gloo group of this process (torch's own
    store: no world of cohort's)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = mlp()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))  # in place
        yield model
    finally:
        dist.destroy_process_group()


def joined(backend: str | None) -> ElasticJob:
    """An ElasticJob joined to a job whose leader is the test (no world yet)."""
    server = fakeredis.FakeServer()
    leader = Leader(server)
    leader.say(fact(m.JobConfigured, config=m.JobConfig(dataset_size=16, batch_size=4)))
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(
            ElasticJob,
            JOB,
            backend=backend,
            conn=fakeredis.FakeRedis(server=server),
            worker_id="w-me",
            signals=False,
        )
        leader.expect("Join")
        leader.say(fact(m.WorkerJoined, worker="w-me"))
        return joining.result(timeout=5)


def test_a_plain_model_has_no_sharded_parameters_and_is_not_refused() -> None:
    assert sharded_parameters(mlp()) == ()
    refuse_sharded((), None)
    refuse_sharded((), "gloo")


def test_fully_shard_makes_every_parameter_a_dtensor_that_is_named(
    sharded: torch.nn.Module,
) -> None:
    assert sharded_parameters(sharded) == ("0.weight", "0.bias", "2.weight", "2.bias")


@pytest.mark.parametrize(
    ("backend", "route"),
    [(None, "the Redis route (no backend)"), ("gloo", "the gloo route")],
)
def test_sharded_parameters_are_refused_naming_the_route_and_the_fix(
    backend: str | None, route: str
) -> None:
    with pytest.raises(InvalidValueError) as refused:
        refuse_sharded(("a.weight", "a.bias", "b.weight", "b.bias"), backend)
    said = str(refused.value)
    assert "4 of the model's parameters are sharded" in said
    assert "'a.weight', 'a.bias', 'b.weight', ..." in said
    assert route in said
    assert "Give job.wrap the model before fully_shard" in said
    assert "shard=lambda module, mesh: fully_shard(module, mesh=mesh)" in said
    assert "docs/sharded.md" in said


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_wrap_refuses_a_sharded_model_before_copying_its_state(
    sharded: torch.nn.Module, backend: str | None
) -> None:
    job = joined(backend)
    try:
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        with pytest.raises(InvalidValueError, match=r"sharded \(DTensor: '0.weight'"):
            job.wrap(sharded, optimizer)
        assert job.state is None  # refused before any state was taken
    finally:
        job.worker.stop()


def test_shard_is_refused_on_the_redis_route_naming_the_backend_to_give() -> None:
    with pytest.raises(InvalidValueError, match=r"Redis route .*backend='gloo'"):
        refuse_shard_setting(None, compressed=False, config=None)


def test_shard_is_refused_with_compression_and_with_exact_sums_asked_for_by_name() -> None:
    with pytest.raises(InvalidValueError, match="leave compression unset"):
        refuse_shard_setting("gloo", compressed=True, config=None)
    exact = m.JobConfig(
        dataset_size=64, batch_size=4, global_batch=16, placement="strided", reduction="exact"
    )
    with pytest.raises(InvalidValueError, match=r"--reduction exact: .* give the coordinator "
                       r"--reduction float"):  # fmt: skip
        refuse_shard_setting("gloo", compressed=False, config=exact)
    for config in (
        m.JobConfig(dataset_size=64, batch_size=4),
        m.JobConfig(dataset_size=64, batch_size=4, global_batch=16),  # micro-batches
        exact.model_copy(update={"reduction": "float"}),
        exact.model_copy(update={"reduction": None}),  # exact by default: warned of
    ):
        refuse_shard_setting("gloo", compressed=False, config=config)


def test_sums_exact_by_default_are_said_to_be_floating_point_for_a_sharded_model() -> None:
    by_default = m.JobConfig(dataset_size=64, batch_size=4, global_batch=16, placement="strided")
    assert by_default.exact
    with pytest.warns(UserWarning, match=r"sharded model's gradient sums are floating point.*"
                      r"--reduction float"):  # fmt: skip
        say_float_sums(by_default)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns
        say_float_sums(None)
        say_float_sums(m.JobConfig(dataset_size=64, batch_size=4, global_batch=16))
        say_float_sums(by_default.model_copy(update={"reduction": "float"}))


def test_wrap_with_shard_on_the_redis_route_is_refused_before_any_state_is_taken() -> None:
    job = joined(None)
    try:
        model = mlp()
        with pytest.raises(InvalidValueError, match="job.wrap\\(shard=...\\)"):
            job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), shard=fully_shard)
        assert job.state is None
    finally:
        job.worker.stop()


def test_the_whole_model_digest_is_the_unsharded_state_s() -> None:
    """A sharded world's digest (of its gathered state dict) equals what an unsharded rank
    reports for the same weights: checkpoints and the journal compare them."""
    model = mlp()
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert digest_of(model.state_dict()) == state.digest()


def test_the_optimizer_state_is_named_by_parameter_as_a_gathered_one_is() -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(
        [{"params": [model[0].weight, model[0].bias]}, {"params": list(model[2].parameters())}],
        lr=0.01,
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    names = group_names(model, optimizer)
    assert names == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    named = optimizer_by_name(optimizer, names)
    assert set(named["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert torch.equal(
        named["state"]["2.bias"]["exp_avg"], optimizer.state[model[2].bias]["exp_avg"]
    )
    assert [g["params"] for g in named["param_groups"]] == names
    assert named["param_groups"][1]["lr"] == 0.01


@pytest.mark.parametrize("given", [0, -2, 1.5, "2", True])
def test_a_shard_group_that_is_not_a_positive_integer_is_refused_by_name(given: object) -> None:
    with pytest.raises(InvalidValueError, match=rf"wrap\(shard_group={given!r}\): .*positive"):
        shard_group_setting(given, sharded=True)  # type: ignore[arg-type]


def test_the_shard_group_comes_from_the_environment_checked_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SHARD_GROUP_ENV, "4")
    assert shard_group_setting(None, sharded=True) == 4
    assert shard_group_setting(2, sharded=True) == 2  # wrap's own wins
    monkeypatch.setenv(SHARD_GROUP_ENV, "two")
    with pytest.raises(InvalidValueError, match=r"\$COHORT_SHARD_GROUP='two': .*positive"):
        shard_group_setting(None, sharded=True)
    monkeypatch.delenv(SHARD_GROUP_ENV)
    assert shard_group_setting(None, sharded=True) is None  # FSDP over every rank


def test_the_job_s_journaled_shard_group_is_every_rank_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--shard-group` is journaled (JobConfig.shard_group): a rank takes it where it names
    none, and one that names another, or does not shard at all, is refused with the fix
    (every rank of a job trains the same way)."""
    monkeypatch.delenv(SHARD_GROUP_ENV, raising=False)
    config = m.JobConfig(shard_group=2)
    assert shard_group_setting(None, sharded=True, config=config) == 2
    assert shard_group_setting(2, sharded=True, config=config) == 2
    with pytest.raises(InvalidValueError, match=r"shard_group=4\), but the job shards in groups "
                       r"of 2 .*--shard-group 4"):  # fmt: skip
        shard_group_setting(4, sharded=True, config=config)
    monkeypatch.setenv(SHARD_GROUP_ENV, "4")
    with pytest.raises(InvalidValueError, match=r"\$COHORT_SHARD_GROUP='4', but the job"):
        shard_group_setting(None, sharded=True, config=config)
    with pytest.raises(InvalidValueError, match=r"groups of 2 ranks .* has no shard="):
        shard_group_setting(None, sharded=False, config=config)
    assert shard_group_setting(None, sharded=True, config=m.JobConfig()) == 4  # not journaled


def test_a_shard_group_without_a_shard_function_is_refused_with_the_fix() -> None:
    with pytest.raises(InvalidValueError, match=r"shard_group=2\) without shard=.*shard function"):
        shard_group_setting(2, sharded=False)
