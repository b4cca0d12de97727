"""An evaluator of the bundled trainer's job: `python -m tests.integration.evaluate URL JOB
NAME EVERY`. Prints one JSON line per evaluation: the step, its metrics and the digest of
the weights it read (the trainer's own digest, as StepDone reports it)."""

from __future__ import annotations

import json
import sys

import numpy as np

import cohort
from cohort import mlp
from cohort.worker.collective import tensors


def main(url: str, job: str, name: str, every: int) -> None:
    held_out = mlp.dataset(size=512, seed=99)
    conn = cohort.connect(cohort.RedisSettings.resolve(url))
    with cohort.Evaluator(conn, job, worker_id=name, every=every, heartbeat_interval=0.5) as ev:
        for checkpoint in ev.checkpoints():
            params = {
                k: np.array(v, dtype=np.float64)
                for k, v in tensors.unpack(checkpoint.payload).items()
            }
            loss, accuracy = mlp.evaluate(params, held_out)
            ev.report(checkpoint.step, {"loss": loss, "accuracy": accuracy})
            line = {"step": checkpoint.step, "loss": loss, "digest": mlp.digest(params),
                    "journaled": checkpoint.digest}  # fmt: skip
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
