"""DeepSpeed's communication backend, made once per process by the toolkit before DeepSpeed's first use of it
(zero.Init, deepspeed.initialize), over the process group the toolkit made. DeepSpeed makes it itself otherwise,
and its shared-memory op's 'DeepSpeed ... built successfully' line (deepspeed/comm/torch.py, a print) came from
every rank of every ZeRO run; that line is left out, anything else printed passes through. Before it, what ended
DeepSpeed processes left behind is cleared (toolkit.process.leftovers); after it, this rank's shared-memory segment
is unlinked, which DeepSpeed never does."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

BUILT = re.compile(r"DeepSpeed \S+ built successfully")


def tell_local_size() -> None:
    """DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE, which DeepSpeed's own launcher sets; without
    it each count runs `numactl --hardware` in a subprocess, and ZeRO-3 counts once per gradient bucket it reduces
    (stage3.py __avg_scatter_grads): a fork of the rank per bucket, 7 % of a minilm-sst zero3 step at 2 ranks. It
    is this machine's ranks as the launcher set them (1 in a process no launcher started)."""
    from toolkit.process.dist import env_world_size, machines_of

    os.environ.setdefault("LOCAL_SIZE", str(machines_of(env_world_size())[1]))


def init_deepspeed_comm() -> None:
    from toolkit.process.leftovers import clear_deepspeed_leftovers

    tell_local_size()  # in the process that trains, never in a launcher whose ranks would inherit it
    clear_deepspeed_leftovers()  # before DeepSpeed loads its first op: a stale build lock would hang it
    import deepspeed.comm
    from deepspeed.accelerator import get_accelerator  # DS_ACCELERATOR: see toolkit.launch.launcher.prepare_environment

    if deepspeed.comm.is_initialized():
        return
    with contextlib.redirect_stdout(io.StringIO()) as said:
        deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    for line in said.getvalue().splitlines():
        if not BUILT.fullmatch(line.strip()):
            print(line, file=sys.stdout, flush=True)
    unlink_shm_segment()


def shm_segment(rank: int) -> Path:
    """The shared-memory segment DeepSpeed's CPU collectives made for `rank` (shm.cpp shm_initialize: its uid,
    MASTER_ADDR, MASTER_PORT, rank), when every rank is on this machine (LOCAL_SIZE = the world size)."""
    from toolkit.process.leftovers import SHM, SHM_PREFIX

    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM / f"{SHM_PREFIX}_{os.getuid()}_{address}_{port}_{rank}"


def unlink_shm_segment() -> None:
    """DeepSpeed never unlinks its segment: 66 MB per rank stayed in /dev/shm after each run, until the machine
    restarted. Each rank maps its peers' segments by name while it starts its collectives; once every rank is past
    that (a barrier), this rank's name is removed. The memory stays mapped for as long as a rank uses it and goes
    with the last of them, however the run ends."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    shm_segment(dist.get_rank() if dist.is_initialized() else 0).unlink(missing_ok=True)
