"""What a checkpoint costs, per strategy: its size on disk and how long a save holds training up, with the
files written synchronously and with `checkpoint.async: true` (dcp.async_save in the background).

    python benchmarks/checkpoint_cost.py [--recipe recipes/llama-tiny.yaml] [--nproc 2]
                                         [--strategies ddp,fsdp,zero2,zero3] [--steps 12] [--every 4]

Each (strategy, sync/async) pair is one real `toolkit launch` run; the held time is what metrics.jsonl
records per save, both outside the step time: `checkpoint_s` (the save call) plus, for an async save, the
next step's `checkpoint_wait_s` (its update waiting for the background copy of the weights); median over the
saves. Target: an async save holds a step up by less than 10 % of a synchronous one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from toolkit.observe.metrics import read_jsonl  # noqa: E402
from toolkit_runs import launch  # noqa: E402

ARMS = {"ddp": ["strategy.name=ddp"], "fsdp": ["strategy.name=fsdp"],
        "zero2": ["strategy.name=zero", "strategy.stage=2"], "zero3": ["strategy.name=zero", "strategy.stage=3"]}


def run(recipe: str, *, nproc: int, strategy: str, async_save: bool, steps: int, every: int, out: Path) -> dict:
    sets = [*ARMS[strategy], f"train.max_steps={steps}", f"checkpoint.every_steps={every}",
            f"checkpoint.async={str(async_save).lower()}", "checkpoint.keep_last=1", "checkpoint.final=false",
            "train.eval_every=null", "train.progress=false", f"output_dir={out}"]
    launch(recipe, nproc=nproc, sets=sets, label=f"{strategy} {'async' if async_save else 'sync'}")
    records = read_jsonl(out / "metrics.jsonl")
    following = {m["step"] - 1: m.get("checkpoint_wait_s", 0.0) for m in records}
    held = [m["checkpoint_s"] + following.get(m["step"], 0.0) for m in records if "checkpoint_s" in m]
    checkpoint = sorted((out / "checkpoints").glob("step-*"))[-1]
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    step_s = statistics.median(m["step_time_s"] for m in records)
    return {"held_s": statistics.median(held), "saves": len(held), "size": size, "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/llama-tiny.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp,zero2,zero3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            sync = run(args.recipe, nproc=args.nproc, strategy=strategy, async_save=False, steps=args.steps,
                       every=args.every, out=Path(tmp) / f"{strategy}-sync")
            background = run(args.recipe, nproc=args.nproc, strategy=strategy, async_save=True, steps=args.steps,
                             every=args.every, out=Path(tmp) / f"{strategy}-async")
            rows.append((strategy, sync, background))
    head = f"{'strategy':<9} {'size MiB':>9} {'step ms':>8} {'sync held ms':>13} {'async held ms':>14} {'async/sync':>11}"
    print(head)
    print("-" * len(head))
    for strategy, sync, background in rows:
        ratio = background["held_s"] / sync["held_s"] if sync["held_s"] else float("nan")
        print(f"{strategy:<9} {sync['size'] / 2 ** 20:>9.1f} {sync['step_s'] * 1e3:>8.0f} "
              f"{sync['held_s'] * 1e3:>13.0f} {background['held_s'] * 1e3:>14.0f} {ratio:>10.0%}")
    print(f"\n{args.recipe} at {args.nproc} ranks, {args.steps} steps, a save every {args.every} (median over "
          "the saves); target: async/sync < 10 %")


if __name__ == "__main__":
    main()
