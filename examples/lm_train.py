"""A byte-level language model trained as real scripts train one, made elastic.

The loop is the plain one of examples/lm_plain.py (AdamW with weight decay, linear warmup
then cosine decay through LambdaLR stepped every update, gradient clipping, bf16 autocast
or fp16 with a GradScaler, optional torch.compile, a validation pass at each epoch's end,
one final save), with cohort's lines marked `# cohort`. Run it with, for example:

    cohort run -n 3 --spares 1 --dataset-size 2048 --batch-size 8 --global-batch 48 \\
        --placement strided --epochs 3 examples/lm_train.py --precision bf16 --save lm.pt

The job's settings come from `cohort run`; the script reads them from the job (its length
for the schedule, the batch for the loader). What the test of this example holds it to:
every step's learning rate and the weights after N steps equal DDP with `no_sync` on the
same global batches, through a SIGKILL (tests/integration/test_lm_example.py).

`--shard` trains the model sharded with FSDP2 (each transformer block, then the root:
lm.py's `shard`), which cohort applies anew in each world; it needs a backend, and
`--shard-group S` makes it HSDP (docs/sharded.md):

    COHORT_TORCH_BACKEND=gloo cohort run -n 2 --dataset-size 2048 --batch-size 8 \\
        --global-batch 48 --placement strided --reduction float --epochs 3 \\
        --checkpoint-uri ckpt --checkpoint-every 10 examples/lm_train.py --shard

A sharded model's sums are floating point (`--reduction float`); a rank lost rewinds FSDP
to the last checkpoint (HSDP heals from the other copies). Tested under a SIGKILL in
tests/integration/test_sharded.py.
"""

from __future__ import annotations

import argparse
import json

import torch
from lm import Windows, build, corpus, loss_of, options, schedule, shard
from torch.utils.data import DataLoader

import cohort


def main() -> None:
    parser = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--shard", action="store_true", help="FSDP2 (needs a backend)")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)

    job = cohort.torch.ElasticJob()  # cohort: job, Redis and settings from `cohort run`
    job.seed_steps(args.seed)  # cohort: a step's dropout draws depend on the step alone
    if job.total_steps is None:
        parser.error(
            "the schedule needs the job's length: cohort run --max-steps N, or "
            "--epochs with --global-batch, --placement strided and --dataset-size"
        )
    model, optimizer = build(args.seed, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args.warmup, job.total_steps))
    scaler = torch.amp.GradScaler("cpu", enabled=args.precision == "fp16")
    if args.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    sharded = shard if args.shard else None  # cohort: FSDP2, applied in each world
    model, optimizer = job.wrap(  # cohort
        model, optimizer, scheduler=scheduler, scaler=scaler, shard=sharded
    )
    text = corpus(args.corpus)
    held_out = Windows(text, start=len(Windows(text)) - 256)  # the last 256 windows
    train = Windows(text, count=job.dataset_size or len(Windows(text)) - 256)
    loader = DataLoader(train, batch_size=job.batch_size, shuffle=True)
    for epoch in job.epochs():  # cohort: the job's epochs
        model.train()
        for x, y in job.batches(loader):  # cohort: this rank's part of each step
            loss = loss_of(model, x, y, args.precision)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            lr = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            job.record(loss=loss, lr=lr, grad_norm=norm)  # cohort: for status and report
            applied = job.sync_gradients and not job.aborted
            if applied and job.is_chief and job.step % args.log_every == 0:
                print(json.dumps({"step": job.step, "lr": lr, "norm": float(norm)}), flush=True)
        if job.interrupted:  # cohort: a signal ended this epoch early: not a whole epoch
            break
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in job.shard(DataLoader(held_out, batch_size=32)):  # cohort: my part
                total += float(loss_of(model, x, y, args.precision)) * len(x)
                count += len(x)
        val = job.sum(total) / max(1.0, job.sum(count))  # cohort: over every rank
        job.record(val_loss=val)
        if job.is_chief:
            print(json.dumps({"epoch": epoch, "val_loss": round(val, 5)}), flush=True)
    if args.save:
        job.save(args.save)  # cohort: once, by one rank, the job's final weights


if __name__ == "__main__":
    main()
