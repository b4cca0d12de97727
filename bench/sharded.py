"""Sharded models healed: HSDP 2 x 2 of the examples' language model under `cohort run`, a
rank SIGKILLed at the start of every period, against FSDP under torchrun restarting every
worker from its last DCP checkpoint.

Each side trains examples/lm.py's 2-block byte-level transformer (AdamW, clipping at 1.0, a
warmup then cosine schedule, fp32) with FSDP2 over gloo, 8 samples per rank per step, one
torch thread per rank, started by its own launcher on this machine:

- `cohort run -n 4 --shard-group 2 --spares 1`: examples/lm_train.py --shard as HSDP, two
  copies of the model each sharded over 2 ranks, a constant global batch of 32, no
  checkpoint location at all. The launcher's word fails the killed rank and the leader puts
  the warm spare in its place in the same decision; the 3 survivors keep their shards and
  only the lost shard moves, from its holder in the other copy (worker/pytorch/regather.py).
- `cohort run -n 4 --shard-group 2`: no spare; the 3 survivors go on as one FSDP copy over
  3 (the whole state put together from one holder of each shard), and 2 x 2 again once the
  replacement has started and joined.
- `torchrun --nproc-per-node 4 --standalone` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the
  better torchrun of bench/launched.py): the same model and loop with FSDP2 over the 4
  workers, a DCP checkpoint (model, optimizer, schedule, step) every `--checkpoint-every`
  steps; the agent restarts every worker, which resume from the last checkpoint.

Per kill: seconds to the survivors' next committed step (cohort; torchrun: the first step
of a restarted worker), to a world of every rank committing again (the lost place
training again), the steps redone, and goodput against each side's own failure-free rate
(bench.goodput's counting).

    python -m bench.sharded [--failure-free 60] [--every 60] [--kills 10]
                            [--checkpoint-every 20]
    python -m bench.sharded torchrun-rank        # one torchrun worker (internal; env BENCH_*)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.launched import (
    Healing,
    Work,
    _cohort,
    _median,
    _per_kill,
    _raw,
    _torchrun,
    period_arguments,
)
from bench.results import Section

RANKS, GROUP, BATCH = 4, 2, 8
DATASET = 3072
"""Samples per epoch (of the docs corpus's 4,060 windows): 96 steps of the global batch,
then a validation pass over the last 256."""
CHECKPOINT_EVERY = 20
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
COHORT_WORK = Work(
    (str(EXAMPLES / "lm_train.py"), "--shard", "--log-every", "1000000000"),
    "lm_train.py",
    ("--shard-group", str(GROUP), "--dataset-size", str(DATASET), "--batch-size", str(BATCH),
     "--global-batch", str(BATCH * RANKS), "--placement", "strided", "--reduction", "float",
     "--epochs", "100000"),
    (("COHORT_TORCH_BACKEND", "gloo"),),
)  # fmt: skip
TORCHRUN_WORK = Work(("-m", "bench.sharded", "torchrun-rank"), "torchrun-rank")
SIDES = {
    "spare": ("cohort run --shard-group 2 --spares 1 (healed in place)", ("--spares", "1")),
    "no spare": ("cohort run --shard-group 2 (no spare)", ()),
}
"""Each cohort side: its row's name and its flags beyond the job's."""


def measure(
    failure_free: float = 60,
    every: float = 60,
    kills: int = 10,
    checkpoint_every: int = CHECKPOINT_EVERY,
) -> Section:
    """Both cohort sides, then torchrun, back to back."""
    if failure_free <= 0 or every <= 0 or kills < 1 or checkpoint_every < 1:
        raise ValueError(
            f"--failure-free {failure_free}, --every {every}, --kills {kills}, "
            f"--checkpoint-every {checkpoint_every}: each must be positive"
        )
    sides = {
        key: _cohort(RANKS, failure_free, every, kills, flags, victim="rank", work=COHORT_WORK)
        for key, (_, flags) in SIDES.items()
    }
    torchrun = _torchrun(
        RANKS, failure_free, every, kills, checkpoint_every, shared=False, work=TORCHRUN_WORK
    )
    section = Section(
        key="sharded",
        title=f"Sharded models healed: HSDP 2 x 2 of the LM example under cohort run vs FSDP "
        f"under torchrun with DCP checkpoints, a rank killed every {every:g} s",
        command=f"python -m bench.sharded --failure-free {failure_free:g} --every {every:g} "
        f"--kills {kills} --checkpoint-every {checkpoint_every}",
        header=["side", "kill to survivors' next step, s (median)",
                "kill to every rank training again, s (median)", "steps redone (total)",
                "goodput", "failure-free steps/s (before / after)"],
        raw={**{key: _raw(side) for key, side in sides.items()}, "torchrun": _raw(torchrun)},
    )  # fmt: skip
    section.rows = [
        *(_row(SIDES[key][0], side, side.whole_again) for key, side in sides.items()),
        _row(
            f"torchrun --standalone, FSDP over 4, DCP every {checkpoint_every} steps (restart all)",
            torchrun,
            torchrun.training_again,
        ),
    ]
    section.notes = _notes(failure_free, every, kills, sides, torchrun)
    return section


def _row(name: str, side: Healing, whole: list[float]) -> list[str]:
    free = " / ".join(f"{rate:.2f}" for rate in side.run.free_windows)
    return [name, _median(side.training_again), _median(whole), str(sum(side.redone)),
            f"{side.run.goodput:.2f}", free]  # fmt: skip


def _notes(
    failure_free: float, every: float, kills: int, sides: dict[str, Healing], torchrun: Healing
) -> list[str]:
    return [
        f"Each side: examples/lm.py's transformer sharded with FSDP2 over gloo, {RANKS} ranks "
        f"of {BATCH} samples per step, one torch thread per rank, on this 2-core machine. A "
        f"rank is SIGKILLed at the start of each of {kills} periods of {every:g} s (cohort: "
        f"the world's rank 0; torchrun: the worker that has run longest); goodput is the rate "
        f"over the periods against the side's own failure-free rate, the mean of "
        f"{failure_free:g} s before the periods and {failure_free:g} s after.",
        "Per kill, seconds to the survivors' next step / steps redone: "
        + "; ".join(f"{SIDES[key][0]}: {_per_kill(side)}" for key, side in sides.items())
        + f"; torchrun: {_per_kill(torchrun)} (the first step of a restarted worker).",
    ]


# ---------------------------------------------------------------- torchrun's worker
def torchrun_rank() -> None:
    """One torchrun worker: lm_train.py's loop without cohort, FSDP2 over every worker,
    resuming from the last DCP checkpoint under $BENCH_CHECKPOINT and writing one every
    $BENCH_CHECKPOINT_EVERY steps. Each finished step appends {"t", "step", "pid"} to
    $BENCH_LOG (step = the model's step count after it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(EXAMPLES))
    from lm import Windows, build, corpus, loss_of, schedule, shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, built = build()
    shard(model, init_device_mesh("cpu", (world,)))
    # fully_shard replaces every parameter: AdamW is made again on the sharded ones, with
    # build()'s groups and settings, as a torchrun user does
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=built.defaults["lr"],
        betas=built.defaults["betas"],
    )
    steps_per_epoch = DATASET // (BATCH * world)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(10, 100000 * steps_per_epoch))
    root = Path(os.environ["BENCH_CHECKPOINT"])
    root.mkdir(parents=True, exist_ok=True)
    step = _resumed(model, optimizer, scheduler, root)
    text = corpus()
    train = Windows(text, count=DATASET)
    held_out = Windows(text, start=len(Windows(text)) - 256)
    collate = torch.utils.data.default_collate
    every = int(os.environ["BENCH_CHECKPOINT_EVERY"])
    with open(os.environ["BENCH_LOG"], "a") as log:
        while True:
            epoch, within = divmod(step, steps_per_epoch)
            order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(epoch))
            first = (within * world + rank) * BATCH
            x, y = collate([train[int(i)] for i in order[first : first + BATCH]])
            loss = loss_of(model, x, y, "fp32")
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % steps_per_epoch == 0:
                _validated(model, held_out, rank, world)
            if step % every == 0:
                _saved(model, optimizer, scheduler, step, root)
            log.write(json.dumps({"t": time.time(), "step": step, "pid": os.getpid()}) + "\n")
            log.flush()


def _validated(model: Any, held_out: Any, rank: int, world: int) -> float:
    """lm_train.py's validation pass: this worker's part of the held-out windows."""
    import torch
    import torch.distributed as dist
    from lm import loss_of

    total = torch.zeros(2)
    with torch.no_grad():
        for start in range(rank * 32, len(held_out), world * 32):
            x, y = torch.utils.data.default_collate(
                [held_out[i] for i in range(start, min(start + 32, len(held_out)))]
            )
            total += torch.tensor([float(loss_of(model, x, y, "fp32")) * len(x), len(x)])
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _saved(model: Any, optimizer: Any, scheduler: Any, step: int, root: Path) -> None:
    """A DCP checkpoint of step `step` (every worker writes its shards), then rank 0 points
    `latest` at it (atomically)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {**_state(model, optimizer), "scheduler": scheduler.state_dict(), "step": step}
    dcp.save(state, checkpoint_id=str(root / f"step-{step}"))
    if dist.get_rank() == 0:
        partial = root / "latest.part"
        partial.write_text(str(step))
        partial.replace(root / "latest")


def _resumed(model: Any, optimizer: Any, scheduler: Any, root: Path) -> int:
    """The step of the last checkpoint, loaded into `model`, `optimizer` and `scheduler`
    (0 where there is none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    latest = root / "latest"
    if not latest.exists():
        return 0
    step = int(latest.read_text())
    state = {**_state(model, optimizer), "scheduler": scheduler.state_dict(), "step": step}
    dcp.load(state, checkpoint_id=str(root / f"step-{step}"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(state["scheduler"])
    return step


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "torchrun-rank":
        torchrun_rank()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    period_arguments(parser, kills=10, ranks=False)
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY)
    args = parser.parse_args()
    try:
        section = measure(args.failure_free, args.every, args.kills, args.checkpoint_every)
    except ValueError as exc:
        parser.error(str(exc))
    print(section.markdown())


if __name__ == "__main__":
    main()
