"""A training script as a user writes it for `cohort run`: numpy, nothing of cohort's on its
command line, each step paced so that a test can kill a rank mid-epoch.

    python run_script.py [PACE_SECONDS] [--fail-at-import] [--record-at-end] [--crash-at STEP]
                         [--env-to DIR]

`--record-at-end` records a figure after the loop (a final validation's, as a script does);
`--crash-at STEP` exits 1 as it is given that step (a script with a bug); `--env-to DIR`
writes DIR/WORKER_ID.json as it starts: its pid, local rank, spare flag and the
CUDA_VISIBLE_DEVICES it was given (null: none).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if "--fail-at-import" in sys.argv:
    import no_such_module  # noqa: F401 - a script that cannot start

import numpy as np

import cohort

SAMPLES, FEATURES = 512, 8


def write_env(folder: Path) -> None:
    """What the launcher gave this process, in a file of its worker id's."""
    seen = {
        "pid": os.getpid(),
        "local_rank": os.environ.get("COHORT_LOCAL_RANK"),
        "spare": os.environ.get("COHORT_SPARE"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    path = folder / f"{os.environ['COHORT_WORKER_ID']}.json"
    path.with_suffix(".partial").write_text(json.dumps(seen))
    path.with_suffix(".partial").replace(path)  # a reader never sees half a file


def main() -> None:
    if "--env-to" in sys.argv:
        write_env(Path(sys.argv[sys.argv.index("--env-to") + 1]))
    pace = float(sys.argv[1]) if len(sys.argv) > 1 else 0.02
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(SAMPLES, FEATURES)), rng.normal(size=SAMPLES)
    job = cohort.NumpyElasticJob(dataset=cohort.Dataset(size=SAMPLES, fingerprint="run-itest"))
    params = job.wrap({"w": np.zeros(FEATURES)})
    crash_at = int(sys.argv[sys.argv.index("--crash-at") + 1]) if "--crash-at" in sys.argv else -1
    for step in job.steps():
        if step.step == crash_at:
            sys.exit(1)
        with job.attempt(step):
            xs, ys = x[step.samples], y[step.samples]
            grad = xs.T @ (xs @ params["w"] - ys) / max(len(ys), 1)
            params["w"] -= 0.1 * job.allreduce({"w": grad})["w"]
            job.worker.stopping.wait(pace)
    if "--record-at-end" in sys.argv:
        job.record(val_loss=0.125)  # after the last step: no next step's report to ride on
    job.close()
    print(json.dumps({"worker": job.worker.id, "steps": job.steps_done}))


if __name__ == "__main__":
    main()
