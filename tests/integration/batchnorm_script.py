"""A BatchNorm model's plain training loop on `cohort.torch.ElasticJob`, for
tests/integration/test_batchnorm.py: every step's weights digest is reported
(`digest_every=1`), so the leader compares every rank's buffers at every step.

    python batchnorm_script.py OUT

Writes OUT/final.pt through `job.save`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import cohort


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    job = cohort.torch.ElasticJob(digest_every=1)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(4, 8, 3, padding=1),
        torch.nn.BatchNorm1d(8),  # over 3 positions: a batch of one sample still trains
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(24, 1),
    ).to(job.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = job.wrap(model, optimizer)
    data = torch.utils.data.TensorDataset(torch.randn(257, 4, 3), torch.randn(257, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=job.batch_size)
    for _ in job.epochs():
        for x, y in job.batches(loader):
            loss = torch.nn.functional.mse_loss(model(x.to(job.device)), y.to(job.device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if job.is_chief:
        job.save(out / "final.pt")


if __name__ == "__main__":
    main()
