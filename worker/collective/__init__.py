"""Averaging arrays over the ranks of a world: `Collective` (reduce-scatter then all-gather
through Redis, `redis_collective.py`) over its chunk layout (`layout.py`), its transport
(`wire.py`, `placement.py` for a Cluster's primaries) and tensor blobs (`tensors.py`);
the per-host hierarchy (`hierarchy.py`); and compression: the pure int8 and low-rank codes
(`codes.py`) and the compressors that keep error feedback around them (`compressors.py`).

May import: `cohort.events`, `cohort.worker.errors`, `cohort.worker.telemetry`,
`cohort.worker.membership`.
"""
