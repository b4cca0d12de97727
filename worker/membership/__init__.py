"""A training process's membership of a job: the `Worker` client (`client.py`) that joins,
heartbeats, follows the journal into a frozen `View` (`view.py`, `following.py`) and
leaves; the outbox and retries that carry its commands through Redis outages
(`outbox.py`, `retry.py`); and the transfer queue that honours the GPU advice
(`transfers.py`, `advice.py`).

May import: `cohort.events`, `cohort.worker.errors`, `cohort.worker.telemetry`.
"""
