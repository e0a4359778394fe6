"""The toolkit's step time vs a minimal hand-written loop of the same strategy, same model and batches.

    python benchmarks/compare_overhead.py [--strategies ddp,fsdp,zero2] [--steps 40] [--nproc 2] [--repeats 2]

For each strategy, `toolkit launch` and `benchmarks/minimal_loop.py` (plain DDP / fully_shard /
deepspeed.initialize under torchrun) run alternately `--repeats` times on the same resolved recipe, so
both see identical micro-batches at every step. Each run's step time is the median after a warm-up
fifth; the table shows the median over repeats and the toolkit's overhead in percent (target < 3%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from toolkit.strategies.names import ARM_ALIASES  # noqa: E402


def median_after_warmup(times: list[float]) -> float:
    return statistics.median(times[max(1, len(times) // 5):])


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")


def sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def toolkit_step_s(recipe: str, overrides: list[str], *, nproc: int, out: Path) -> float:
    run([sys.executable, "-m", "toolkit", "launch", "--nproc", str(nproc), recipe,
         *sets([*overrides, f"output_dir={out}"])])
    return median_after_warmup([json.loads(l)["step_time_s"] for l in (out / "metrics.jsonl").read_text().splitlines()])


def minimal_step_s(recipe: str, overrides: list[str], *, nproc: int, out: Path) -> float:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         str(REPO / "benchmarks" / "minimal_loop.py"), "--recipe", recipe, "--out", str(out), *sets(overrides)])
    return median_after_warmup(json.loads(out.read_text())["step_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,fsdp,zero2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "llama-tiny.yaml"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies.split(","):
            # no eval, no progress bar, no dropout, a constant lr: nothing the minimal loop lacks
            overrides = [*ARM_ALIASES[name], f"train.max_steps={args.steps}", "train.eval_every=null",
                         "data.eval=null", "train.progress=false", "model.dropout=0.0", "optim.warmup_steps=0",
                         "optim.schedule=constant", "batch.grad_accum_steps=1"]
            toolkit, minimal = [], []
            for repeat in range(args.repeats):
                toolkit.append(toolkit_step_s(args.recipe, overrides, nproc=args.nproc, out=Path(tmp) / f"{name}-{repeat}"))
                minimal.append(minimal_step_s(args.recipe, overrides, nproc=args.nproc,
                                              out=Path(tmp) / f"{name}-{repeat}-minimal.json"))
                print(f"{name} repeat {repeat + 1}/{args.repeats}: toolkit {toolkit[-1] * 1e3:.1f} ms, "
                      f"minimal {minimal[-1] * 1e3:.1f} ms", file=sys.stderr)
            t, m = statistics.median(toolkit), statistics.median(minimal)
            rows.append((name, t * 1e3, m * 1e3, (t / m - 1) * 100))
    print(f"{'strategy':<10}{'toolkit ms':>12}{'minimal ms':>12}{'overhead %':>12}")
    for name, t, m, over in rows:
        print(f"{name:<10}{t:>12.1f}{m:>12.1f}{over:>12.1f}")


if __name__ == "__main__":
    main()
