"""cohort.worker.pytorch.sync without Redis: state blobs, bucketed gradient averaging, local
SGD math.

Ranks are threads sharing a `FakeGroup` whose allreduce averages in float64 and casts back,
as `Collective` does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.worker.collective.redis_collective import (
    World,  # noqa: E402
    calls,  # noqa: E402
)
from cohort.worker.pytorch import sync as ct  # noqa: E402


class FakeGroup:
    """What N ranks' collectives share: contributions per call, a barrier per phase."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.lock = threading.Lock()
        self.calls: dict[tuple[str, int], dict[int, Any]] = {}
        self.log: list[tuple[str, int]] = []

    def run(self, body: Callable[[FakeCollective], Any]) -> list[Any]:
        """`body(collective)` on every rank in a thread of its own; their results by rank."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def rank_main(rank: int) -> None:
            try:
                results[rank] = body(FakeCollective(self, rank))
            except BaseException as exc:
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class FakeCollective:
    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group = group
        self.rank = rank

    def world(self) -> World:
        return World(1, self.rank, self.group.size)

    def _exchange(
        self, op: str, step: int, value: Any, result: Callable[[dict[int, Any]], Any]
    ) -> Any:
        """`result` of every rank's `value`, computed before any rank may go on (and write)."""
        with self.group.lock:
            self.group.calls.setdefault((op, step), {})[self.rank] = value
            if self.rank == 0:
                self.group.log.append((op, step))
        self.group.barrier.wait()
        out = result(self.group.calls[(op, step)])
        self.group.barrier.wait()
        return out

    def allreduce(
        self, tensors: Mapping[str, np.ndarray], step: int, world: int | None = None
    ) -> dict[str, np.ndarray]:
        def mean(got: dict[int, Any]) -> dict[str, np.ndarray]:
            return {
                name: (sum(got[r][name].astype(np.float64) for r in got) / len(got)).astype(
                    tensors[name].dtype
                )
                for name in tensors
            }

        return self._exchange("allreduce", step, dict(tensors), mean)  # type: ignore[no-any-return]

    def broadcast(
        self,
        tensors: Mapping[str, np.ndarray] | None,
        root: int,
        step: int,
        world: int | None = None,
    ) -> dict[str, np.ndarray]:
        def copy(got: dict[int, Any]) -> dict[str, np.ndarray]:
            return {k: np.array(v) for k, v in got[root].items()}

        out = self._exchange("broadcast", step, tensors, copy)
        for v in out.values():
            v.flags.writeable = False  # Collective hands receivers read-only views
        return out


class Mixed(torch.nn.Module):
    """Parameters and buffers of every dtype a user may train in."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 3).to(torch.bfloat16)
        self.c = torch.nn.Parameter(torch.randn(6, dtype=torch.float16))
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h.to(torch.bfloat16)).float().sum() + self.c.float().sum()


def trained(seed: int, steps: int = 3) -> tuple[Mixed, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Mixed()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 5)).backward()
        optimizer.step()
    return model, optimizer


def same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x, y), key
        elif isinstance(x, Mapping):
            same_state(x, y)
        elif isinstance(x, list) and x and isinstance(x[0], Mapping):
            for p, q in zip(x, y, strict=True):
                same_state(p, q)
        else:
            assert x == y, key


# ------------------------------------------------------------------ blobs
def test_state_blob_round_trips_model_and_optimizer_of_float32_float16_and_bfloat16() -> None:
    model, optimizer = trained(0)
    blob = ct.state_blob(model, optimizer)
    assert isinstance(blob, bytes)

    fresh, fresh_opt = trained(1, steps=1)
    ct.load_state_blob(fresh, fresh_opt, blob)

    same_state(model.state_dict(), fresh.state_dict())
    same_state(optimizer.state_dict(), fresh_opt.state_dict())
    assert fresh.b.weight.dtype == torch.bfloat16 and fresh.c.dtype == torch.float16
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)  # tuples stay tuples
    # The joiner continues exactly as the original would.
    x = torch.randn(8, 5)
    for m, o in ((model, optimizer), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).backward()
        o.step()
    same_state(model.state_dict(), fresh.state_dict())


def test_a_capture_packs_later_the_state_as_it_was_when_taken() -> None:
    """A checkpoint's state is copied as the step ends and packed on the writer's thread:
    the training that goes on meanwhile changes nothing of it."""
    model, optimizer = trained(0)
    want = ct.state_blob(model, optimizer, {"epoch": 3})
    packed = ct.state_capture(model, optimizer, {"epoch": 3})
    optimizer.zero_grad()  # one more step, in place
    model(torch.randn(8, 5)).backward()
    optimizer.step()
    assert ct.state_blob(model, optimizer, {"epoch": 3}) != want
    assert packed() == want


def test_a_capture_refuses_what_msgpack_cannot_carry_as_it_is_taken() -> None:
    model, optimizer = trained(0)
    optimizer.param_groups[0]["schedule"] = object()
    with pytest.raises(ct.StateError, match="param_groups/0/schedule"):
        ct.state_capture(model, optimizer)


def test_state_blob_of_a_model_alone_loads_without_an_optimizer() -> None:
    model, _ = trained(0)
    fresh, _ = trained(1, steps=0)
    ct.load_state_blob(fresh, None, ct.state_blob(model))
    same_state(model.state_dict(), fresh.state_dict())


def test_loading_optimizer_state_from_a_model_only_blob_is_refused() -> None:
    model, optimizer = trained(0)
    with pytest.raises(ct.StateError, match="no optimizer state"):
        ct.load_state_blob(model, optimizer, ct.state_blob(model))


def test_state_that_msgpack_cannot_carry_is_refused_naming_where_it_is() -> None:
    model, optimizer = trained(0)
    optimizer.param_groups[0]["schedule"] = object()
    with pytest.raises(ct.StateError, match="param_groups/0/schedule"):
        ct.state_blob(model, optimizer)


def test_arrays_without_the_meta_entry_are_refused() -> None:
    model, optimizer = trained(0)
    arrays = ct.state_tensors(model, optimizer)
    del arrays[ct.META]
    with pytest.raises(ct.StateError, match="__meta__"):
        ct.load_state_tensors(model, optimizer, arrays)


def test_broadcast_state_gives_every_rank_the_roots_model_and_optimizer() -> None:
    group = FakeGroup(3)

    states = [trained(seed=rank) for rank in range(3)]

    def body(c: FakeCollective) -> tuple[Any, Any]:
        model, optimizer = states[c.rank]
        ct.broadcast_state(model, optimizer, c, step=5, root=1)  # type: ignore[arg-type]
        return model.state_dict(), optimizer.state_dict()

    results = group.run(body)
    for model_state, optim_state in results:
        same_state(model_state, results[1][0])
        same_state(optim_state, results[1][1])
    assert group.log == [("broadcast", ct.call_id(5, ct.STATE))]


# ------------------------------------------------------------------ gradients
def test_buckets_keep_order_and_stay_under_the_limit_unless_one_tensor_is_bigger() -> None:
    named = [
        ("a", torch.zeros(10)),  # 40 bytes
        ("b", torch.zeros(10, dtype=torch.float16)),  # 20
        ("c", torch.zeros(10, dtype=torch.bfloat16)),  # 40: travels as float32
        ("d", torch.zeros(100)),  # 400: a bucket of its own
        ("e", torch.zeros(5)),  # 20
    ]
    got = [[name for name, _ in b] for b in ct.buckets(named, bucket_bytes=100)]
    assert got == [["a", "b", "c"], ["d"], ["e"]]
    assert [[n for n, _ in b] for b in ct.buckets(named, bucket_bytes=10**9)] == [
        ["a", "b", "c", "d", "e"]
    ]


def test_sync_gradients_gives_every_rank_the_mean_gradient_in_buckets() -> None:
    group = FakeGroup(2)
    inputs = [torch.randn(8, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    models = []
    for _ in range(2):  # built here: the threads would race on torch's global RNG
        torch.manual_seed(0)
        models.append(Mixed())

    def body(c: FakeCollective) -> dict[str, torch.Tensor]:
        model = models[c.rank]
        model(inputs[c.rank]).backward()
        ct.sync_gradients(model, c, step=3, bucket_bytes=64)  # type: ignore[arg-type]
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    results = group.run(body)
    expected = {}
    for rank in range(2):
        torch.manual_seed(0)
        model = Mixed()
        model(inputs[rank]).backward()
        for n, p in model.named_parameters():
            expected.setdefault(n, []).append(p.grad.double())
    for name, grads in expected.items():
        mean = (grads[0] + grads[1]) / 2
        for got in results:
            # one rounding to the parameter's dtype at the end (bfloat16 through float32)
            want = mean.float().to(got[name].dtype)
            assert torch.equal(got[name], want), name
    ids = [i for _, i in group.log]
    assert len(ids) > 1 and len(set(ids)) == len(ids)
    assert ids == [ct.call_id(3, ct.GRADIENTS, b) for b in range(len(ids))]


def test_a_parameter_without_gradient_counts_as_zero() -> None:
    group = FakeGroup(2)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 1) for _ in range(2)]

    def body(c: FakeCollective) -> torch.Tensor:
        layer = layers[c.rank]
        if c.rank == 0:
            layer(torch.ones(1, 3)).sum().backward()
        ct.sync_gradients(layer, c, step=0)  # type: ignore[arg-type]
        assert layer.weight.grad is not None
        return layer.weight.grad.clone()

    got = group.run(body)
    assert torch.equal(got[0], got[1])
    assert torch.allclose(got[0], torch.full((1, 3), 0.5))


@given(
    a=st.tuples(st.integers(0, 10**6), st.integers(0, 2), st.integers(0, calls.MAX_BUCKETS - 1)),
    b=st.tuples(st.integers(0, 10**6), st.integers(0, 2), st.integers(0, calls.MAX_BUCKETS - 1)),
)
def test_call_ids_are_negative_and_distinct(
    a: tuple[int, int, int], b: tuple[int, int, int]
) -> None:
    assert ct.call_id(*a) < 0
    assert (ct.call_id(*a) == ct.call_id(*b)) == (a == b)


# ------------------------------------------------------------------ local SGD
def run_local_sgd(
    group: FakeGroup, steps: int, **options: Any
) -> tuple[list[dict[str, torch.Tensor]], list[list[bool]]]:
    """Each rank trains a Linear on its own data with SGD and LocalSGD(**options)."""

    models = []
    for _ in range(group.size):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(4, 2))

    def body(c: FakeCollective) -> tuple[dict[str, torch.Tensor], list[bool]]:
        model = models[c.rank]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        local = ct.LocalSGD(model, c, **options)  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(100 + c.rank)
        synced = []
        for step in range(steps):
            optimizer.zero_grad()
            model(torch.randn(6, 4, generator=gen)).pow(2).mean().backward()
            optimizer.step()
            synced.append(local.step(step))
        return {n: p.detach().clone() for n, p in model.named_parameters()}, synced

    results = group.run(body)
    return [r[0] for r in results], [r[1] for r in results]


def test_local_sgd_averages_weights_every_h_steps_only() -> None:
    params, synced = run_local_sgd(FakeGroup(2), steps=6, sync_every=3)
    assert synced[0] == synced[1] == [False, False, True, False, False, True]
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name])
    # Between syncs the ranks drift apart.
    params, _ = run_local_sgd(FakeGroup(2), steps=4, sync_every=3)
    assert not torch.equal(params[0]["weight"], params[1]["weight"])


def test_diloco_with_outer_lr_1_and_no_momentum_equals_weight_averaging() -> None:
    weights, _ = run_local_sgd(FakeGroup(2), steps=6, sync_every=2)
    pseudo, _ = run_local_sgd(FakeGroup(2), steps=6, sync_every=2, mode="pseudo_gradient")
    for name in weights[0]:
        assert torch.allclose(weights[0][name], pseudo[0][name], atol=1e-6)
        assert torch.equal(pseudo[0][name], pseudo[1][name])


def test_diloco_outer_nesterov_step_follows_the_formula() -> None:
    group = FakeGroup(2)
    lr, mu = 0.7, 0.9
    start = torch.tensor([1.0, 2.0])
    locals_ = [[torch.tensor([0.5, 2.5]), torch.tensor([0.0, 1.0])], [start.clone(), start * 3]]

    def body(c: FakeCollective) -> list[torch.Tensor]:
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(start)
        local = ct.LocalSGD(
            model,
            c,  # type: ignore[arg-type]
            sync_every=1,
            mode="pseudo_gradient",
            outer_lr=lr,
            outer_momentum=mu,
            nesterov=True,
        )
        out = []
        for step in range(2):
            with torch.no_grad():
                model.weight.copy_(locals_[c.rank][step])
            local.step(step)
            out.append(model.weight.detach().clone().reshape(-1))
        return out

    got = group.run(body)
    # by hand: g = mean(global - local); buf = mu*buf + g; update = g + mu*buf
    glob, buf = start.clone(), None
    for step in range(2):
        g = sum(glob - locals_[r][step] for r in range(2)) / 2
        buf = g.clone() if buf is None else mu * buf + g
        glob = glob - lr * (g + mu * buf)
        for rank in range(2):
            assert torch.allclose(got[rank][step], glob, atol=1e-6)


def test_local_sgd_rejects_bad_settings() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="sync_every"):
        ct.LocalSGD(model, None, sync_every=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        ct.LocalSGD(model, None, sync_every=2, mode="mean")  # type: ignore[arg-type]


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_taking_over_the_optimizer_keeps_lr_schedulers_quiet_and_counting(
    scheduler_first: bool,
) -> None:
    """job.wrap takes over optimizer.step(): a scheduler built before or after it neither
    warns nor loses count (issue 32, papercut 7)."""
    import warnings

    from cohort.worker.pytorch.elastic import take_over

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    original = sgd.step

    def build() -> Any:
        return torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)

    schedule = build() if scheduler_first else None
    take_over(sgd, lambda: (calls.append("step"), original())[1])
    schedule = schedule or build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for _ in range(3):
            sgd.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            sgd.step()
            schedule.step()
    assert calls == ["step"] * 3
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


# ------------------------------------------------------------------ what travels with the weights
def test_extra_is_the_scripts_own_dict_in_both_directions() -> None:
    """What the script changes in `extra` is what a snapshot holds, and what a loaded
    snapshot brings is what the script's dict then reads (not a copy's)."""
    from cohort.worker.pytorch.elastic import TorchState

    model = torch.nn.Linear(2, 1)
    counters = {"epochs_done": 0}
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), extra=counters)
    counters["epochs_done"] = 3
    at_three = state.snapshot()
    counters["epochs_done"] = 5
    state.load(at_three)
    assert counters == {"epochs_done": 3}
    state.reset()
    assert counters == {"epochs_done": 0}


def scheduled(schedule: str) -> tuple[torch.optim.Optimizer, Any]:
    """SGD with momentum on a small model, and a scheduler of kind `schedule`."""
    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
    if schedule == "step":
        return sgd, torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    return sgd, torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=1.0, total_steps=10)


def settings(sgd: torch.optim.Optimizer, scheduler: Any) -> tuple[Any, ...]:
    group = sgd.param_groups[0]
    return scheduler.last_epoch, group["lr"], group["momentum"]


@pytest.mark.parametrize("schedule", ["step", "one-cycle"])
def test_a_step_cut_short_leaves_the_scheduler_where_it_was(schedule: str) -> None:
    """A world change cuts a step short after the script's `optimizer.step()` (which then
    applied nothing) and before its `scheduler.step()`: the scheduler step is undone, with
    the learning rate and momentum it set, so the schedule counts applied steps only."""
    from cohort.worker.pytorch.elastic import TorchState

    sgd, scheduler = scheduled(schedule)
    state = TorchState(torch.nn.Linear(2, 1), sgd, scheduler)
    sgd.step()
    scheduler.step()  # an applied step
    state.hold()  # the next one begins
    before = settings(sgd, scheduler)
    scheduler.step()  # ... and is cut short: this must not count
    assert settings(sgd, scheduler) != before
    state.unwind()
    assert settings(sgd, scheduler) == before
    scheduler.step()  # the step again, in the next world: as if nothing had happened
    twin, twin_scheduler = scheduled(schedule)
    for _ in range(2):
        twin.step()
        twin_scheduler.step()
    assert settings(sgd, scheduler) == settings(twin, twin_scheduler)


def test_a_step_s_seed_depends_on_the_seed_the_step_and_the_rank_only() -> None:
    from cohort.worker.pytorch.elastic import step_seed

    assert step_seed(7, 12, 1) == step_seed(7, 12, 1)  # the step redone draws alike
    seeds = {step_seed(seed, step, rank) for seed in (0, 7) for step in (0, 1) for rank in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2**64 for s in seeds)
    torch.manual_seed(step_seed(7, 12, 1))
    first = torch.rand(3)
    torch.manual_seed(step_seed(7, 12, 1))
    assert torch.equal(torch.rand(3), first)
