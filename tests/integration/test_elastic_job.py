"""`cohort.torch.ElasticJob`: the five-line twin of a plain script, run as real processes.

Two twins (examples/elastic_train.py) train against a real coordinator; then two
DistributedDataParallel ranks over gloo train the plain script's model, step by step on
the same per-rank batches, read back from the journal. The parameters must agree. A third
twin SIGKILLed mid-run leaves the others to finish with identical weights and an audited
history.

This file is also the DDP rank program: `python -m tests.integration.test_elastic_job RANK
PORT BATCHES_JSON OUT_NPZ`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort import acl  # noqa: E402
from cohort.coordinator.audit import audit, committed_batches  # noqa: E402
from cohort.events import identity  # noqa: E402
from cohort.localredis import (
    LocalRedis,  # noqa: E402
    free_port,  # noqa: E402
)
from tests.integration.cluster import ROOT, Cluster, Process  # noqa: E402
from tests.integration.gloo import join_gloo, leave_gloo, load_example  # noqa: E402

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

DATASET, BATCH, EPOCHS = 4096, 32, 1
TOLERANCE = 1e-5


def ddp_rank(rank: int, port: int, batches_file: Path, out: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    ex = load_example("plain_train")
    steps = json.loads(batches_file.read_text())
    join_gloo(rank, port)
    data = ex.dataset()
    model, _ = ex.build()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for ranks in steps:
        x, y = data[ranks[rank]]
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    np.savez(out, **{n: p.detach().numpy() for n, p in model.named_parameters()})
    leave_gloo()


def twin(
    cluster: Cluster, name: str, epochs: int = EPOCHS, *more: str, url: str | None = None
) -> Process:
    """examples/elastic_train.py as `name`; `url`: its own $COHORT_REDIS_URL."""
    return cluster.python(
        name, str(ROOT / "examples" / "elastic_train.py"), "--save", str(cluster.saved(name)),
        "--epochs", str(epochs), *more, env={"COHORT_REDIS_URL": url} if url else None,
    )  # fmt: skip


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as saved:
        return {k: saved[k] for k in saved.files}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.fixture
def job_env(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """The twins find their job and Redis in the environment, as the script says."""
    monkeypatch.setenv("COHORT_JOB", cluster.job)
    monkeypatch.setenv("COHORT_REDIS_URL", cluster.url)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return cluster


def use_route(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twins' route, from their environment: "gloo", or "gloo+device", NCCL's step
    protocol on gloo (each bucket's result goes to DDP as its allreduce is issued, as NCCL's
    future completes at enqueue; the step waits for the data before it applies)."""
    if route.startswith("gloo"):
        monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    if route == "gloo+device":
        monkeypatch.setenv("COHORT_TORCH_COMPLETION", "device")


@pytest.mark.parametrize("route", ["redis", "gloo", "gloo+device"])
def test_two_twins_end_with_the_parameters_of_ddp_over_gloo(
    job_env: Cluster, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Redis, and through torch.distributed (the twin unchanged: the route is the
    environment's), also with NCCL's asynchrony."""
    cluster = job_env
    use_route(route, monkeypatch)
    coordinator = cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", str(DATASET), "--batch-size", str(BATCH),
        "--epochs", str(EPOCHS),
    )  # fmt: skip
    procs = [twin(cluster, f"w{i}") for i in range(2)]
    for proc in (*procs, coordinator):  # the job ends: every process exits 0
        assert cluster.finished(proc, 180) == 0, proc.output()[-3000:]
    cluster.pull()
    assert cluster.state.finished == f"epochs={EPOCHS} finished"
    batches = [  # each rank's samples: its positions through the epoch's (shuffled) order
        [state.config.order(state.epoch).samples(ranks).tolist() for ranks in per_rank]
        for _, state, per_rank in committed_batches(f for _, f in cluster.facts)
        if per_rank is not None and state.config is not None
    ]
    assert len(batches) == EPOCHS * DATASET // (2 * BATCH)
    plan = cluster.tmp / "batches.json"
    plan.write_text(json.dumps(batches))
    port = str(free_port())
    module = "tests.integration.test_elastic_job"
    ranks = [
        cluster.python(f"ddp{r}", "-m", module, str(r), port, str(plan), str(cluster.saved(str(r))))
        for r in range(2)
    ]
    for proc in ranks:
        assert cluster.finished(proc, 180) == 0, proc.output()[-3000:]
    ddp = load(cluster.saved("0"))
    diffs = [max_abs_diff(load(cluster.saved(f"w{i}")), ddp) for i in range(2)]
    print(
        f"ElasticJob ({route}) vs DDP over gloo, {len(batches)} steps: max |diff| {max(diffs):.3g}"
    )
    assert max(diffs) <= TOLERANCE
    assert cluster.state.counters.left == 2 and not cluster.state.members  # both left cleanly


@pytest.mark.parametrize("route", ["redis", "gloo"])
def test_twins_on_their_own_credentials_train_with_nothing_refused(
    server: LocalRedis, tmp_path: Path, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-worker credentials (docs/identity.md) on both routes: every command signed, the
    collective's keys (and the gloo route's store address) written under each rank's own
    name, and Redis refuses none of what the twins do."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if route == "gloo":
        monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    admin = server.client()
    job = "own"
    monkeypatch.setenv("COHORT_JOB", job)
    passwords: dict[acl.Role, str] = {"coordinator": "c", "worker": "w", "viewer": "v"}
    acl.apply(admin, job, passwords)
    secrets = acl.issue(admin, job, ["w0", "w1"])
    admin.acl_log_reset()
    url = acl.role_url(server.url, job, "coordinator", passwords["coordinator"])
    cluster = Cluster(url=url, conn=admin, job=job, tmp=tmp_path)
    try:
        coordinator = cluster.coordinator(
            "c1", "--min-workers", "2", "--dataset-size", "1024", "--batch-size", str(BATCH),
            "--epochs", "1",
        )  # fmt: skip
        own = {
            w: acl.url_as(server.url, identity.worker_user(job, w), s) for w, s in secrets.items()
        }
        procs = [twin(cluster, w, 1, url=own[w]) for w in ("w0", "w1")]
        for proc in (*procs, coordinator):
            assert cluster.finished(proc, 180) == 0, proc.output()[-3000:]
        assert max_abs_diff(load(cluster.saved("w0")), load(cluster.saved("w1"))) == 0
        assert admin.acl_log() == []
        assert cluster.pull().finished == "epochs=1 finished"
    finally:
        cluster.stop()
        admin.close()


@pytest.mark.parametrize("route", ["redis", "gloo", "gloo+device"])
def test_a_twin_killed_mid_epoch_leaves_the_others_equal_and_every_sample_used_once(
    job_env: Cluster, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through gloo, the survivors' backward is not left hanging on the dead peer: the
    watchdog completes the collective and the step is redone in the next world. With
    NCCL's asynchrony (gloo+device) DDP's backward returns before the data arrived: the
    step's fence sees the dead peer, and the survivors skip the step all the same."""
    cluster = job_env
    use_route(route, monkeypatch)
    cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", str(DATASET), "--batch-size", str(BATCH),
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--epochs", "2",
    )  # fmt: skip
    procs = {name: twin(cluster, name, epochs=2) for name in ("a", "b", "c")}
    cluster.until(
        lambda s: len(s.ranks) == 3 and s.last_committed >= 10, timeout=90, message="3 training"
    )
    procs["b"].kill(signal.SIGKILL)
    for name in ("a", "c"):
        assert cluster.finished(procs[name], 180) == 0, procs[name].output()[-3000:]
    assert max_abs_diff(load(cluster.saved("a")), load(cluster.saved("c"))) == 0.0
    cluster.pull()
    report = audit(f for _, f in cluster.facts)
    assert report.ok, report.problems
    assert report.epochs[0].finished and report.epochs[0].used == DATASET
    assert cluster.state.counters.failed == 1 and cluster.state.finished == "epochs=2 finished"


def test_loader_workers_prefetch_across_a_kill_with_a_constant_global_batch(
    job_env: Cluster,
) -> None:
    """The script's DataLoader with two persistent worker processes, strided placement and
    a global batch of 96: three ranks take 32 each; once one is SIGKILLed mid-epoch, the two
    left take 48 each, in micro-batches of 32 and 16. What the loaders had prefetched for
    the dead world is dropped, every sample is used once, and the survivors agree."""
    cluster = job_env
    cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", str(DATASET), "--batch-size", str(BATCH),
        "--global-batch", str(3 * BATCH), "--placement", "strided",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5", "--epochs", "2",
    )  # fmt: skip
    procs = {n: twin(cluster, n, 2, "--loader-workers", "2") for n in ("a", "b", "c")}
    cluster.until(
        lambda s: len(s.ranks) == 3 and s.last_committed >= 8, timeout=120, message="3 training"
    )
    procs["b"].kill(signal.SIGKILL)
    for name in ("a", "c"):
        assert cluster.finished(procs[name], 240) == 0, procs[name].output()[-3000:]
    assert max_abs_diff(load(cluster.saved("a")), load(cluster.saved("c"))) == 0.0
    cluster.pull()
    report = audit(f for _, f in cluster.facts)
    assert report.ok, report.problems
    for epoch in (0, 1):
        assert report.epochs[epoch].finished and report.epochs[epoch].used == DATASET
    # constant global batch: ceil(4096 / 96) steps an epoch, whatever the world did
    assert report.epochs[0].steps == report.epochs[1].steps == -(-DATASET // (3 * BATCH))
    assert cluster.state.counters.failed == 1 and cluster.state.finished == "epochs=2 finished"


if __name__ == "__main__":
    ddp_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
