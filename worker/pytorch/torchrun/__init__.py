"""torchrun's `--rdzv-backend=cohort`: the rendezvous handler (`handler.py`) torch loads
through the `torchrun.handlers` entry point (`plugin.py`, which imports nothing at load),
torch's rendezvous state behind a fenced compare-and-set in Redis (`rendezvous_backend.py`)
and the agents' c10d store in Redis (`c10d_store.py`).

May import: `cohort.events`, `cohort.worker.errors`, and the rooms below `pytorch`.
"""
