"""The peers' workers for bench/sharded.py: examples/lm_train.py's loop without cohort, the
examples' transformer sharded with FSDP2 over gloo, one torch thread, 8 samples a step.

- `torchrun`: FSDP over every worker of one torchrun, resuming from the last DCP checkpoint
  under $BENCH_CHECKPOINT and writing one every $BENCH_CHECKPOINT_EVERY steps (restart all).
- `torchft`: one rank of a TorchFT replica group, as torchtitan runs TorchFT's fault-tolerant
  HSDP: each group is a torchrun of its own (the group's ranks, FSDP2 over them, the
  agent restarting the whole group when a rank dies), a `torchft.Manager` per rank on the
  group's store, and the gradient shards averaged across the live groups by the manager in
  FSDP's all-reduce hook. A restarted group takes its shards from a live group's same rank
  (the manager's recovery: the state here is each rank's local shards). Each group trains
  the $BENCH_GROUP-th of $BENCH_GROUPS parts of every step's batch; a missing group's part
  is skipped (as TorchFT's sampler does).

Each step appends one JSON line to $BENCH_LOG. torchrun's workers: {"t", "step", "pid"}
(step = the model's step count after it); TorchFT's group rank 0: the lines
bench/torchft_run.py reads ({"t", "step", "committed", "groups", "group", "pid"}).

    python -m bench.sharded_ranks torchrun|torchft    # under torchrun (env BENCH_*)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.torchft_trainer import exit_on_error

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DATASET, BATCH = 3072, 8
"""Samples per epoch (of the docs corpus's 4,060 windows) and per rank per step."""


@dataclass
class Trainer:
    """The model sharded over this process's default group, AdamW made on its sharded
    parameters as build() makes it, the schedule, the data."""

    model: Any
    optimizer: Any
    scheduler: Any
    train: Any
    held_out: Any
    steps_per_epoch: int

    def batch(self, step: int, place: int, places: int) -> tuple[Any, Any]:
        """Step `step`'s `place`-th of `places` batches, from the epoch's seeded order."""
        import torch

        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(epoch))
        first = (within * places + place) * BATCH
        return torch.utils.data.default_collate(
            [self.train[int(i)] for i in order[first : first + BATCH]]
        )

    def backward(self, x: Any, y: Any) -> None:
        """The step's loss, backward, the clip at 1.0 (FSDP's and any hook's collectives
        run in here)."""
        import torch
        from lm import loss_of

        self.optimizer.zero_grad()
        loss_of(self.model, x, y, "fp32").backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def follow_schedule(self, step: int) -> None:
        """The learning rate of the schedule at `step` (where steps are counted elsewhere)."""
        for group, base, factor in zip(
            self.optimizer.param_groups,
            self.scheduler.base_lrs,
            self.scheduler.lr_lambdas,
            strict=True,
        ):
            group["lr"] = base * factor(step)

    def validated(self) -> float:
        """lm_train.py's validation pass: this rank's part of the held-out windows, summed
        over the default group."""
        import torch
        import torch.distributed as dist
        from lm import loss_of

        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.zeros(2)
        with torch.no_grad():
            for start in range(rank * 32, len(self.held_out), world * 32):
                x, y = torch.utils.data.default_collate(
                    [self.held_out[i] for i in range(start, min(start + 32, len(self.held_out)))]
                )
                total += torch.tensor([float(loss_of(self.model, x, y, "fp32")) * len(x), len(x)])
        dist.all_reduce(total)
        return float(total[0] / total[1])


def trainer(places: int) -> Trainer:
    """The process group from torchrun's environment, the model sharded over it; an epoch
    is DATASET // (BATCH * places) steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(EXAMPLES))
    from lm import Windows, build, corpus, schedule, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, built = build()
    shard(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    # fully_shard replaces every parameter: AdamW is made again on the sharded ones, with
    # build()'s groups and settings, as a torchrun user does
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=built.defaults["lr"],
        betas=built.defaults["betas"],
    )
    steps = DATASET // (BATCH * places)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(10, 100000 * steps))
    text = corpus()
    return Trainer(
        model,
        optimizer,
        scheduler,
        Windows(text, count=DATASET),
        Windows(text, start=len(Windows(text)) - 256),
        steps,
    )


# ---------------------------------------------------------------- torchrun, restart all
def torchrun_rank() -> None:
    import torch.distributed as dist

    t = trainer(int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(os.environ["BENCH_CHECKPOINT"])
    root.mkdir(parents=True, exist_ok=True)
    step = _resumed(t, root)
    every = int(os.environ["BENCH_CHECKPOINT_EVERY"])
    with open(os.environ["BENCH_LOG"], "a") as log:
        while True:
            t.backward(*t.batch(step, rank, world))
            t.optimizer.step()
            t.scheduler.step()
            step += 1
            if step % t.steps_per_epoch == 0:
                t.validated()
            if step % every == 0:
                _saved(t, step, root)
            log.write(json.dumps({"t": time.time(), "step": step, "pid": os.getpid()}) + "\n")
            log.flush()


def _state(t: Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(t.model, t.optimizer)
    return {"model": model_state, "optim": optim_state}


def _saved(t: Trainer, step: int, root: Path) -> None:
    """A DCP checkpoint of step `step` (every worker writes its shards), then rank 0 points
    `latest` at it (atomically)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {**_state(t), "scheduler": t.scheduler.state_dict(), "step": step}
    dcp.save(state, checkpoint_id=str(root / f"step-{step}"))
    if dist.get_rank() == 0:
        partial = root / "latest.part"
        partial.write_text(str(step))
        partial.replace(root / "latest")


def _resumed(t: Trainer, root: Path) -> int:
    """The step of the last checkpoint, loaded into the trainer (0 where there is none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    latest = root / "latest"
    if not latest.exists():
        return 0
    step = int(latest.read_text())
    state = {**_state(t), "scheduler": t.scheduler.state_dict(), "step": step}
    dcp.load(state, checkpoint_id=str(root / f"step-{step}"))
    set_state_dict(
        t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    t.scheduler.load_state_dict(state["scheduler"])
    return step


# ---------------------------------------------------------------- TorchFT's HSDP
def torchft_rank() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchft import Manager, Optimizer, ProcessGroupGloo

    group, groups = int(os.environ["BENCH_GROUP"]), int(os.environ["BENCH_GROUPS"])
    t = trainer(groups * int(os.environ["WORLD_SIZE"]))
    rank, size = dist.get_rank(), dist.get_world_size()
    shards = LocalShards(t)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=shards.load,
        state_dict=shards.state,
        min_replica_size=1,
        rank=rank,
        world_size=size,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        replica_id=f"bench_{group}",
        use_async_quorum=False,  # as torchtitan's HSDP: a recovery lands between steps
    )  # the group's store: torchrun's, at $MASTER_ADDR:$MASTER_PORT

    def across_groups(shard: Any) -> None:
        manager.allreduce(shard).wait()

    for module in t.model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(across_groups)
    optimizer = Optimizer(manager, t.optimizer)
    log = open(os.environ["BENCH_LOG"], "a") if rank == 0 else None  # noqa: SIM115
    while True:
        step = manager.current_step()
        x, y = t.batch(step, group * size + rank, groups * size)
        optimizer.zero_grad()  # starts the step's quorum
        t.follow_schedule(step)
        t.backward(x, y)
        optimizer.step()  # applies the step only if every live group's allreduce held
        if manager.current_step() > step and manager.current_step() % t.steps_per_epoch == 0:
            t.validated()
        if log is not None:
            after = manager.current_step()
            line = {"t": time.time(), "step": after, "committed": after > step,
                    "groups": manager.num_participants(), "group": group,
                    "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(line) + "\n")
            log.flush()


class LocalShards:
    """What a TorchFT manager sends a recovering rank: this rank's local shards of the
    parameters and of AdamW's state (a peer group's same rank holds the same slices)."""

    def __init__(self, t: Trainer) -> None:
        self.t = t

    def state(self) -> dict[str, Any]:
        params = dict(self.t.model.named_parameters())
        return {
            "model": {name: p.to_local() for name, p in params.items()},
            "optim": {
                name: {key: _local(value) for key, value in self.t.optimizer.state[p].items()}
                for name, p in params.items()
                if p in self.t.optimizer.state
            },
        }

    def load(self, state: dict[str, Any]) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        params = dict(self.t.model.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                p.to_local().copy_(state["model"][name])
            for name, values in state["optim"].items():
                p = params[name]
                self.t.optimizer.state[p] = {
                    key: DTensor.from_local(v.clone(), p.device_mesh, p.placements)
                    if key != "step"
                    else v.clone()
                    for key, v in values.items()
                }


def _local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


def main() -> None:
    roles = {"torchrun": torchrun_rank, "torchft": torchft_rank}
    if len(sys.argv) != 2 or sys.argv[1] not in roles:
        sys.exit(f"usage: python -m bench.sharded_ranks {'|'.join(roles)} (under torchrun)")
    exit_on_error(roles[sys.argv[1]])


if __name__ == "__main__":
    main()
