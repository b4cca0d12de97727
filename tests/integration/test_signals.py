"""Signals in a training script: the first stops and leaves; once the worker has left, a
second has nothing of cohort's to cut short and the script's own saving code runs."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.integration.cluster import Cluster

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

# A training script whose "saving" waits for the test's go (a file), standing in for a
# save that takes a while; it writes `saved` only if nothing cut it short.
SCRIPT = """
import logging, pathlib, sys, threading
import numpy as np
import cohort

logging.basicConfig(level=logging.INFO)
url, go, saved = sys.argv[1:4]
job = cohort.NumpyElasticJob("itest", redis_url=url)
params = job.wrap({"w": np.zeros(4)})
for step in job.steps():
    with job.attempt(step):
        mean = job.allreduce({"w": np.ones(4)})
        params["w"] -= 0.1 * mean["w"]
job.close()
print("saving", flush=True)
pause = threading.Event()
while not pathlib.Path(go).exists():
    pause.wait(0.05)
pathlib.Path(saved).write_text(str(params["w"].sum()))
print("saved", flush=True)
"""


def test_a_second_ctrl_c_after_the_worker_left_lets_the_saving_code_finish(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.coordinator("c1", "--min-workers", "1")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    go, saved = tmp_path / "go", tmp_path / "saved"
    trainer = cluster.python("trainer", str(script), cluster.url, str(go), str(saved))
    cluster.until(lambda s: s.last_committed >= 3, 60, message="the script trains")
    trainer.kill(signal.SIGINT)
    wait_until(lambda: "saving" in trainer.output(), 30, message="it left and saves")
    assert "left job 'itest'" in trainer.output()
    trainer.kill(signal.SIGINT)  # impatient: the save is still running
    wait_until(lambda: "nothing to cut short" in trainer.output(), 10, message="it says so")
    go.touch()
    assert cluster.finished(trainer, 30) == 0, trainer.output()[-3000:]
    assert saved.exists() and "saved" in trainer.output()
