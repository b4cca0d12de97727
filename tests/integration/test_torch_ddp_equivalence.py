"""cohort's sync_gradients trains a torch model to the same parameters as DDP over gloo.

Two cohort workers (examples/torch_train.py, real processes against a real coordinator and
redis-server) train; then two DistributedDataParallel ranks over gloo train the same model
with the same seed, optimizer and, step by step, the same per-rank batches, which are read
back from the journal's committed steps. The parameters must agree to 1e-5.

This file is also the DDP rank program: `python -m tests.integration.test_torch_ddp_equivalence
RANK PORT BATCHES_JSON OUT_NPZ`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.coordinator.audit import committed_batches  # noqa: E402
from cohort.localredis import free_port  # noqa: E402
from tests.integration.cluster import Cluster  # noqa: E402
from tests.integration.gloo import join_gloo, leave_gloo, load_example  # noqa: E402

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR, SEED = 40, 0.05, 0
TOLERANCE = 1e-5


# ------------------------------------------------------------------ the DDP rank program
def ddp_rank(rank: int, port: int, batches_file: Path, out: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    ex = load_example("torch_train")
    steps = json.loads(batches_file.read_text())
    join_gloo(rank, port)
    data = ex.Data(steps["dataset_size"])
    model = ex.build(SEED)
    ddp = DistributedDataParallel(model)
    optimizer = ex.optimizer_for(ddp, LR)
    for ranks in steps["batches"]:
        x, y = data.take(ranks[rank])
        optimizer.zero_grad()
        ex.loss_of(ddp, x, y).backward()
        optimizer.step()
    np.savez(out, **ex.params_of(model))
    leave_gloo()


# ------------------------------------------------------------------ the test
def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as saved:
        return {k: saved[k] for k in saved.files}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_sync_gradients_ends_with_the_parameters_of_ddp_over_gloo(cluster: Cluster) -> None:
    dataset_size = 2048
    cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", str(dataset_size), "--batch-size", "32"
    )
    workers = [
        cluster.python(
            f"w{i}",
            "examples/torch_train.py",
            "--redis-url",
            cluster.url,
            "--job",
            cluster.job,
            "--id",
            f"w{i}",
            "--steps",
            str(STEPS),
            "--lr",
            str(LR),
            "--seed",
            str(SEED),
            "--threads",
            "1",
            "--save",
            str(cluster.saved(f"w{i}")),
        )  # fmt: skip
        for i in range(2)
    ]
    for proc in workers:
        assert cluster.finished(proc, 180) == 0, proc.output()[-3000:]

    # The samples cohort trained on, per step and rank, from the journal alone: each
    # rank's positions through its epoch's (shuffled) order.
    cluster.pull()
    batches = [
        [state.config.order(state.epoch).samples(ranks).tolist() for ranks in per_rank]
        for _, state, per_rank in committed_batches(f for _, f in cluster.facts)
        if per_rank is not None and state.config is not None
    ]
    assert len(batches) == STEPS and all(len(b) == 2 for b in batches)
    plan = cluster.tmp / "batches.json"
    plan.write_text(json.dumps({"dataset_size": dataset_size, "batches": batches}))

    port = str(free_port())
    module = "tests.integration.test_torch_ddp_equivalence"
    ranks = [
        cluster.python(
            f"ddp{r}", "-m", module, str(r), port, str(plan), str(cluster.saved(f"ddp{r}"))
        )
        for r in range(2)
    ]
    for proc in ranks:
        assert cluster.finished(proc, 180) == 0, proc.output()[-3000:]

    ddp = load(cluster.saved("ddp0"))
    assert max_abs_diff(ddp, load(cluster.saved("ddp1"))) == 0.0
    initial = load_example("torch_train").build(SEED)
    start = {k: v.detach().numpy() for k, v in initial.named_parameters()}
    assert max_abs_diff(ddp, start) > 1e-2  # the model did train
    diffs = [max_abs_diff(load(cluster.saved(f"w{i}")), ddp) for i in range(2)]
    print(
        f"cohort sync_gradients vs DDP over gloo after {STEPS} steps: max |diff| {max(diffs):.3g}"
    )
    assert max(diffs) <= TOLERANCE


if __name__ == "__main__":
    ddp_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
