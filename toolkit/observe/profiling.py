"""`train.profile_steps: [first, last]`: torch.profiler over those optimizer steps, on every rank.

What it writes into output_dir/profile (each file whole or not at all):
  rank<r>.trace.json   the kernels and ops of every profiled step on that rank (chrome://tracing, Perfetto)
  ops.txt              rank 0's ops by their own time (self CUDA time on a GPU, self CPU time otherwise): where
                       a step goes, without opening the trace
The profiled steps run slower (the profiler's own hooks): metrics.jsonl marks them `profiled` and throughput
(`toolkit compare`, the benchmarks) leaves them out. A run that ends inside the window (a stop signal, an error
in a later step) writes what it recorded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from toolkit.atomic import write_text_whole, write_whole
from toolkit.config.recipe import Recipe
from toolkit.process.dist import DistEnv

ROWS = 40  # ops.txt's length


class StepProfiler:
    """Starts torch.profiler before the window's first step, stops it after its last, writes the files."""

    def __init__(self, recipe: Recipe, *, env: DistEnv, out_dir: Path, done: int):
        window = recipe.train.profile_steps
        self.first, self.last = window if window is not None else (0, -1)
        self.first = max(self.first, done + 1)  # a resumed run profiles what is left of the window
        self.env, self.folder = env, out_dir / "profile"
        self._profiler: torch.profiler.profile | None = None
        self.recorded: list[int] = []  # the steps the profiler saw end (a run can stop inside the window)
        self.written = False

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before(self, step: int) -> None:
        if step != self.first or self.last < self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()

    def after(self, step: int) -> None:
        if self._profiler is not None:
            self.recorded.append(step)
        if step == self.last:
            self.close()

    @property
    def steps(self) -> str:
        return f"{self.recorded[0]}..{self.recorded[-1]}" if self.recorded else f"{self.first} (not finished)"

    def close(self) -> None:
        """Stop and write, once (also when the run ends inside the window). Called from the loop's `finally`:
        a failure here is one line, never in place of the error the run is ending with."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        try:
            profiler.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            trace = self.folder / f"rank{self.env.rank}.trace.json"
            write_whole(trace, lambda tmp: profiler.export_chrome_trace(str(tmp)))
            if self.env.is_main:
                key = "self_cuda_time_total" if self.env.device.type == "cuda" else "self_cpu_time_total"
                table = profiler.key_averages().table(sort_by=key, row_limit=ROWS)
                ops = self.folder / "ops.txt"
                write_text_whole(ops, f"steps {self.steps}, rank 0, by {key}\n{table}\n")
                print(f"[toolkit] profiled steps {self.steps}: {ops} (the costliest ops), "
                      f"{self.folder}/rank*.trace.json (chrome://tracing or ui.perfetto.dev)", file=sys.stderr,
                      flush=True)
            self.written = True
        except Exception as exc:  # a full disk, say: the run's own outcome stands
            print(f"[toolkit] warning: train.profile_steps: the profile of rank {self.env.rank} was not written "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
