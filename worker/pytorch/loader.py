"""A DataLoader that keeps prefetching across steps: the job's batches as a batch sampler.

`job.batches(loader)` used to build every batch in the training process, one step at a
time, so a loader's workers (and their prefetching) were never used. Now it runs a twin
of the script's loader (the same dataset, collate function, workers, pinning, prefetch
factor) whose batch sampler is `StepSampler`: the index lists of this rank's coming
micro-batches, step after step, as far as the current plan reaches (the end of the data
epoch in this world). The loader's workers then load steps ahead while the model trains,
and with `persistent_workers` they live from one epoch and one world to the next.

A batch comes back tagged (world, step, micro-batch): the sampler queues each tag as the
loader draws its indices, and the loader hands batches back in that order. What was
prefetched for a world that ended, or for a step a rewind took back, does not match the
step asked for: it is dropped, and the loader starts again from that step (for persistent
workers a reset, not a restart), which is how a resume mid-epoch gets exactly the rest of
the epoch's order.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cohort.events import deal
from cohort.events.models import JobConfig
from cohort.events.shards import Range
from cohort.worker.errors import NotAssignedError, WorkerError
from cohort.worker.membership import view as views

if TYPE_CHECKING:
    from cohort.worker.membership.client import Worker

Tag = tuple[int, int, int]
"""(world version, step, micro-batch index)."""

LOADER_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
"""What the twin takes from the script's loader (those its torch has)."""
WINDOW = 64
"""Micro-batches mapped through the epoch's order at once, at most (events/order.py
`samples_of`): a numpy pass over 64 positions costs nearly what one over 4096 does."""


class Stale(WorkerError):
    """The step asked for belongs to a world the journal has already replaced. Control flow
    inside the sampler: it moves on to the new world, the caller never sees it."""


class StepSampler:
    """A batch sampler over this rank's coming micro-batches, from the step set in `start`."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.start: tuple[int, int] = (0, 0)
        """(step, micro-batch) the next iteration begins at."""
        self.tags: collections.deque[Tag] = collections.deque()
        self.idle = False
        """Set: an iteration gives no batch (`StepLoader.warm`'s, which only starts workers)."""

    def __iter__(self) -> Iterator[list[int]]:
        self.tags.clear()
        if self.idle:
            return
        view = self.worker.view
        step, micro = self.start
        try:
            plan = views.plan_for(view, step)
        except NotAssignedError:
            return
        config = view.config
        if config is None or view.worker not in plan.ranks:
            return
        order = views.order_for(view, step)
        parts = _parts(config, plan, plan.ranks.index(view.worker), step, micro)
        window = 1
        while ahead := list(itertools.islice(parts, window)):
            # many steps' batches through the order at once (the same samples, fewer numpy
            # calls); the window grows, so a restart soon after a start wastes little
            taken = order.samples_of(part for _, part in ahead)
            for (tag, _), samples in zip(ahead, taken, strict=True):
                self.tags.append(tag)
                yield samples.tolist()
            window = min(2 * window, WINDOW)

    def __len__(self) -> int:
        raise TypeError("a StepSampler's length is the job's to decide: it has none")


def _parts(
    config: JobConfig, plan: views.WorldPlan, rank: int, step: int, micro: int
) -> Iterator[tuple[Tag, tuple[Range, ...]]]:
    """Rank `rank`'s micro-batches (their tags and ranges of positions) from micro-batch
    `micro` of `step` to the end of the data epoch in `plan`."""
    while not deal.exhausted(config, plan.shards, plan.base_step, step):
        ranges = deal.batch(config, plan.shards, rank, plan.base_step, step)
        if ranges:
            for index, part in enumerate(deal.micro_batches(config, ranges)):
                if index >= micro:
                    yield (plan.world_version, step, index), part
        step, micro = step + 1, 0


class StepLoader:
    """The twin of a script's DataLoader, fed by a StepSampler; `fetch` returns the batch
    of one (world, step, micro-batch), dropping whatever was prefetched before it."""

    def __init__(self, loader: Any, worker: Worker) -> None:
        from torch.utils.data import DataLoader

        if getattr(loader, "dataset", None) is None:
            raise WorkerError(
                "job.batches() and job.warm() take a torch DataLoader over a map-style "
                f"dataset, not {type(loader).__name__}"
            )
        from torch.utils.data import IterableDataset

        if isinstance(loader.dataset, IterableDataset) or not hasattr(
            loader.dataset, "__getitem__"
        ):
            raise WorkerError(
                "job.batches() and job.warm() need a map-style dataset (one with "
                "__getitem__): the job chooses which samples each rank reads"
            )
        self.sampler = StepSampler(worker)
        options = {k: getattr(loader, k) for k in LOADER_OPTIONS if hasattr(loader, k)}
        if not options.get("num_workers"):
            for name in ("prefetch_factor", "persistent_workers", "timeout"):
                options.pop(name, None)  # only for worker processes
        options.pop("drop_last", None)  # a batch sampler decides every batch
        self.loader = DataLoader(loader.dataset, batch_sampler=self.sampler, **options)
        self._batches: Iterator[Any] | None = None
        self.dropped = 0
        """Prefetched batches dropped (their world ended, or a rewind took them back)."""
        self.restarts = 0

    def fetch(self, want: Tag) -> Any:
        """The batch tagged `want`, from the running iteration or a new one from it.
        Raises Stale if the journal has moved past `want`'s world meanwhile (the step is
        retried in the new one)."""
        for _ in range(2):
            if self._batches is None:
                self.sampler.start = (want[1], want[2])
                self._batches = iter(self.loader)
                self.restarts += 1
            for batch in self._batches:
                tag = self.sampler.tags.popleft()
                if tag == want:
                    return batch
                self.dropped += 1
                if tag[0] != want[0] or tag[1:] > want[1:]:
                    break  # another world's, or past the step wanted: start again from it
            self._batches = None
            if self.sampler.worker.view.world_version > want[0]:
                raise Stale(want)
        raise WorkerError(
            f"the data loader gives no batch for step {want[1]} (micro-batch {want[2]}) of "
            f"world {want[0]}: the journal's plan does not reach it"
        )

    def warm(self) -> bool:
        """Start the loader's worker processes now, ahead of the first step, where it keeps
        them (`persistent_workers`): an iteration over no batch starts them, and the first
        real one resets them instead of forking new ones. False if there are none to keep."""
        if not (self.loader.num_workers and self.loader.persistent_workers):
            return False
        self._batches = None
        self.sampler.idle = True
        try:
            for _ in self.loader:
                pass  # none: the sampler gives no indices
        finally:
            self.sampler.idle = False
        return True

    def close(self) -> None:
        self._batches = None
