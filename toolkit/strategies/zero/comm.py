"""DeepSpeed's communication backend, made once per process by the toolkit before DeepSpeed's first use of it
(zero.Init, deepspeed.initialize), over the process group the toolkit made. DeepSpeed makes it itself otherwise,
and its shared-memory op's 'DeepSpeed ... built successfully' line (deepspeed/comm/torch.py, a print) came from
every rank of every ZeRO run; that line is left out, anything else printed passes through."""

from __future__ import annotations

import contextlib
import io
import re
import sys

BUILT = re.compile(r"DeepSpeed \S+ built successfully")


def init_deepspeed_comm() -> None:
    import deepspeed.comm
    from deepspeed.accelerator import get_accelerator  # DS_ACCELERATOR: see toolkit.launch.launcher.prepare_environment

    if deepspeed.comm.is_initialized():
        return
    with contextlib.redirect_stdout(io.StringIO()) as said:
        deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    for line in said.getvalue().splitlines():
        if not BUILT.fullmatch(line.strip()):
            print(line, file=sys.stdout, flush=True)
