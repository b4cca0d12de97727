"""A model's buffers, `extra` tensors, generators and saved weights on every path a training
state takes (issue 49): BatchNorm's running statistics and its 0-dim integer count in the
digest, blobs and broadcasts; the step-end sync that gives every rank the same buffers; a
cut-short step's forward undone; `extra` tensors kept where the script keeps them; the CUDA
generator only where CUDA is in use; `job.save` files that a CPU-only machine loads.

Ranks are threads sharing tests/unit/test_torch_state.py's `FakeGroup`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.worker.pytorch import elastic  # noqa: E402
from cohort.worker.pytorch import sync as ct  # noqa: E402
from cohort.worker.pytorch.elastic import TorchState  # noqa: E402
from tests.unit.test_torch_state import FakeCollective, FakeGroup  # noqa: E402


def batchnormed(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def state_of(model: torch.nn.Module, extra: dict[str, Any] | None = None) -> TorchState:
    return TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), extra=extra)


def forward(model: torch.nn.Module, seed: int, rows: int = 16) -> None:
    """A training forward: BatchNorm's running statistics and count move."""
    model.train()
    model(torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed)))


def bn(model: torch.nn.Module) -> torch.nn.BatchNorm1d:
    norm = model[1]
    assert isinstance(norm, torch.nn.BatchNorm1d)
    return norm


# ------------------------------------------------------------------ every path a buffer takes
def test_the_digest_covers_batchnorm_s_0_dim_integer_count() -> None:
    model = batchnormed()
    state = state_of(model)
    before = state.digest()  # a 0-dim int64 buffer: no "cannot view Long as Byte"
    bn(model).num_batches_tracked += 1
    assert state.digest() != before


def test_a_batchnorm_model_s_buffers_travel_in_blobs_and_broadcasts() -> None:
    source = batchnormed(0)
    forward(source, 1)
    blob = ct.state_blob(source, None)
    taken = batchnormed(1)
    ct.load_state_blob(taken, None, blob)
    assert taken.state_dict().keys() == source.state_dict().keys()
    for key, value in source.state_dict().items():
        assert torch.equal(taken.state_dict()[key], value), key
    assert bn(taken).num_batches_tracked.dim() == 0

    models = [source, batchnormed(2)]
    states = [state_of(m) for m in models]
    FakeGroup(2).run(lambda c: states[c.rank].broadcast(c, step=3, world=1))  # type: ignore[arg-type]
    assert states[1].digest() == states[0].digest()


# ------------------------------------------------------------------ the step-end sync
def ranks_forwarded(sizes: list[int]) -> list[torch.nn.Module]:
    """One model per rank, alike at the step's start; each rank's forward of its own
    samples moved its statistics (a rank without samples ran none)."""
    models = [batchnormed(0) for _ in sizes]
    for rank, (model, rows) in enumerate(zip(models, sizes, strict=True)):
        if rows:
            forward(model, seed=rank + 10, rows=rows)
    return models


def synced(models: list[torch.nn.Module], sizes: list[int], step: int = 4) -> FakeGroup:
    group = FakeGroup(len(models))

    def body(c: FakeCollective) -> None:
        ct.sync_buffers(models[c.rank], c, step, sizes[c.rank], world=1)  # type: ignore[arg-type]

    group.run(body)
    return group


def test_the_step_end_sync_gives_every_rank_the_sample_weighted_mean_and_rank_0_s_count() -> None:
    sizes = [6, 2, 0]
    models = ranks_forwarded(sizes)
    bn(models[0]).num_batches_tracked.fill_(5)  # the counts differ: rank 0's is taken
    means = [bn(m).running_mean.clone() for m in models]
    variances = [bn(m).running_var.clone() for m in models]
    bn(models[2]).running_var[0] = float("inf")  # a rank without samples counts for nothing
    synced(models, sizes)
    expected_mean = (6 * means[0].double() + 2 * means[1].double()) / 8
    expected_var = (6 * variances[0].double() + 2 * variances[1].double()) / 8
    for model in models:
        assert torch.allclose(bn(model).running_mean.double(), expected_mean, atol=1e-7)
        assert torch.allclose(bn(model).running_var.double(), expected_var, atol=1e-7)
        assert int(bn(model).num_batches_tracked) == 5
        assert bn(model).num_batches_tracked.dtype == torch.int64
    digests = {state_of(m).digest() for m in models}
    assert len(digests) == 1


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=8, max_size=8
    ),
    count=st.integers(0, 2**40),
    ranks=st.integers(1, 5),
    rows=st.integers(1, 1000),
)
def test_ranks_that_agree_keep_their_buffers_bit_for_bit(
    values: list[float], count: int, ranks: int, rows: int
) -> None:
    models = [batchnormed(0) for _ in range(ranks)]
    for model in models:
        bn(model).running_mean.copy_(torch.tensor(values))
        bn(model).num_batches_tracked.fill_(count)
    before = models[0].state_dict()
    before = {k: v.clone() for k, v in before.items()}
    synced(models, [rows] * ranks)
    for model in models:
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key


def test_a_model_without_buffers_makes_no_call() -> None:
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    group = synced(models, [4, 4])  # type: ignore[arg-type]
    assert group.log == []


def test_buffers_registered_not_persistent_stay_each_rank_s_own() -> None:
    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(3), persistent=False)
            self.norm = torch.nn.BatchNorm1d(3)

    models = [Cached() for _ in range(2)]
    models[1].cache.fill_(7.0)
    assert [n for n, _ in ct.state_buffers(models[0])] == [
        "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"
    ]  # fmt: skip
    synced(models, [1, 1])  # type: ignore[arg-type]
    assert float(models[1].cache.sum()) == 21.0  # outside the digest, the checkpoint and the sync


def test_a_cut_short_step_puts_back_the_buffers_its_forward_moved() -> None:
    model = batchnormed()
    forward(model, seed=1)
    state = state_of(model)
    held = {k: v.clone() for k, v in model.state_dict().items()}
    digest = state.digest()
    state.hold()  # the step begins
    forward(model, seed=2)
    assert state.digest() != digest
    state.unwind()  # a world change cut it short: it comes again
    assert state.digest() == digest
    for key, value in model.state_dict().items():
        assert torch.equal(value, held[key]), key


# ------------------------------------------------------------------ extra tensors
def test_extra_tensors_from_a_world_start_or_a_checkpoint_land_in_the_script_s_own() -> None:
    ema = batchnormed(0)
    extra: dict[str, Any] = {"ema": ema.state_dict(), "seen": torch.tensor(0)}
    state = state_of(batchnormed(0), extra)
    source = batchnormed(3)
    forward(source, seed=4)
    sent: dict[str, Any] = {"ema": source.state_dict(), "seen": torch.tensor(9)}
    blob = state_of(source, sent).snapshot()
    live = extra["seen"]
    state.load(blob)
    assert extra["seen"] is live and int(live) == 9  # the script's tensor, on its device
    for key, value in source.state_dict().items():
        assert torch.equal(ema.state_dict()[key], value), key  # the EMA model itself moved


def test_an_extra_tensor_of_another_shape_lands_on_the_device_of_the_one_it_replaces() -> None:
    live = {"ema": {"w": torch.empty(3, device="meta")}, "steps": [torch.empty(2, device="meta")]}
    got = elastic.in_place({"ema": {"w": torch.ones(4)}, "steps": [torch.ones(2)]}, live)
    assert got["ema"]["w"].device.type == "meta" and got["ema"]["w"].shape == (4,)
    assert got["steps"][0] is live["steps"][0]
    assert elastic.in_place({"new": torch.ones(1)}, {})["new"].device.type == "cpu"


# ------------------------------------------------------------------ generators
class FakeCuda:
    """torch.cuda's generator facts: whether a GPU exists, whether this process opened it."""

    def __init__(self, available: bool, initialized: bool) -> None:
        self.available, self.initialized = available, initialized
        self.state = torch.tensor([1, 2, 3], dtype=torch.uint8)
        self.set: list[torch.Tensor] = []

    def is_available(self) -> bool:
        return self.available

    def is_initialized(self) -> bool:
        return self.initialized

    def get_rng_state(self) -> torch.Tensor:
        assert self.initialized, "asked an uninitialised CUDA: a context on every GPU"
        return self.state

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.set.append(state)


@pytest.mark.parametrize(
    ("available", "initialized", "travels"),
    [(True, True, True), (True, False, False), (False, False, False)],
)
def test_the_cuda_generator_travels_only_where_this_process_uses_cuda(
    available: bool, initialized: bool, travels: bool
) -> None:
    cuda = FakeCuda(available, initialized)
    states = elastic.rng_states(cuda)
    assert ("cuda_rng" in states) is travels
    assert torch.equal(states["rng"], torch.get_rng_state())
    elastic.take_rng_states({"cuda_rng": torch.tensor([7], dtype=torch.uint8)}, cuda)
    assert len(cuda.set) == (1 if travels else 0)


def test_a_gpu_job_s_checkpoint_loads_where_no_gpu_is(monkeypatch: pytest.MonkeyPatch) -> None:
    model = batchnormed()
    monkeypatch.setattr(elastic.torch, "cuda", FakeCuda(True, True))
    blob = state_of(model).snapshot()  # carries the CUDA generator
    monkeypatch.undo()
    assert "cuda_rng" in ct.load_state_blob(batchnormed(), None, blob)
    state_of(batchnormed()).load(blob)  # this process has no GPU: the CPU's generator only


# ------------------------------------------------------------------ job.save's file
@pytest.fixture
def tagged_cuda() -> Iterator[set[int]]:
    """torch.save tags the storages whose addresses the test adds as "cuda:0", as it tags a
    GPU tensor's: a file holding them does not load where CUDA is not."""
    addresses: set[int] = set()

    def tag(storage: Any) -> str | None:
        return "cuda:0" if storage.data_ptr() in addresses else None

    entry = (0, tag, lambda obj, location: None)
    torch.serialization.register_package(*entry)
    yield addresses
    torch.serialization._package_registry.remove(entry)  # no public way to unregister


def test_job_save_writes_weights_a_cpu_only_process_loads(
    tagged_cuda: set[int], tmp_path: Path
) -> None:
    model = batchnormed()
    forward(model, seed=1)
    tagged_cuda.update(t.data_ptr() for t in model.state_dict().values())  # "on the GPU"
    saved = tmp_path / "final.pt"
    saved.write_bytes(elastic.weights_file(model))
    load = "import sys, torch; print(sorted(torch.load(sys.argv[1], map_location=None)))"
    done = subprocess.run(
        [sys.executable, "-c", load, str(saved)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = torch.load(saved)
    assert loaded.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert loaded[key].device.type == "cpu" and torch.equal(loaded[key], value), key
    fresh = batchnormed(5)
    fresh.load_state_dict(loaded)  # state_dict's metadata kept: BatchNorm's version too


# ------------------------------------------------------------------ a rank without samples
def test_a_rank_without_samples_trains_the_first_sample_twice_on_cleared_gradients() -> None:
    """The stand-in batch is the loader's collation of the data set's first sample, twice
    (BatchNorm refuses a batch of one); the gradients the step before left are zeroed in
    the tensors the script (or a captured optimizer) holds."""
    model = batchnormed()
    forward(model, seed=1)
    torch.nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1)).backward()
    held = [p.grad for p in model.parameters()]
    assert all(g is not None and bool(g.abs().sum()) for g in held)
    job = SimpleNamespace(state=state_of(model))
    data = torch.utils.data.TensorDataset(torch.randn(3, 4), torch.randn(3, 1))
    x, y = elastic.ElasticJob._stand_in(job, data, torch.utils.data.default_collate)  # type: ignore[arg-type]
    assert torch.equal(x, torch.stack([data[0][0]] * 2))
    assert torch.equal(y, torch.stack([data[0][1]] * 2))
    assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))
    assert all(g is not None and not bool(g.abs().sum()) for g in held)


@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_a_weight_of_zero_writes_zeros_where_inf_times_zero_would_be_nan(factor: float) -> None:
    """A stand-in's gradients weigh 0 in the world's mean: an overflow in them (fp16)
    must add nothing, not NaN, to every rank's sum."""
    grads = [torch.tensor([float("inf"), 2.0]), torch.tensor([float("nan")])]
    ct.weigh_(grads, factor)
    if factor == 0.0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    else:
        assert grads[0].tolist() == [float("inf"), 1.0] and grads[1].isnan().all()
