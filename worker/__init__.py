"""The training side of cohort, in rooms that depend one way (tests/unit/test_layering.py):

    telemetry  <-  membership  <-  collective  <-  loop  <-  pytorch

- `telemetry/`: what a worker measures of its machine (NVML readings, the node it runs on).
- `membership/`: the `Worker` client: join, heartbeat, follow the journal, step, leave.
- `collective/`: averaging arrays over the ranks of a world, through Redis.
- `loop/`: training loops over numpy arrays, checkpoints and the evaluator.
- `pytorch/`: the PyTorch integration and the torchrun plug-in; the only room that imports
  torch.

`errors.py` holds the worker's exceptions; every room may import it. A room imports the
rooms to its left and `cohort.events`, never one to its right, and nothing in `worker/`
imports `cohort.coordinator`.
"""
