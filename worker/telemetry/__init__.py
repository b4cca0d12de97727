"""What a worker measures of its machine: GPU readings through NVML (`gpu.py`) of the GPUs
its process was given (`visible.py`: CUDA_VISIBLE_DEVICES mapped to NVML's devices) and the
node it runs on (`node.py`).

May import: `cohort.events`, `cohort.worker.errors`. Nothing else of the worker.
"""
