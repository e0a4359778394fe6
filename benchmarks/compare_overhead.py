"""The toolkit's step time vs a minimal hand-written loop of the same strategy, same model and batch.

    python benchmarks/compare_overhead.py [--strategies ddp,fsdp,zero2] [--steps 30] [--nproc 2]

Each strategy runs twice under torchrun in one invocation: the toolkit (`toolkit train`) and
`benchmarks/minimal_loop.py` (plain DDP / fully_shard / deepspeed.initialize, the same AdamW, the same
pre-tokenised micro-batches). The table shows the median step time after warm-up and the ratio.
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
ARMS = {"ddp": ("strategy.name=ddp",), "fsdp": ("strategy.name=fsdp",),
        "zero2": ("strategy.name=zero", "strategy.stage=2"), "zero3": ("strategy.name=zero", "strategy.stage=3")}


def median_after_warmup(times: list[float]) -> float:
    return statistics.median(times[max(1, len(times) // 5):])


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,fsdp,zero2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "llama-tiny.yaml"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies.split(","):
            out = Path(tmp) / name
            sets = [*ARMS[name], f"train.max_steps={args.steps}", "train.eval_every=null", "train.progress=false",
                    "model.dropout=0.0", f"output_dir={out}"]
            run([sys.executable, "-m", "toolkit", "launch", "--nproc", str(args.nproc), args.recipe,
                 *[a for s in sets for a in ("--set", s)]])
            toolkit = [json.loads(l)["step_time_s"] for l in (out / "metrics.jsonl").read_text().splitlines()]
            minimal_out = Path(tmp) / f"{name}-minimal.json"
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                 str(REPO / "benchmarks" / "minimal_loop.py"), "--recipe", args.recipe, "--strategy", name,
                 "--steps", str(args.steps), "--out", str(minimal_out)])
            minimal = json.loads(minimal_out.read_text())["step_time_s"]
            t, m = median_after_warmup(toolkit), median_after_warmup(minimal)
            rows.append((name, t * 1e3, m * 1e3, (t / m - 1) * 100))
    print(f"{'strategy':<10}{'toolkit ms':>12}{'minimal ms':>12}{'overhead %':>12}")
    for name, t, m, over in rows:
        print(f"{name:<10}{t:>12.1f}{m:>12.1f}{over:>12.1f}")


if __name__ == "__main__":
    main()
