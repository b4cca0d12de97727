"""One TorchFT replica group for the benchmarks (bench/torchft_peer.py): bench.goodput's model
and data, one process per group, gloo, a `torchft.Manager` over its fault-tolerant
`ProcessGroupGloo`, the lighthouse the bench started.

Written as TorchFT's own DDP example is (a Manager with the model's and optimizer's state
dicts, its DDP wrapper, its OptimizerWrapper), with the Manager's and the process group's
timeouts at their defaults. Each group keeps its own TCPStore, as torchrun would start one
per group. The wrapper is one of

- `stock`: `torchft.ddp.DistributedDataParallel` as torchft 0.2.0 ships it;
- `fixed`: the same class with the smallest fix we found for a kill that lands during an
  allreduce (its comm hook returns the inner future of the work, which is missing on the
  failed work and on the no-op work of the buckets after it): a completed future holding
  the bucket instead. The manager has recorded the error, so the step is not committed.

Each step appends one JSON line to --log: time, the manager's step after it, whether the
step committed, how many groups took part, the group and the pid. The first SIGTERM ends
the group at the next step's end with `manager.shutdown()` (a clean leave); with --steps it
trains that many committed steps, then prints the timed span as bench.throughput's ranks do.
An exception ends the process with exit code 1 (see `exit_on_error`).

    python -m bench.torchft_trainer --group 0 --groups 2 --lighthouse http://HOST:PORT \\
        --log steps.jsonl [--ddp stock|fixed] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

WARMUP = 5
"""Steps before a --steps run's timed span (bench.throughput's 1m model's)."""


def fixed_ddp() -> Any:
    """torchft's DDP wrapper with a comm hook that survives a failed allreduce."""
    import torch
    from torchft.ddp import DistributedDataParallel

    class Fixed(DistributedDataParallel):  # type: ignore[misc]
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
            # no annotations: DDP refuses a hook whose annotations are not its own types
            work = state.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
            # the allreduce failed (or a failure before it made it a no-op): the manager
            # knows, should_commit() says no, and the gradient is never applied
            done: Any = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return Fixed


def train(args: argparse.Namespace) -> None:
    import torch
    from torchft import Optimizer
    from torchft.ddp import DistributedDataParallel

    from bench.goodput import BATCH, _data
    from bench.throughput import build

    torch.set_num_threads(1)
    leaving: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, _: leaving.append(sig))
    data = _data()
    model = build("1m")
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        sgd.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": sgd.state_dict()}

    store, manager = _manager(args, load_state_dict, state_dict)  # kept: its server ends if freed
    wrapper = fixed_ddp() if args.ddp == "fixed" else DistributedDataParallel
    ddp = wrapper(manager, model)
    optimizer = Optimizer(manager, sgd)
    collate = torch.utils.data.default_collate
    first: tuple[float, int] | None = None
    with open(args.log, "a") as log:
        while not leaving:
            step = manager.current_step()
            start = ((step * args.groups) + args.group) * BATCH
            x, y = collate([data[i] for i in range(start, start + BATCH)])
            optimizer.zero_grad()  # starts the step's quorum
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()  # applies the step only if every group's allreduce held
            committed = manager.current_step() > step
            line = {"t": time.time(), "step": manager.current_step(), "committed": committed,
                    "groups": manager.num_participants(), "group": args.group,
                    "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(line) + "\n")
            log.flush()
            if args.steps and first is None and manager.current_step() >= WARMUP:
                first = (time.perf_counter(), manager.current_step())
            if args.steps and manager.current_step() >= args.steps:
                break
    if first is not None:
        done = manager.current_step() - first[1]
        print(json.dumps({"seconds": time.perf_counter() - first[0], "steps": done}), flush=True)
    manager.shutdown(wait=False)
    os._exit(0)  # torch's and the manager's threads may hold the exit otherwise


def _manager(
    args: argparse.Namespace,
    load_state_dict: Callable[[dict[str, Any]], None],
    state_dict: Callable[[], dict[str, Any]],
) -> tuple[Any, Any]:
    """This replica group's store and TorchFT Manager (one rank, the bench's lighthouse):
    the caller keeps the store, whose server ends when it is freed."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"bench_{args.group}",
    )


def exit_on_error(body: Callable[[], None]) -> None:
    """`body()`; an exception ends the process at once with exit code 1, so that the restart
    loop sees it die: left to Python's exit, a TorchFT manager's threads hold it alive
    (measured with torchft 0.2.0: the process stops training and never exits)."""
    try:
        body()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.torchft_trainer")
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--ddp", choices=("stock", "fixed"), default="fixed")
    parser.add_argument("--steps", type=int, default=0, help="stop after N committed steps")
    args = parser.parse_args()
    exit_on_error(lambda: train(args))


if __name__ == "__main__":
    main()
