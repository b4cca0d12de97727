"""Gradients averaged through Redis while backward still runs, bucket by bucket, as DDP does.

Buckets hold parameters in the reverse of their registration order, since backward
produces the last layers' gradients first. A hook on each parameter counts its bucket down
as its gradient is accumulated; one thread per process averages the buckets strictly in
index order (every rank in the same order, so no two ranks ever wait on each other's
different buckets), each as soon as it is whole. Before the first, the step's `gate`
says whether it may start at all (the elastic loop's `launchable`: the previous step
settled and this one is still the job's), so a rank never pours a stale step's gradients
into the others'. `finish()` completes whatever backward left (a parameter without a
gradient counts as zeros), waits, and writes the means into the gradients; `cancel()`
starts nothing more, waits for what runs, and drops it (the step is not applied).
Needs torch (`cohort.torch`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cohort.worker.collective.redis_collective import Collective
from cohort.worker.errors import AccumulationError, WorldChangedError
from cohort.worker.pytorch.staging import Staging, staging_for
from cohort.worker.pytorch.sync import GRADIENTS, buckets, call_id


class OverlappedGradients:
    """The gradients of `model`'s trainable parameters, averaged during backward."""

    def __init__(
        self,
        model: torch.nn.Module,
        collective: Collective,
        bucket_bytes: int,
        staging: Staging | None = None,
    ):
        self.collective = collective
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.staging = staging or staging_for(
            trainable[0][1].device if trainable else torch.device("cpu")
        )
        """How the gradients reach the host and come back (worker/pytorch/staging.py)."""
        self.buckets = [[p for _, p in bucket] for bucket in buckets(trainable[::-1], bucket_bytes)]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._cond = threading.Condition()
        self._step: tuple[int, int] | None = None  # (step, world) averaged now
        self._gate: Callable[[threading.Event], bool] = lambda cancelled: True
        self._left: list[int] = []  # gradients each bucket still waits for
        self._ready: list[list[Any]] = []  # per bucket: what its reads wait for (CUDA events)
        self._flush = False  # finish(): average what is left, whole or not
        self._cancelled = threading.Event()  # cancel(): start nothing more
        self._means: list[list[np.ndarray] | None] = []
        self._done = 0  # buckets averaged (or given up) of the current step
        self._error: BaseException | None = None
        self._again = False
        for _, param in trainable:
            param.register_post_accumulate_grad_hook(self._accumulated)
        threading.Thread(target=self._run, name="cohort-gradients", daemon=True).start()

    # ------------------------------------------------------------ the training loop's side
    def begin(self, step: int, world: int, gate: Callable[[threading.Event], bool]) -> None:
        """Gradients from now on are `step`'s, in `world` (the previous step is closed);
        its buckets are averaged once `gate(cancelled)` says the step may start (it may
        block until it can tell, and should give up once `cancelled` is set)."""
        self.cancel()
        with self._cond:
            self._step, self._gate = (step, world), gate
            self._left = [len(b) for b in self.buckets]
            self._ready = [[] for _ in self.buckets]
            self._means = [None] * len(self.buckets)
            self._flush, self._done, self._error, self._again = False, 0, None, False
            self._cancelled.clear()
            self._cond.notify_all()

    def finish(self) -> None:
        """Average what backward did not trigger, wait for every bucket, and write the means
        into the gradients. Raises WorldChangedError if the step may not count (its world
        moved on, or the gate closed it)."""
        with self._cond:
            self._flush = True
            self._cond.notify_all()
        self._wait_done()
        with self._cond:
            step, error, means = self._step, self._error, self._means
            self._step = None
        assert step is not None, "finish() after begin()"
        if self._again:
            raise AccumulationError(
                "a gradient was accumulated again after its bucket was averaged (several "
                "backward passes in one step): pass overlap=False to job.wrap() to accumulate"
            )
        if isinstance(error, WorldChangedError):
            raise WorldChangedError(step[0], error.assignment) from error
        if error is not None:
            raise error
        for index, (bucket, averaged) in enumerate(zip(self.buckets, means, strict=True)):
            assert averaged is not None
            grads = [param.grad for param in bucket]
            assert all(grad is not None for grad in grads)
            self.staging.from_host(index, grads, averaged)  # type: ignore[arg-type]

    def cancel(self) -> None:
        """The step is not applied: start no more of its buckets, wait for the one running
        (a world change ends it, or every rank takes part in it), and drop the results."""
        if self._step is None:
            return
        self._cancelled.set()
        with self._cond:
            self._cond.notify_all()
        self._wait_done()
        with self._cond:
            self._step = None

    def _wait_done(self) -> None:
        with self._cond:
            while self._step is not None and self._done < len(self.buckets):
                self._cond.wait()

    # ------------------------------------------------------------ backward's side
    def _accumulated(self, param: torch.Tensor) -> None:
        index = self._bucket_of[id(param)]
        with self._cond:
            if self._step is None or self._flush:
                return  # a backward outside a step's work (or after it): not ours
            # on CUDA, where backward made the gradient (its stream, now): the averaging
            # thread's copy waits for it there, not for its own thread's stream
            self._ready[index].append(self.staging.ready())
            self._left[index] -= 1
            if self._left[index] < 0 or index < self._done:
                self._again = True
            if self._left[index] == 0:
                self._cond.notify_all()

    # ------------------------------------------------------------ the averaging thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._next_due():
                    self._cond.wait()
                step, index, error, gate = self._step, self._done, self._error, self._gate
            assert step is not None
            if index == 0 and error is None and not gate(self._cancelled):
                error = WorldChangedError(step[0], None)  # a stale step: nothing starts
            means: list[np.ndarray] | None = None
            if error is None and not self._cancelled.is_set():
                try:
                    means = self._average(index, *step)
                except BaseException as exc:  # handed to the loop's finish()
                    error = exc
            elif error is None:
                error = WorldChangedError(step[0], None)  # cancelled: nothing more starts
            with self._cond:
                if self._step == step:
                    self._means[index], self._error = means, error
                    self._done += 1
                    self._cond.notify_all()

    def _next_due(self) -> bool:
        """Whether the next bucket of the current step is to be averaged (or given up) now."""
        if self._step is None or self._done >= len(self.buckets):
            return False
        return self._flush or self._cancelled.is_set() or self._left[self._done] <= 0

    def _average(self, index: int, step: int, world: int) -> list[np.ndarray]:
        grads = []
        for param in self.buckets[index]:
            if param.grad is None:  # unused in this step's forward: zeros, as DDP counts it
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        with self._cond:
            ready = list(self._ready[index])
        arrays = self.staging.to_host(index, grads, ready)
        named: dict[str, Any] = {str(i): array for i, array in enumerate(arrays)}
        mean = self.collective.allreduce(named, call_id(step, GRADIENTS, index), world=world)
        return [mean[str(i)] for i in range(len(grads))]
