"""`toolkit launch`: checks the recipe, then hands the ranks to torch's own launcher (torch.distributed.run)."""

from __future__ import annotations

import os
import sys

from toolkit.errors import USER_ERROR_EXIT_CODE


def worker_args(recipe_path: str, overrides: list[str]) -> list[str]:
    args = ["-m", "toolkit", "train", recipe_path]
    for item in overrides:
        args += ["--set", item]
    return args


def torchrun_args(recipe_path: str, *, nproc: int, overrides: list[str]) -> list[str]:
    """The torch.distributed.run command line: one node, a free local port, `nproc` ranks, this interpreter."""
    return ["--standalone", f"--nproc_per_node={nproc}", "--no-python", sys.executable,
            *worker_args(recipe_path, overrides)]


def prepare_environment() -> None:
    """Settings every rank inherits: offline hubs, DeepSpeed's CPU accelerator when no GPU is seen."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; torchrun would set it too


def launch(recipe_path: str, *, nproc: int, overrides: list[str]) -> int:
    """Run the recipe on `nproc` local ranks through torch.distributed.run; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    prepare_environment()
    args = get_args_parser().parse_args(torchrun_args(recipe_path, nproc=nproc, overrides=overrides))
    try:
        run(args)
    except ChildFailedError as exc:
        codes = sorted({failure.exitcode for failure in exc.failures.values()})
        print(f"toolkit: launch failed: rank exit codes {codes} (see the rank output above)", file=sys.stderr)
        return USER_ERROR_EXIT_CODE if codes == [USER_ERROR_EXIT_CODE] else 1
    return 0
