"""Compressed gradients train as well as exact ones: examples/torch_train.py's model, 3 ranks
(threads with their own connections) against a real redis-server, the same batches;
DiLoCo's pseudo-gradients go compressed with every rank ending on the same weights; and
`ElasticJob.wrap(compression=...)` survives a killed rank with the survivors equal."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from bench.allreduce import Fixed  # noqa: E402
from bench.compress import convergence, load_example  # noqa: E402
from cohort.events.connection import RedisSettings, connect  # noqa: E402
from cohort.localredis import LocalRedis  # noqa: E402
from cohort.worker.collective.redis_collective import Collective  # noqa: E402
from cohort.worker.pytorch.sync import LocalSGD  # noqa: E402
from tests.helpers import require_redis_server  # noqa: E402
from tests.integration.cluster import ROOT, Cluster  # noqa: E402

pytestmark = pytest.mark.redis_server
STEPS = 300


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with LocalRedis(appendonly=False, binary=require_redis_server()) as server:
        yield server.url


@pytest.fixture(scope="module")
def exact(url: str) -> dict[str, Any]:
    return convergence(url, None, steps=STEPS)


@pytest.mark.parametrize("compression", ["int8", "powersgd"])
def test_compressed_training_ends_within_one_percent_of_exact(
    url: str, exact: dict[str, Any], compression: str
) -> None:
    """PowerSGD at rank 4, no exact warm-up steps: the example's 64x16 first layer goes as
    factors, its 4x64 second layer and the biases exactly."""
    got = convergence(url, compression, 4, steps=STEPS)
    assert exact["identical"] and got["identical"]  # every rank holds the same bits
    assert exact["accuracy"] > 0.95  # the exact run learned something to compare with
    assert abs(got["loss"] / exact["loss"] - 1) < 0.01, (got, exact)
    assert abs(got["accuracy"] - exact["accuracy"]) < 0.01, (got, exact)


@pytest.mark.parametrize("compression", ["int8", "powersgd"])
def test_diloco_pseudo_gradients_go_compressed_and_every_rank_takes_the_same_weights(
    url: str, compression: str
) -> None:
    ex = load_example("torch_train")
    data = ex.Data(1024)
    n, syncs, every = 3, 4, 5
    models = [ex.build(0) for _ in range(n)]
    finals: list[dict[str, np.ndarray] | None] = [None] * n
    failures: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            conn = connect(RedisSettings(url=url))
            collective = Collective(conn, f"diloco-{compression}", Fixed(f"w{r}", r, n))
            model = models[r]
            inner = torch.optim.SGD(model.parameters(), lr=0.05)
            outer = LocalSGD(
                model,
                collective,
                every,
                mode="pseudo_gradient",
                outer_lr=0.7,
                outer_momentum=0.9,
                nesterov=True,
                compression=compression,  # type: ignore[arg-type]
            )
            outer.reset(0)
            for step in range(syncs * every):
                at = (step * n + r) * 16 % len(data.y)
                x, y = data.take(np.arange(at, at + 16))
                inner.zero_grad()
                ex.loss_of(model, x, y).backward()
                inner.step()
                outer.step(step)
            assert outer.syncs == syncs
            assert outer.compressor is not None
            assert outer.compressor.error  # type: ignore[attr-defined]  # feedback kept
            finals[r] = ex.params_of(model)
            conn.close()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    first = finals[0]
    assert first is not None
    for other in finals[1:]:
        assert other is not None
        for name in first:
            assert np.array_equal(first[name], other[name])
    assert not np.array_equal(first["0.weight"], ex.params_of(ex.build(0))["0.weight"])


@pytest.mark.slow
def test_elastic_job_with_powersgd_survives_a_killed_rank_with_the_survivors_equal(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three twins (examples/elastic_train.py, with $COHORT_COMPRESSION=powersgd:4); one is
    SIGKILLed mid-epoch. The next world resets every survivor's compressor at its first step (no
    error kept, Q seeded from that step), so the survivors finish with the same bits."""
    monkeypatch.setenv("COHORT_JOB", cluster.job)
    monkeypatch.setenv("COHORT_REDIS_URL", cluster.url)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("COHORT_COMPRESSION", "powersgd:4")
    cluster.coordinator(
        "c1", "--min-workers", "2", "--dataset-size", "4096", "--batch-size", "32",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2", "--epochs", "2",
    )  # fmt: skip
    procs = {
        name: cluster.python(
            name,
            str(ROOT / "examples" / "elastic_train.py"),
            "--save",
            str(cluster.saved(name)),
            "--epochs",
            "2",
        )  # fmt: skip
        for name in ("a", "b", "c")
    }
    cluster.until(
        lambda s: len(s.ranks) == 3 and s.last_committed >= 10, timeout=90, message="3 training"
    )
    procs["b"].kill(signal.SIGKILL)
    for name in ("a", "c"):
        assert cluster.finished(procs[name], 180) == 0, procs[name].output()[-3000:]
    a, c = np.load(cluster.saved("a")), np.load(cluster.saved("c"))
    for name in a.files:
        assert np.array_equal(a[name], c[name])
    cluster.pull()
    assert cluster.state.counters.failed == 1 and cluster.state.finished == "epochs=2 finished"
