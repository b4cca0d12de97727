"""The PyTorch integration, the only room that imports torch (lazily: importing a module
here does not import torch until it is used). `api.py` is what `cohort.torch` shows;
`elastic.py` the torch `ElasticJob`; `micro.py` a step's micro-batches as the script sees
them (the gradients parked between them, the scheduler and GradScaler gated); `sync.py`
gradient averaging, state broadcast and local SGD; `staging.py` how tensors reach the host
for Redis and come back (pinned buffers and a side stream on CUDA); `loader.py` the data
loader's sampler; `overlap.py` gradient accumulation overlapped with the backward pass; `dist.py`
torch.distributed process groups made anew at every world; `completion.py` when a bucket's
allreduce is done (on the host for gloo, on the device for NCCL); `devices.py` the device a
rank trains on; `sharded.py` an FSDP2 model sharded anew in each world (`wrap(shard=...)`,
its collectives guarded); `torchrun/` the
`--rdzv-backend=cohort` plug-in.

May import: `cohort.events`, `cohort.worker.errors` and every room below it.
"""
