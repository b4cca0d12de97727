"""A training script whose result must not depend on the failures it lives through.

    python transparent_script.py OUT_DIR [--redis-url URL --job JOB --id WORKER]
        --route redis|gloo --optimizer sgd|adam --schedule step|epoch
        [--hold-at STEP:MEMBERS ...] [--die-at STEP[:CHECKPOINT] | +N] [--pace SECONDS]

Under `cohort run` the Redis URL, job and worker id come from the environment it sets.

A small deterministic model trained as a user writes it: `job.epochs()`, `job.batches()`,
an LR scheduler stepped after every step or after every epoch's loop, and a counter in
`extra` that the script bumps between epochs. For each step it applies, it appends one
JSON line to OUT_DIR/trace-WORKER.jsonl: the step, its epoch, the learning rate the step
was trained with, the scheduler's position after it and the counter. The chief of the
final world writes the final weights to OUT_DIR/final.pt.

The failures are the test's: `--hold-at 3:3` (given again, one hold each) waits inside step
3 until the job has three members (a rank joins a world that is training); `--die-at 10:8`
SIGKILLs this process as it is given step 10, once the job holds a checkpoint of step 8
(every rank given it dies, and the job must rewind to that checkpoint); `--die-at +2` as it
is given its second step; `--pace 0.2` makes each step last at least 0.2 s, so a test can
kill a rank mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cohort

SAMPLES, FEATURES, HIDDEN = 72, 6, 8
WAIT = 120.0


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    truth = torch.randn(FEATURES, 1, generator=generator)
    noise = 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, torch.tanh(x @ truth) + noise)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(HIDDEN, 1),
    )


def optimizer(kind: str, net: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(net.parameters(), lr=0.05)


def scheduler(schedule: str, opt: torch.optim.Optimizer) -> Any:
    step_size, gamma = (4, 0.8) if schedule == "step" else (1, 0.5)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=gamma)


def pair(text: str) -> tuple[int, int | None]:
    first, _, second = text.partition(":")
    return int(first), int(second) if second else None


def when(text: str) -> tuple[str, int, int | None]:
    """`STEP[:CHECKPOINT]`: as the job's step STEP is given; `+N`: as this process is
    given its Nth step (a joiner's 2nd is its world's 2nd: DDP's buckets are agreed then)."""
    if text.startswith("+"):
        return "own", int(text[1:]), None
    return ("job", *pair(text))


def hold(job: Any, members: int) -> None:
    """Wait, inside the step, until the job has `members` members."""
    job.worker.wait_for(lambda view: len(view.members) >= members, WAIT)


def die(job: Any, checkpoint: int | None) -> None:
    """SIGKILL this process, once the job's checkpoint index holds step `checkpoint`."""
    if checkpoint is not None:
        job.worker.wait_for(
            lambda view: any(saved.step == checkpoint for saved in view.checkpoints), WAIT
        )
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--redis-url")
    parser.add_argument("--job")
    parser.add_argument("--id")
    parser.add_argument("--route", choices=("redis", "gloo"), required=True)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), required=True)
    parser.add_argument("--schedule", choices=("step", "epoch"), required=True)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--hold-at", type=pair, action="append", default=[])
    parser.add_argument("--die-at", type=when, default=("job", -1, None))
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--loader-workers", type=int, default=0, help="kept, and warmed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    dataset = data()
    job = cohort.torch.ElasticJob(
        args.job,
        redis_url=args.redis_url,
        worker_id=args.id,
        dataset=dataset,
        backend="gloo" if args.route == "gloo" else None,
    )
    job.seed_steps(1234)  # dropout's draws: each micro-batch's own, at any world size
    net = model()
    opt = optimizer(args.optimizer, net)
    sched = scheduler(args.schedule, opt)
    counters = {"epochs_done": 0}
    scaler = torch.amp.GradScaler("cpu", enabled=args.precision == "fp16")
    net, opt = job.wrap(net, opt, scheduler=sched, extra=counters, scaler=scaler)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    workers = args.loader_workers
    loader = DataLoader(
        dataset, batch_size=job.worker.view.config.batch_size, num_workers=workers,
        persistent_workers=workers > 0,
    )  # fmt: skip
    job.warm(loader)  # a spare waits with its loader's workers up
    trace = (args.out / f"trace-{job.worker_id}.jsonl").open("a")
    counted, given = args.die_at[0] == "own", 0
    for _epoch in job.epochs():
        for x, y in job.batches(loader):
            given += 1
            for at, members in args.hold_at:
                if job.step == at:
                    hold(job, members or 0)
            if (given if counted else job.step) == args.die_at[1]:
                die(job, args.die_at[2])
            if args.pace:
                job.worker.stopping.wait(args.pace)
            with torch.autocast("cpu", half or torch.bfloat16, enabled=half is not None):
                out = net(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()  # fp16: a GradScaler's; otherwise loss as it is
            lr = opt.param_groups[0]["lr"]
            scaler.step(opt)
            scaler.update()
            if args.schedule == "step":
                sched.step()
            if not job.aborted:  # a world change cut the step short: it comes again
                line = {
                    "t": time.time(), "step": job.step, "epoch": job.epoch, "lr": lr,
                    "sched": sched.last_epoch, "epochs_done": counters["epochs_done"],
                    "world_size": job.world_size, "rank": job.rank,
                }  # fmt: skip
                trace.write(json.dumps(line) + "\n")
                trace.flush()
        if args.schedule == "epoch":
            sched.step()
        counters["epochs_done"] += 1
    job.save(args.out / "final.pt")


if __name__ == "__main__":
    main()
