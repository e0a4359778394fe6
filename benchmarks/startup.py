"""How long a short job takes from the command to its exit, as a user starts it: `toolkit launch` of 2 ranks and
`toolkit train` of one process, each a 1-step run of the tiny Llama (ddp, no evaluation during the run), beside
`python -c "import torch"`, the floor every process pays, and the imports alone of such a launch (a launcher's
torch.distributed.run, then two processes importing torch and transformers' Llama side by side): what the toolkit
adds is the launch minus that floor. A compare of short arms spends most of its time here.

    python benchmarks/startup.py [--runs 3]

Each command runs `--runs` times in a subprocess from the repository root, with the environment a user has, into
a fresh output folder; the table gives the median, the fastest and the slowest wall-clock seconds."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit_runs import REPO, print_table

JOB = ["recipes/llama-tiny.yaml", "--set", "strategy.name=ddp", "--set", "train.max_steps=1",
       "--set", "train.eval_every=null"]
FLOOR = ("import subprocess, sys, torch.distributed.run; "
         "rank = 'import torch, transformers.models.llama.modeling_llama'; "
         "ranks = [subprocess.Popen([sys.executable, '-c', rank]) for _ in range(2)]; "
         "sys.exit(max(r.wait() for r in ranks))")
LAUNCH_NAME, FLOOR_NAME = "toolkit launch --nproc 2 (ddp, 1 step)", "imports alone: launcher + 2 ranks (floor)"
COMMANDS = {
    LAUNCH_NAME: ["-m", "toolkit", "launch", "--nproc", "2", *JOB],
    "toolkit train (1 process, 1 step)": ["-m", "toolkit", "train", *JOB],
    "python -c 'import torch'": ["-c", "import torch"],
    # what any 2-rank launch of this model pays before its job: the launcher's torch.distributed.run, then two
    # processes side by side importing torch and transformers' Llama (which imports torch's DTensor and dynamo)
    FLOOR_NAME: ["-c", FLOOR],
}


def timed(args: list[str], *, output: Path | None) -> float:
    cmd = [sys.executable, *args, *(["--set", f"output_dir={output}"] if output else [])]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each command (default 3)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        for run in range(args.runs):  # the commands alternate, so a slow minute of the machine touches each
            for index, (name, command) in enumerate(COMMANDS.items()):
                print(f"[benchmark] run {run + 1}/{args.runs}: {name} ...", file=sys.stderr, flush=True)
                output = Path(tmp) / f"run{run}-{index}" if "toolkit" in command else None
                times[name].append(timed(command, output=output))
    print_table(["command", "runs", "median s", "fastest s", "slowest s"],
                [[name, str(len(ts)), f"{statistics.median(ts):.2f}", f"{min(ts):.2f}", f"{max(ts):.2f}"]
                 for name, ts in times.items()])
    above = statistics.median(times[LAUNCH_NAME]) - statistics.median(times[FLOOR_NAME])
    print(f"the launch above its imports alone (medians): {above:.2f} s")


if __name__ == "__main__":
    main()
