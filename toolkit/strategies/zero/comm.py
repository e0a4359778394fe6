"""DeepSpeed's communication backend, made once per process by the toolkit before DeepSpeed's first use of it
(zero.Init, deepspeed.initialize), over the process group the toolkit made, without DeepSpeed's CPU shared-memory
collectives (see skip_shm_collectives). Before it, what ended DeepSpeed processes left behind is cleared
(toolkit.process.leftovers)."""

from __future__ import annotations

import os


def tell_local_size() -> None:
    """DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE, which DeepSpeed's own launcher sets; without
    it each count runs `numactl --hardware` in a subprocess, and ZeRO-3 counts once per gradient bucket it reduces
    (stage3.py __avg_scatter_grads): a fork of the rank per bucket, 7 % of a minilm-sst zero3 step at 2 ranks. It
    is this machine's ranks as the launcher set them (1 in a process no launcher started)."""
    from toolkit.process.dist import env_world_size, machines_of

    os.environ.setdefault("LOCAL_SIZE", str(machines_of(env_world_size())[1]))


def skip_shm_collectives() -> None:
    """DeepSpeed's CPU accelerator builds a shared-memory op when its comm starts, and where every rank is on one
    machine (LOCAL_SIZE = the world size) each rank creates a 66 MB segment in /dev/shm with it
    (deepspeed/ops/csrc/cpu/comm/shm.cpp), used only by `inference_all_reduce`: training's collectives are
    torch.distributed's. Where /dev/shm is smaller than the ranks' segments (Docker's default is 64 MB) a 2-rank
    ZeRO run died of SIGSEGV; elsewhere each run left its segments behind, never unlinked (19 GB in a day of test
    runs here), and its first run waited ~25 s for the op's build. Marked incompatible for this process
    (deepspeed.ops keeps one probed table, whose edits persist), the op is neither built nor started."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_deepspeed_comm() -> None:
    from toolkit.process.leftovers import clear_deepspeed_leftovers

    tell_local_size()  # in the process that trains, never in a launcher whose ranks would inherit it
    import deepspeed.comm
    from deepspeed.accelerator import get_accelerator  # DS_ACCELERATOR: see toolkit.launch.launcher.prepare_environment

    if deepspeed.comm.is_initialized():  # a ZeRO-3 process comes here twice: building its model, then in setup
        return
    clear_deepspeed_leftovers()  # before DeepSpeed loads an op: a stale build lock would hang it
    skip_shm_collectives()
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
