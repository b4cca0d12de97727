"""How tensors reach the collective through Redis and come back (worker/pytorch/staging.py),
and the GPU-minded paths around it that run on CPU: the path a device takes, the CPU's
zero-copy views, the bucket's packing by dtype, LocalSGD's update on the weights' device,
one launch to scale the gradients, a recorded GPU figure read at the report.

The CUDA path itself (pinned buffers, side stream, events) needs a GPU: `python -m bench.gpu`
runs it (its "Redis route" row)."""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from cohort.worker.collective.layout import flatten  # noqa: E402
from cohort.worker.errors import CollectiveError, StateError  # noqa: E402
from cohort.worker.pytorch import staging as st  # noqa: E402
from cohort.worker.pytorch import sync  # noqa: E402
from cohort.worker.pytorch.elastic import ElasticJob  # noqa: E402
from cohort.worker.pytorch.overlap import OverlappedGradients  # noqa: E402


class Alone:
    """A world of one: the mean is what was sent (a new array, as Redis gives)."""

    def allreduce(
        self, tensors: Mapping[str, np.ndarray], step: int, world: int | None = None
    ) -> dict[str, np.ndarray]:
        return {name: np.array(a, copy=True) for name, a in tensors.items()}


def test_each_device_takes_its_path_to_the_host() -> None:
    assert st.path_for("cpu") == "views"
    assert st.path_for("cuda") == "pinned"
    assert st.path_for("mps") == st.path_for("meta") == "copies"
    assert type(st.staging_for(torch.device("cpu"))) is st.Staging


def test_cpu_gradients_go_to_the_collective_as_views_of_their_own_memory() -> None:
    """The Redis route's CPU speed: no copy out, and no copy back where the mean was
    written into them (the compressors do)."""
    f32, f16 = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.float16)
    bf16 = torch.ones(3, dtype=torch.bfloat16)
    staging = st.Staging()
    arrays = staging.to_host(0, [f32, f16, bf16])
    assert np.shares_memory(arrays[0], f32.numpy()) and arrays[0].shape == (2, 3)
    assert np.shares_memory(arrays[1], f16.numpy())
    assert arrays[2].dtype == np.float32  # bfloat16 is averaged in float32
    arrays[0][:] = 7.0  # a mean written in place ...
    staging.from_host(0, [f32, f16, bf16], [arrays[0], np.full(4, 2.0), np.full(3, 0.5)])
    assert f32.eq(7.0).all() and f16.eq(2.0).all() and bf16.eq(0.5).all()
    assert bf16.dtype == torch.bfloat16


def test_a_bucket_is_packed_per_dtype_it_is_averaged_in() -> None:
    tensors = [
        torch.zeros(2, 3),
        torch.zeros(4, dtype=torch.bfloat16),
        torch.zeros(5, dtype=torch.float16),
        torch.zeros(1),
    ]
    groups = st.groups_of(tensors)
    assert [(g.dtype, g.members, g.spans, g.size) for g in groups] == [
        (torch.float32, (0, 1, 3), ((0, 6), (6, 10), (10, 11)), 11),
        (torch.float16, (2,), ((0, 5),), 5),
    ]
    with pytest.raises(StateError, match="torch.int64"):
        st.groups_of([torch.zeros(2, dtype=torch.int64)])


def test_a_one_number_gpu_figure_is_read_at_the_report_anything_else_now() -> None:
    assert st.lands_later("cuda", 1)
    assert not st.lands_later("cuda", 4)  # refused as no number, at once
    assert not st.lands_later("cpu", 1)


class MetaStaging(st.Staging):
    """A device whose tensors hold no values (meta): zeros go out, and the means come back
    onto the tensors' own device, as the CUDA path does."""

    def to_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], ready: Sequence[Any] = ()
    ) -> list[np.ndarray]:
        return [np.zeros(tuple(t.shape), np.float32) for t in tensors]

    def from_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], means: Sequence[np.ndarray]
    ) -> None:
        for tensor, mean in zip(tensors, means, strict=True):
            tensor.copy_(torch.from_numpy(mean))


def test_local_sgd_pseudo_gradient_updates_weights_on_their_own_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 49 item 6: the outer update was made on the CPU and subtracted from CUDA
    weights. Weights on the meta device refuse a CPU operand just as CUDA ones do."""
    monkeypatch.setattr(sync, "staging_for", lambda device: MetaStaging())
    model = torch.nn.Linear(3, 2, device="meta")
    outer = sync.LocalSGD(
        model, Alone(), 1, mode="pseudo_gradient", outer_momentum=0.9, nesterov=True
    )  # type: ignore[arg-type]
    assert outer.step(0) and outer.step(1)
    assert {t.device.type for t in outer.global_params.values()} == {"meta"}
    assert {t.device.type for t in outer.momentum.values()} == {"meta"}
    assert {t.dtype for t in outer.momentum.values()} == {torch.float32}


def test_local_sgd_pseudo_gradient_on_cpu_still_moves_the_weights_by_the_mean() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    outer = sync.LocalSGD(model, Alone(), 1, mode="pseudo_gradient", outer_lr=0.5)  # type: ignore[arg-type]
    with torch.no_grad():
        model.weight.fill_(0.0)  # the inner steps moved it by -1
    outer.step(0)
    assert model.weight.eq(0.5).all()  # global 1 - 0.5 * (1 - 0)


def test_allreduce_of_tensors_gives_tensors_of_their_dtypes_back() -> None:
    got = sync.allreduce(
        Alone(),  # type: ignore[arg-type]
        {"a": torch.full((2,), 3.0), "b": torch.ones(3, dtype=torch.bfloat16)},
        step=0,
    )
    assert got["a"].tolist() == [3.0, 3.0] and got["b"].dtype == torch.bfloat16


def test_the_collective_refuses_a_device_tensor_naming_it_and_the_call_that_takes_it() -> None:
    with pytest.raises(CollectiveError, match=r"'g' is on meta.*cohort.torch.allreduce"):
        flatten({"g": torch.zeros(2, device="meta")})  # type: ignore[dict-item]


class Launches(TorchDispatchMode):
    """The operators called (each kernel launch a GPU would see, on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_scaling_the_gradients_is_one_launch_not_one_per_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with Launches() as seen:
        ElasticJob._scale(model, 0.5)
    assert seen.ops == ["_foreach_mul_"]
    assert all(p.grad.eq(0.5).all() for p in model.parameters())


class Marking(st.Staging):
    """Hands out a numbered mark where each gradient is made; records what each copy
    waited for."""

    def __init__(self) -> None:
        self.marks = 0
        self.waited: dict[Hashable, list[Any]] = {}
        self.lock = threading.Lock()

    def ready(self) -> Any:
        with self.lock:
            self.marks += 1
            return self.marks

    def to_host(
        self, slot: Hashable, tensors: Sequence[torch.Tensor], ready: Sequence[Any] = ()
    ) -> list[np.ndarray]:
        self.waited[slot] = list(ready)
        return super().to_host(slot, tensors, ready)


def test_overlapped_buckets_wait_for_where_backward_made_their_gradients() -> None:
    """On CUDA the averaging thread copies on a stream of its own: each bucket's copy must
    wait for the events its gradients' hooks recorded, not for its own thread's stream."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    marking = Marking()
    overlapped = OverlappedGradients(model, Alone(), 1, marking)  # type: ignore[arg-type]
    overlapped.begin(step=0, world=1, gate=lambda cancelled: True)
    model(torch.randn(5, 4)).sum().backward()
    overlapped.finish()
    assert sorted(slot for slot in marking.waited) == [0, 1, 2, 3]  # one tensor a bucket
    assert sorted(m for waited in marking.waited.values() for m in waited) == [1, 2, 3, 4]
    assert all(len(waited) == 1 for waited in marking.waited.values())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@cuda
def test_pinned_staging_takes_a_bucket_out_and_its_means_back_on_the_gpu() -> None:
    """The CUDA path (runs on a GPU only): the host sees the gradients' values, written on
    another stream before the copy; the means land in the gradients, bfloat16 rounded once;
    a mean the collective wrote into the pinned buffer itself is taken as it is."""
    device = torch.device("cuda", torch.cuda.current_device())
    staging = st.staging_for(device)
    assert isinstance(staging, st.PinnedStaging)
    producer = torch.cuda.Stream(device)
    with torch.cuda.stream(producer):  # made on a stream the copy must wait for
        grads = [
            torch.full((64, 64), 2.0, device=device),
            torch.full((3,), 0.5, device=device, dtype=torch.bfloat16),
        ]
        made = staging.ready()
    for step in range(2):  # the second step reuses the slot's buffers
        arrays = staging.to_host(0, grads, [made])
        assert arrays[0].shape == (64, 64) and float(arrays[0].min()) == 2.0 + step
        assert arrays[1].dtype == np.float32 and arrays[1].tolist() == [0.5 + step] * 3
        arrays[0] += 1.0  # a compressor's mean, written into the pinned buffer
        staging.from_host(0, grads, [arrays[0], arrays[1] + 1.0])
        made = staging.ready()
    torch.cuda.synchronize(device)
    assert grads[0].eq(4.0).all() and grads[1].dtype == torch.bfloat16
    assert grads[1].float().eq(2.5).all()


@cuda
def test_a_recorded_gpu_loss_lands_as_the_same_number() -> None:
    loss = torch.tensor(0.25, device="cuda") * 2
    assert float(st.Landing(loss)) == 0.5
