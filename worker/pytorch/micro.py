"""A step's micro-batches as the script sees them: what DDP with `no_sync` and Accelerate's
`sync_gradients` show, whatever the number of micro-batches the job deals this rank.

A constant global batch comes to a rank as one or more micro-batches (their count follows
the world size), and the script's loop runs once per micro-batch. After each backward the
script's own code runs (`clip_grad_norm_`, a NaN check, gradient logging, a GradScaler's
`unscale_`), and it must act on what DDP would show it: zeros-and-nothing-applied before
the step's last micro-batch, the world's mean after it. So at the end of every backward
but the last, the gradients accumulated so far are parked out of the script's sight (the
script sees zeros), and the next backward takes them back as it accumulates; at the end of
the last backward the `on_last` callback makes the gradients the world's mean before
`backward()` returns.

The arithmetic is the accumulation's own: after micro-batch i the gradients hold W / m_i
(W: the sum of every sample's gradient so far, m: the micro-batch sizes, the loss a mean
over each); as micro-batch i+1 begins they are rescaled to W / m_(i+1), so that its
backward adds its own mean at the right weight, and taken back by that backward's own
addition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cohort.worker.pytorch.exact import ExactSum
from cohort.worker.pytorch.tree import TreeSum


class MicroBatches:
    """The micro-batches of the current step of `model`'s training, and the gradients
    parked between them; `on_last()` runs as the step's last backward ends."""

    def __init__(
        self,
        model: torch.nn.Module,
        on_last: Callable[[], None],
        exact: ExactSum | TreeSum | None = None,
    ) -> None:
        self.on_last = on_last
        self.exact = exact
        """Exact sums (docs/guarantees.md): each backward's gradients go into the step's
        sums at once, weighted by the micro-batch's share of the global batch, and nothing
        is parked: integers through Redis (worker/pytorch/exact.py), a fixed tree on gloo
        and NCCL (worker/pytorch/tree.py), whose last backward hands each tensor over as
        it is made."""
        self.shares: tuple[float, ...] = ()
        """Each micro-batch's share of the step's global batch (exact sums)."""
        self.standing_in = False
        """Whether this step is a stand-in: the rank has no sample in it, and trains one
        batch whose gradients count for nothing, so that the script's whole step (its
        clipping, scaler, scheduler) runs on every rank alike."""
        self.index, self.count = 0, 1
        self.sizes: tuple[int, ...] = ()
        self.inside = False
        """Whether the script is inside one of a step's micro-batches (between the job
        giving it a batch and asking for the next)."""
        self.applied = False
        """Whether this micro-batch's `optimizer.step()` applied an update."""
        self.backward_done = False
        """Whether this micro-batch's backward ran (and so its end was handled)."""
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._parked: dict[int, torch.Tensor] = {}
        self._queued = False
        self._lock = threading.Lock()
        for param in self._params:
            param.register_hook(self._hook_for(param))
            param.register_post_accumulate_grad_hook(self._accumulated)

    @property
    def last(self) -> bool:
        """Whether this micro-batch is its step's last: its `optimizer.step()` applies."""
        return self.index >= self.count - 1

    @property
    def syncing(self) -> bool:
        """Whether the gradients the script sees are the world's mean and an update may
        apply: in a step's last micro-batch, and outside the micro-batches."""
        return not self.inside or self.last

    @property
    def updated(self) -> bool:
        """Whether a once-per-update step may go: after an `optimizer.step()` that applied
        the update, or outside the micro-batches (between epochs)."""
        return not self.inside or self.applied

    @property
    def trained(self) -> Sequence[torch.Tensor]:
        """The parameters that take gradients, in the model's order (the exact sums')."""
        return self._params

    def begin_step(self, sizes: tuple[int, ...], total: int = 0) -> None:
        """A step of micro-batches of `sizes` samples, of a global batch of `total`; no
        sizes: a stand-in step (`standing_in`), one batch that adds nothing to the sums."""
        self.sizes, self.count, self.standing_in = sizes, max(len(sizes), 1), not sizes
        self.shares = tuple(size / total if total else 0.0 for size in sizes)
        self._parked.clear()

    def begin(self, index: int) -> None:
        """Micro-batch `index` of the step is given to the script: what the ones before it
        accumulated is rescaled for its size."""
        if index > 0:
            self._rescale_parked(self.carry(index - 1))
        self.index, self.inside = index, True
        self.applied = self.backward_done = False

    def end(self) -> None:
        """The script asked past the micro-batch (or the step ended)."""
        self.inside = False

    def end_step(self) -> None:
        self.index, self.count, self.inside, self.standing_in = 0, 1, False, False
        self._parked.clear()

    def carry(self, index: int) -> float:
        """The factor that turns gradients of weight 1 / m_index into 1 / m_(index+1)."""
        return self.sizes[index] / self.sizes[index + 1]

    # ------------------------------------------------------------ backward's side
    def _hook_for(self, param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor | None]:
        key = id(param)

        def take_back(grad: torch.Tensor) -> torch.Tensor | None:
            """Before this backward accumulates into `param`: the parked gradient replaces
            the script's zeros in the tensor the script holds, and the backward adds to it
            in place; where the script dropped that tensor (`zero_grad()` to None), the
            parked gradient joins the new one."""
            parked = self._parked.pop(key, None)
            if parked is None:
                return None
            held = param.grad
            if held is None:
                return grad + parked
            held.copy_(parked)
            return None

        return take_back

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self.inside:
            return  # outside the step's micro-batches (an evaluation's)
        exact, grad = self.exact, param.grad
        taking = self.last and not (self.backward_done or self.standing_in)
        if isinstance(exact, TreeSum) and grad is not None and taking:
            # the step's last backward: its sums go to the world bucket by bucket
            exact.take(self._index[id(param)], grad, self._share())
        if self._queued:
            return
        with self._lock:  # the first parameter of a backward: queue its end once
            if self._queued:
                return
            self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        with self._lock:
            self._queued = False
        self.backward_done = True
        if self.exact is not None and not self.standing_in:  # a stand-in's: nothing to add
            self._summed()
        if self.last:
            self.restore()  # what parameters this backward left alone had accumulated
            self.on_last()
        elif self.exact is None:
            self._park()

    def _summed(self) -> None:
        """Exact sums: this backward's gradients into the step's sums, and zeros in their
        place (the tensors themselves: they keep their identity through the step), but in
        the last micro-batch, where the step's sum overwrites them."""
        assert self.exact is not None
        grads = [param.grad for param in self._params]
        self.exact.add(grads, self._share(), self.index)  # but what the hooks took
        if self.last:
            return
        with torch.no_grad():
            for grad in grads:
                if grad is not None:
                    grad.zero_()

    def _share(self) -> float:
        return self.shares[self.index] if self.index < len(self.shares) else 0.0

    def _park(self) -> None:
        """Keep the gradients so far and show the script zeros: nothing it does before the
        next backward touches the accumulation (a second backward in this micro-batch takes
        it back and adds to it, as a plain loop's would). The zeros are written into the
        gradient tensors themselves: every `.grad` keeps its identity through the step, as
        an optimizer captured in a CUDA graph (or DDP's bucket views) needs."""
        with torch.no_grad():
            for param in self._params:
                grad = param.grad
                if grad is None or id(param) in self._parked:
                    continue  # no gradient, or one this backward left alone (still parked)
                self._parked[id(param)] = grad.clone()
                grad.zero_()

    def _rescale_parked(self, factor: float) -> None:
        if factor == 1.0:
            return
        with torch.no_grad():
            for parked in self._parked.values():
                parked.mul_(factor)

    def restore(self) -> None:
        """Put the parked gradients back where the script (or a step's end) reads them: as
        the last backward ends, those of parameters it left alone; at the step's update, all
        of them if the last micro-batch ran no backward."""
        with torch.no_grad():
            for param in self._params:
                parked = self._parked.pop(id(param), None)
                if parked is None:
                    continue
                if param.grad is None:
                    param.grad = parked
                else:
                    param.grad.copy_(parked)  # into the tensor the script holds


@dataclass(frozen=True, eq=False)
class TensorRate:
    """A learning rate kept in a tensor (a captured or fused optimizer's), as it stands: the
    tensor and its version, which every in-place change (a scheduler's `fill_`) bumps.
    Compared without reading the value, so without waiting for its device."""

    tensor: torch.Tensor
    version: int

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorRate)
            and other.tensor is self.tensor
            and other.version == self.version
        )

    def __hash__(self) -> int:
        return hash((id(self.tensor), self.version))


def learning_rates(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Each parameter group's learning rate as it stands, to compare with a later one: a
    number, or a `TensorRate`."""
    return tuple(
        TensorRate(lr, lr._version) if torch.is_tensor(lr) else lr
        for lr in (group["lr"] for group in optimizer.param_groups)
    )


def gate_scheduler(scheduler: Any, micro: MicroBatches) -> None:
    """`scheduler.step()` from now on steps only where `micro.updated`: after an
    `optimizer.step()` that applied the update, or outside a step's micro-batches (an epoch
    scheduler's). Accelerate's prepared scheduler does the same. The scheduler's class is
    replaced by a subclass of it: an attribute of the instance would travel in its
    state_dict (a scheduler's state is its `__dict__`)."""
    base = type(scheduler)

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not micro.updated:
            return None
        return base.step(self, *args, **kwargs)

    scheduler.__class__ = type(
        base.__name__, (base,), {"step": step, "__module__": base.__module__}
    )


def gate_scaler(scaler: Any, micro: MicroBatches) -> None:
    """A `torch.amp.GradScaler`'s `unscale_`, `step` and `update` act only in a step's last
    micro-batch: before it the script's gradients are zeros, and the scale and its growth
    count follow updates, not micro-batches (whose number follows the world size)."""
    for name in ("unscale_", "step", "update"):
        own = getattr(scaler, name)

        def gated(*args: Any, _own: Callable[..., Any] = own, **kwargs: Any) -> Any:
            if not micro.syncing:
                return None
            return _own(*args, **kwargs)

        setattr(scaler, name, gated)
