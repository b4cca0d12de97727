"""Sharded models healed: HSDP 2 x 2 of the examples' language model under `cohort run`, a
rank SIGKILLed at the start of every period, against TorchFT's fault-tolerant HSDP and
against FSDP under torchrun restarting every worker from its last DCP checkpoint.

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
- TorchFT 0.2.0's HSDP (bench/sharded_ranks.py `torchft`): two replica groups, each a
  torchrun of 2 workers with FSDP2 over them and a `torchft.Manager` per rank averaging
  the gradient shards across the live groups; its lighthouse at its defaults; a group that
  loses a worker is restarted whole by its agent and takes its shards from the other
  group's same ranks. Its sampler's way: a missing group's part of a step is skipped.
- `torchrun --nproc-per-node 4 --standalone` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the
  better torchrun of bench/launched.py): the same model and loop with FSDP2 over the 4
  workers, a DCP checkpoint (model, optimizer, schedule, step) every `--checkpoint-every`
  steps; the agent restarts every worker, which resume from the last checkpoint.

Per kill: seconds to the survivors' next committed step (cohort; TorchFT: the other
group's; torchrun: the first step of a restarted worker), to every rank committing again
(the lost place training again), the steps redone, and goodput against each side's own
failure-free rate (bench.goodput's counting). Without torchft installed the TorchFT row
says how to install it.

    python -m bench.sharded [--failure-free 60] [--every 60] [--kills 10]
                            [--checkpoint-every 20]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from bench import goodput
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
from bench.scratch import discard
from bench.torchft_peer import Side, heal
from bench.torchft_run import ShardedTorchFT, TorchFTMissing, lighthouse_command

RANKS, GROUP, BATCH = 4, 2, 8
DATASET = 3072
"""Samples per epoch (of the docs corpus's 4,060 windows): 96 steps of the global batch,
then a validation pass over the last 256."""
CHECKPOINT_EVERY = 20
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
COHORT_WORK = Work(
    (str(EXAMPLES / "lm_train.py"), "--shard", "--log-every", "1000000000"),
    "lm_train.py",
    ("--dataset-size", str(DATASET), "--batch-size", str(BATCH),
     "--global-batch", str(BATCH * RANKS), "--placement", "strided", "--reduction", "float",
     "--epochs", "100000"),
    (("COHORT_TORCH_BACKEND", "gloo"),),
)  # fmt: skip
TORCHRUN_WORK = Work(("-m", "bench.sharded_ranks", "torchrun"), "bench.sharded_ranks")


def sides(checkpoints: Path, checkpoint_every: int) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each cohort side: its row's name and its flags beyond the job's."""
    hsdp = ("--shard-group", str(GROUP))
    fsdp = ("--checkpoint-uri", str(checkpoints), "--checkpoint-every", str(checkpoint_every))
    return {
        "spare": ("cohort run --shard-group 2 --spares 1 (healed in place)",
                  (*hsdp, "--spares", "1")),
        "no spare": ("cohort run --shard-group 2 (no spare)", hsdp),
        "fsdp": (f"cohort run, FSDP over 4, DCP every {checkpoint_every} steps (rewind, "
                 f"4 -> 3)", fsdp),
    }  # fmt: skip


def measure(
    failure_free: float = 60,
    every: float = 60,
    kills: int = 10,
    checkpoint_every: int = CHECKPOINT_EVERY,
) -> Section:
    """cohort's sides, then TorchFT's and torchrun, back to back."""
    if failure_free <= 0 or every <= 0 or kills < 1 or checkpoint_every < 1:
        raise ValueError(
            f"--failure-free {failure_free}, --every {every}, --kills {kills}, "
            f"--checkpoint-every {checkpoint_every}: each must be positive"
        )
    checkpoints = Path(tempfile.mkdtemp(prefix="cohort-sharded-checkpoints-"))
    try:
        named = sides(checkpoints, checkpoint_every)
        mine = {
            name: _cohort(RANKS, failure_free, every, kills, flags, victim="rank", work=COHORT_WORK)
            for name, flags in named.values()
        }
    finally:
        discard(checkpoints)
    torchft = _torchft(failure_free, every, kills)
    torchrun = _torchrun(
        RANKS, failure_free, every, kills, checkpoint_every, shared=False, work=TORCHRUN_WORK
    )
    peers = {**({TORCHFT: torchft[0]} if isinstance(torchft, tuple) else {}),
             f"torchrun --standalone, FSDP over 4, DCP every {checkpoint_every} steps "
             f"(restart all)": torchrun}  # fmt: skip
    keys = [*named, *(["torchft"] if isinstance(torchft, tuple) else []), "torchrun"]
    everyone = {**mine, **peers}
    section = Section(
        key="sharded",
        title=f"Sharded models healed: HSDP 2 x 2 of the LM example under cohort run vs "
        f"TorchFT's HSDP and FSDP under torchrun with DCP checkpoints, a rank killed every "
        f"{every:g} s",
        command=f"python -m bench.sharded --failure-free {failure_free:g} --every {every:g} "
        f"--kills {kills} --checkpoint-every {checkpoint_every}",
        header=["side", "kill to survivors' next step, s (median)",
                "kill to every rank training again, s (median)", "steps redone (total)",
                "goodput", "failure-free steps/s (before / after)"],
        raw={key: _raw(side) for key, side in zip(keys, everyone.values(), strict=True)},
        rows=[_row(name, side) for name, side in everyone.items()],
        notes=_notes(failure_free, every, kills, everyone),
    )  # fmt: skip
    if isinstance(torchft, tuple):
        section.raw["torchft"]["skipped"] = torchft[1]
        section.notes.append(
            f"Samples TorchFT skipped per kill (a step the broken group missed trains "
            f"without its part): {', '.join(str(n) for n in torchft[1])}; cohort's sides deal "
            f"each sample once per epoch across the world change."
        )
    else:
        section.rows.insert(len(named), [TORCHFT, torchft, "", "", "", ""])
    return section


TORCHFT = "TorchFT 0.2.0 HSDP, 2 replica groups of torchrun x 2, lighthouse defaults"


def _torchft(failure_free: float, every: float, kills: int) -> tuple[Healing, list[int]] | str:
    """TorchFT's HSDP side, in bench.launched's terms, and the samples it skipped per kill;
    without torchft, what to install."""
    try:
        lighthouse_command()
    except TorchFTMissing as missing:
        return str(missing)
    groups = RANKS // GROUP
    healed = heal(Side(TORCHFT, lambda: ShardedTorchFT(groups).start()), failure_free, every, kills)
    faults, run = healed.faults, healed.run
    side = Healing(  # counted in steps, as the other sides (bench.torchft_run: group-steps)
        replace(
            run,
            failure_free=run.failure_free / groups,
            counted=round(run.counted / groups),
            free_windows=tuple(rate / groups for rate in run.free_windows),
        ),
        training_again=[f.survivors for f in faults],
        redone=[f.redone for f in faults],
        whole_again=[f.place for f in faults],
    )
    # a Fault counts bench.goodput's 64 samples per missing group-step; a group here takes
    # GROUP x BATCH
    return side, [f.skipped // goodput.BATCH * GROUP * BATCH for f in faults]


def _row(name: str, side: Healing) -> list[str]:
    """torchrun's every rank trains again at its first step after a restart."""
    free = " / ".join(f"{rate:.2f}" for rate in side.run.free_windows)
    whole = side.whole_again or side.training_again
    return [name, _median(side.training_again), _median(whole), str(sum(side.redone)),
            f"{side.run.goodput:.2f}", free]  # fmt: skip


def _notes(failure_free: float, every: float, kills: int, sides: dict[str, Healing]) -> list[str]:
    return [
        f"Each side: examples/lm.py's transformer sharded with FSDP2 over gloo, {RANKS} ranks "
        f"of {BATCH} samples per step, one torch thread per rank, on this 2-core machine. A "
        f"rank is SIGKILLed at the start of each of {kills} periods of {every:g} s (cohort: "
        f"the world's rank 0; TorchFT: its first group's rank 0; torchrun: the worker that "
        f"has run longest); goodput is the rate over the periods against the side's own "
        f"failure-free rate, the mean of {failure_free:g} s before the periods and "
        f"{failure_free:g} s after.",
        "Per kill, seconds to the survivors' next step / steps redone: "
        + "; ".join(f"{name}: {_per_kill(side)}" for name, side in sides.items())
        + " (torchrun: the first step of a restarted worker).",
    ]


def main() -> None:
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
