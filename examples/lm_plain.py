"""The plain twin of examples/lm_train.py: the same model and loop in one process, as
written before cohort (`python examples/lm_plain.py --epochs 3 --batch-size 48`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lm import Windows, build, corpus, loss_of, schedule
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="a byte file (default: the docs, joined)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10, help="warmup updates")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="updates between log lines")
    parser.add_argument("--save", help="write the final state_dict here (torch.save)")
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
