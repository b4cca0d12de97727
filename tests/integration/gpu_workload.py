"""A member that registers a GPU workload and queues transfers, then waits to be stopped:
`python -m tests.integration.gpu_workload URL JOB NAME`."""

from __future__ import annotations

import sys

import cohort


def main(url: str, job: str, name: str) -> None:
    conn = cohort.connect(cohort.RedisSettings.resolve(url))
    worker = cohort.Worker(conn, job, worker_id=name, heartbeat_interval=0.5)
    worker.install_signal_handlers()
    worker.join(timeout=30)
    worker.register_workload("train", devices=(0, 1), memory=3 * 2**30, priority=5)
    first = worker.schedule_transfer(10 * 2**20, "model")
    worker.schedule_transfer(20 * 2**20, "dataset")
    worker.schedule_transfer(30 * 2**20, "dataset", priority=1)
    worker.transfers.start(first.transfer)
    print("queued", flush=True)
    worker.stopping.wait()
    worker.leave("stopped")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
