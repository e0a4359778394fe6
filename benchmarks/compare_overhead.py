"""The toolkit's step time vs a minimal hand-written loop of the same strategy, same model and batches.

    python benchmarks/compare_overhead.py [--strategies ddp,fsdp,zero2,zero3] [--steps 60] [--nproc 2]

One torchrun job per strategy runs `benchmarks/overhead_worker.py`: the toolkit's `train_step` (plus its
metrics write) and a minimal plain DDP / fully_shard / deepspeed.initialize step, on two identical
models, alternating step by step on the same micro-batches. Steps in the first fifth are warm-up.
Columns: median step time of each side; the overhead as the median of the per-step paired ratios
(toolkit/minimal on the same batch, the steadier number on a noisy machine) with their p25–p75 band,
which shows how much of it is noise. Target: toolkit overhead < 3%.

Why an in-process hook, not `toolkit launch` beside a script of its own: the two sides alternate step by step on
the same batches in one process, so machine noise hits both alike; separate runs on a shared 2-core machine
differ by more than the 3 % measured. The worker starts as a rank of `toolkit launch` does (torchrun; the
toolkit's environment; the recipe's checks, its train.host_memory allocator and run.json), and the toolkit side
is the loop's own `train_step`.
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
from toolkit.strategies import arm_aliases  # noqa: E402


def measure(recipe: str, overrides: list[str], *, nproc: int, out: Path) -> dict:
    sets = [a for o in overrides for a in ("--set", o)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "benchmarks" / "overhead_worker.py"), "--recipe", recipe, "--out", str(out), *sets]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarise(times: dict) -> tuple[float, float, float, float, float]:
    skip = max(1, len(times["toolkit"]) // 5)
    toolkit, minimal = times["toolkit"][skip:], times["minimal"][skip:]
    ratios = [(a / b - 1) * 100 for a, b in zip(toolkit, minimal)]
    p25, _, p75 = statistics.quantiles(ratios, n=4)
    return (statistics.median(toolkit) * 1e3, statistics.median(minimal) * 1e3, statistics.median(ratios),
            p25, p75)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,fsdp,zero2,zero3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "llama-tiny.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra recipe overrides")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies.split(","):
            # no eval, no dropout, a constant lr, no accumulation: nothing the minimal step lacks
            overrides = [*arm_aliases()[name], f"train.max_steps={args.steps}", "train.eval_every=null",
                         "data.eval=null", "train.progress=false", "model.dropout=0.0", "optim.warmup_steps=0",
                         "optim.schedule=constant", "batch.grad_accum_steps=1", f"output_dir={tmp}/{name}",
                         *args.overrides]
            rows.append((name, *summarise(measure(args.recipe, overrides, nproc=args.nproc,
                                                  out=Path(tmp) / f"{name}.json"))))
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"{'strategy':<10}{'toolkit ms':>12}{'minimal ms':>12}{'overhead %':>12}{'p25..p75 %':>16}")
    for name, t, m, over, p25, p75 in rows:
        print(f"{name:<10}{t:>12.1f}{m:>12.1f}{over:>12.1f}{f'{p25:.1f}..{p75:.1f}':>16}")


if __name__ == "__main__":
    main()
