"""A training process's membership of a job.

`client.py` holds the `Worker` a training loop calls; it composes the rest:
`view.py` (the frozen View, a pure fold of journal facts), `following.py` (the tail thread
that folds the journal into it and the waits on it), `joining.py` (a Join sent and its
answer awaited), `heartbeat.py` (the heartbeat thread), `presence.py` (a subscription
that dies with the process, so the leader sees a death at once), `stamp.py` (the header of every
command), `delivery.py`, `outbox.py` and `retry.py` (commands carried to the inbox in order
and through Redis outages), `advice.py` and `transfers.py` (GPU readings and workloads up,
the GPU advice back, and the transfer queue that honours it), `credential.py` (a new
secret taken up when the job key is rotated) and `signals.py` (the first SIGINT/SIGTERM
leaves, the second exits).

May import: `cohort.events`, `cohort.worker.errors`, `cohort.worker.telemetry`.
"""
