"""One rank of zero3_host_time.py: `toolkit train ARGS` as a rank runs it (toolkit.cli.main), with the loop's
step, its micro-batches' forward-backward, the strategy's optimizer step, AdamW's own step and the process-group
collectives DeepSpeed calls (and the waits on its asynchronous gathers) timed around each call. Rank 0 writes the
per-step means past the first `--skip` steps to the JSON file named by HOST_TIME_OUT."""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

SECONDS: collections.Counter = collections.Counter()
STEPS: list[dict] = []
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather")


def timed(owner, name: str, key: str) -> None:
    call = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def instrument() -> None:
    for name in COLLECTIVES:  # DeepSpeed's torch backend looks them up on torch.distributed at each call
        timed(dist, name, "collectives")
        setattr(c10d, name, getattr(dist, name))
    import torch.optim
    from deepspeed.runtime.zero import partition_parameters

    from toolkit.strategies.zero.engine import ZeroStrategy
    from toolkit.train import loop

    timed(partition_parameters.AllGatherHandle, "wait", "collectives")
    timed(partition_parameters.AllGatherCoalescedHandle, "wait", "collectives")
    timed(ZeroStrategy, "step", "optimizer step")
    timed(torch.optim.AdamW, "step", "adamw")
    timed(torch.optim.Adam, "step", "adamw")
    timed(loop, "run_microbatches", "forward-backward")
    step = loop.train_step

    def train_step(*args, **kwargs):
        before, start = dict(SECONDS), time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            STEPS.append({"step": time.perf_counter() - start,
                          **{k: SECONDS[k] - before.get(k, 0.0) for k in SECONDS}})
            write()

    loop.train_step = train_step


def write() -> None:
    skip = int(os.environ.get("HOST_TIME_SKIP", "3"))
    if os.environ.get("RANK", "0") != "0" or len(STEPS) <= skip:
        return
    kept = STEPS[skip:]
    keys = sorted({k for s in kept for k in s})
    means = {k: sum(s.get(k, 0.0) for s in kept) / len(kept) for k in keys}
    with open(os.environ["HOST_TIME_OUT"], "w") as f:
        json.dump({"steps": len(kept), **means}, f)


if __name__ == "__main__":
    from toolkit.launch.launcher import prepare_environment

    prepare_environment()
    instrument()
    from toolkit.cli import main

    sys.exit(main(sys.argv[1:]))
