"""The plain twin of examples/lm_train.py: the same model and loop in one process, as
written before cohort (`python examples/lm_plain.py --epochs 3 --batch-size 48`)."""

from __future__ import annotations

import argparse
import json

import torch
from lm import Windows, build, corpus, loss_of, options, schedule
from torch.utils.data import DataLoader


def main() -> None:
    parser = options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=48)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)

    text = corpus(args.corpus)
    held_out = Windows(text, start=len(Windows(text)) - 256)  # the last 256 windows
    train = Windows(text, count=len(Windows(text)) - 256)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    total_steps = args.epochs * len(loader)
    model, optimizer = build(args.seed, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args.warmup, total_steps))
    scaler = torch.amp.GradScaler("cpu", enabled=args.precision == "fp16")
    if args.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            loss = loss_of(model, x, y, args.precision)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            lr = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % args.log_every == 0:
                print(json.dumps({"step": step, "lr": lr, "norm": float(norm)}), flush=True)
            step += 1
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in DataLoader(held_out, batch_size=32):
                total += float(loss_of(model, x, y, args.precision)) * len(x)
                count += len(x)
        val = total / max(1, count)
        print(json.dumps({"epoch": epoch, "val_loss": round(val, 5)}), flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
