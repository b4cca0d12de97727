"""The same script, elastic: any number of processes, joining and dying as they please."""

import argparse
import json

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import cohort

FEATURES, HIDDEN, CLASSES = 16, 64, 4


def dataset(size: int = 4096, seed: int = 1234) -> TensorDataset:
    """A fixed synthetic classification set: labels of a random teacher network (the
    same teacher at any size: a larger set's extra samples are held out)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    x = torch.randn(size, FEATURES, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", help="write the final parameters here (.npz)")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader processes")
    args = parser.parse_args()
    job = cohort.torch.ElasticJob()  # job name: $COHORT_JOB; Redis: $COHORT_REDIS_URL
    model, optimizer = job.wrap(*build())
    workers = args.loader_workers
    loader = DataLoader(
        dataset(), batch_size=32, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    for epoch in job.epochs(args.epochs):
        for x, y in job.batches(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(json.dumps({"epoch": epoch, "loss": round(loss.item(), 6)}), flush=True)
    if args.save:
        np.savez(args.save, **{n: p.detach().numpy() for n, p in model.named_parameters()})


if __name__ == "__main__":
    main()
