"""A constant global batch in PyTorch: micro-batches accumulated give the gradient of the
rank's whole share, weighted for the world's mean, and the script's code after each backward
sees what DDP with `no_sync` would show it (worker/pytorch/micro.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cohort.worker.pytorch.micro import MicroBatches  # noqa: E402


def share(
    sizes: tuple[int, ...],
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, MicroBatches]:
    """The share of 11 samples (the model, inputs and labels) and `job.batches()`'s
    MicroBatches under it, its step begun in micro-batches of `sizes`, the world being this
    rank alone (`on_last` scales by the step's weight)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    micro = MicroBatches(model, on_last=lambda: scale(model, 3 * sizes[-1] / 30))
    micro.begin_step(sizes)
    return model, x, y, micro


def trained_share(
    order: str, clip: float | None = None, sizes: tuple[int, ...] = (4, 4, 3)
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The share (`share`) in micro-batches of `sizes`, run as a script writes its loop
    (`order`: where it zeroes). The gradients after the step's last backward (clipped if
    `clip`), and what the script saw after each backward."""
    model, x, y, micro = share(sizes)
    seen: list[list[torch.Tensor]] = []
    start = 0
    for index, size in enumerate(sizes):
        micro.begin(index)
        if order != "zero last":
            model.zero_grad(set_to_none=order == "zero first")
        loss = torch.nn.functional.cross_entropy(
            model(x[start : start + size]), y[start : start + size]
        )
        loss.backward()
        seen.append([p.grad.clone() for p in model.parameters()])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        got = [p.grad.clone() for p in model.parameters()]
        if order == "zero last":
            model.zero_grad()
        micro.end()
        start += size
    micro.end_step()
    return got, seen


def scale(model: torch.nn.Module, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(factor)


def whole_share_gradient(clip: float | None = None) -> list[torch.Tensor]:
    """The share's summed gradient times n / total: its part of the world's mean."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    scale(model, 3 / 30)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("order", ["zero first", "zero last", "zero in place"])
def test_micro_batches_accumulate_to_the_share_s_gradient_times_its_weight(order: str) -> None:
    """Wherever the script zeroes its gradients, the step's last backward leaves the whole
    share's gradient, weighted for the world's mean; before it the script sees zeros."""
    got, seen = trained_share(order)
    for mine, whole in zip(got, whole_share_gradient(), strict=True):
        assert torch.allclose(mine, whole, atol=1e-6)
    for before_last in seen[:-1]:
        assert all(not g.any() for g in before_last)


def test_every_gradient_tensor_the_script_holds_stays_the_same_through_a_step() -> None:
    """A script that zeroes in place (an optimizer captured in a CUDA graph reads the
    `.grad` tensors it was captured with) sees zeros, then the world's mean, in the very
    tensors it started the step with: parking writes zeros into them, and the next
    backward accumulates into them again."""
    sizes = (4, 4, 3)
    model, x, y, micro = share(sizes)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    held = [p.grad for p in model.parameters()]
    start = 0
    for index, size in enumerate(sizes):
        micro.begin(index)
        model.zero_grad(set_to_none=False)
        batch = slice(start, start + size)
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        assert all(p.grad is mine for p, mine in zip(model.parameters(), held, strict=True))
        micro.end()
        start += size
    micro.end_step()
    for mine, whole in zip(held, whole_share_gradient(), strict=True):
        assert torch.allclose(mine, whole, atol=1e-6)


def test_two_backward_passes_in_a_micro_batch_accumulate_as_one() -> None:
    """A loop that calls backward() once per loss (here each half of a micro-batch) in the
    micro-batches before the last accumulates as with one backward of their sum. (In the
    last one the first backward averages over the world: the job refuses a second.)"""
    sizes = (4, 4, 3)
    model, x, y, micro = share(sizes)
    start = 0
    for index, size in enumerate(sizes):
        micro.begin(index)
        model.zero_grad()
        half = size // 2 if index < len(sizes) - 1 else size
        for part in ((start, start + half), (start + half, start + size)):
            if part[0] == part[1]:
                continue
            a, b = part
            loss = torch.nn.functional.cross_entropy(model(x[a:b]), y[a:b], reduction="sum")
            (loss / size).backward()
        micro.end()
        start += size
    micro.end_step()
    for mine, whole in zip(
        [p.grad for p in model.parameters()], whole_share_gradient(), strict=True
    ):
        assert torch.allclose(mine, whole, atol=1e-6)


def test_a_parameter_one_micro_batch_leaves_unused_keeps_what_the_others_gave_it() -> None:
    """A branch later micro-batches do not take (conditional computation) keeps the first
    micro-batch's gradient: a backward that leaves a parameter alone parks nothing over its
    accumulation."""
    import copy

    from cohort.worker.pytorch.micro import MicroBatches

    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    twin = copy.deepcopy(branch)
    micro = MicroBatches(torch.nn.ModuleList([trunk, branch]), on_last=lambda: None)
    micro.begin_step((2, 2, 2))
    x = torch.randn(6, 3)
    for index in range(3):
        micro.begin(index)
        out = trunk(x[2 * index : 2 * index + 2])
        (branch(out).mean() if index == 0 else out.mean()).backward()
        micro.end()
    micro.end_step()
    twin(trunk(x[:2]).detach()).mean().backward()  # micro-batch 0's part, carried to size 2
    for got, want in zip(branch.parameters(), twin.parameters(), strict=True):
        assert got.grad is not None and torch.allclose(got.grad, want.grad)


def test_a_clip_in_every_micro_batch_clips_the_step_s_whole_gradient_once() -> None:
    """`clip_grad_norm_` after each backward, as a plain loop has it, acts on the step's
    whole gradient only (before the last micro-batch it sees zeros, which it leaves)."""
    got, _ = trained_share("zero last", clip=0.05)
    clipped = whole_share_gradient(clip=0.05)
    assert torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in got])) == pytest.approx(
        0.05, rel=1e-5
    )
    for mine, whole in zip(got, clipped, strict=True):
        assert torch.allclose(mine, whole, atol=1e-6)


def test_a_scheduler_handed_over_steps_once_per_applied_update() -> None:
    """A scheduler stepped in every micro-batch, as a plain loop steps it, advances once per
    step's update; outside the micro-batches (an epoch scheduler) it steps as called."""
    from cohort.worker.pytorch.micro import MicroBatches, gate_scheduler

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda n: 1 / (n + 1))
    micro = MicroBatches(model, on_last=lambda: None)
    gate_scheduler(schedule, micro)
    for _ in range(2):  # two steps of three micro-batches
        micro.begin_step((2, 2, 2))
        for index in range(3):
            micro.begin(index)
            if micro.last:  # what job's optimizer.step() does
                sgd.step()
                micro.applied = True
            schedule.step()
            micro.end()
        micro.end_step()
    assert schedule.last_epoch == 2
    assert sgd.param_groups[0]["lr"] == pytest.approx(1 / 3)
    schedule.step()  # between epochs
    assert schedule.last_epoch == 3


def test_a_grad_scaler_handed_over_counts_updates_not_micro_batches() -> None:
    """unscale_, step and update act in a step's last micro-batch only: the growth count
    (and so the scale) follows updates, and an inf found there skips the step."""
    from cohort.worker.pytorch.micro import MicroBatches, gate_scaler

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    micro = MicroBatches(model, on_last=lambda: None)
    gate_scaler(scaler, micro)
    for _ in range(2):  # two steps of three micro-batches
        micro.begin_step((1, 1, 1))
        for index in range(3):
            micro.begin(index)
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            scaler.unscale_(sgd)
            scaler.step(sgd)
            scaler.update()
            sgd.zero_grad()
            micro.end()
        micro.end_step()
    assert scaler.get_scale() == 16.0  # grown once: after 2 updates, not 6 micro-batches
    assert scaler.state_dict()["_growth_tracker"] == 0


def test_a_loader_over_an_iterable_dataset_is_refused_by_name() -> None:
    from torch.utils.data import DataLoader, IterableDataset

    from cohort.worker.errors import WorkerError
    from cohort.worker.pytorch.loader import StepLoader

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(3))

    with pytest.raises(WorkerError, match="map-style dataset"):
        StepLoader(DataLoader(Stream()), worker=None)  # type: ignore[arg-type]


def test_a_learning_rate_in_a_tensor_is_compared_without_reading_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A captured or fused optimizer keeps its learning rate in a tensor on the GPU: the
    check for a scheduler that counts micro-batches sees a scheduler's in-place change, or
    a new tensor, without reading the value (which would wait for the device every
    micro-batch)."""
    from cohort.worker.pytorch.micro import learning_rates

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("read the tensor"))
    before = learning_rates(optimizer)
    assert learning_rates(optimizer) == before
    optimizer.param_groups[0]["lr"].fill_(0.05)  # as a scheduler sets a tensor's rate
    changed = learning_rates(optimizer)
    assert changed != before
    optimizer.param_groups[0]["lr"] = torch.tensor(0.05)
    assert learning_rates(optimizer) != changed
