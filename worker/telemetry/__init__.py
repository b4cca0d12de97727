"""What a worker measures of its machine: GPU readings through NVML (`gpu.py`) and the node
it runs on (`node.py`).

May import: `cohort.events`, `cohort.worker.errors`. Nothing else of the worker.
"""
