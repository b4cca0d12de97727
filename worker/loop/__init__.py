"""Training loops that need no framework: the numpy `NumpyElasticJob` (`elastic.py`), the
evaluator member (`evaluator.py`), checkpoint files through fsspec (`checkpoints.py`) and
a simulated trainer for tests and benchmarks (`simulated.py`).

May import: `cohort.events`, `cohort.worker.errors` and the rooms below it: telemetry,
membership, collective.
"""
