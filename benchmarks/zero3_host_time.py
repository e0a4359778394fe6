"""ZeRO-3's host time per tensor it gathers or reduce-scatters on this CPU: what
toolkit/strategies/zero/collectives.py HOST_S_PER_TENSOR stands for, measured.

    python benchmarks/zero3_host_time.py [--cases minilm,minilm-micro8,llama,moe] [--steps 20] [--nproc 2]
                                         [--stage 3]

Per case, two runs of `toolkit train` as ranks of torch.distributed.run: ZeRO-3 at `--nproc` ranks, and one
process at one thread on one rank's batch (the compute alone, the threads a rank has). A step's host time is
ZeRO-3's forward-backward less that compute and less the time inside its collectives, plus its optimizer step
less AdamW's own; over the tensors the rules' gathers and reduce-scatters carry (a parameter's partition each
micro-batch, or once a step where it stays whole; a gradient each micro-batch), it is the seconds a tensor.

Why an in-process hook, not `toolkit launch` alone: the collectives' own time is inside the step, and only timing
around each call (benchmarks/host_time_worker.py) separates it from the Python around it. The ranks start as
`toolkit launch` starts them (torch.distributed.run, the toolkit's environment, the recipe's checks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.toolkit_runs import print_table  # noqa: E402

CASES = {
    "minilm": ("recipes/minilm-sst.yaml", []),
    "minilm-micro8": ("recipes/minilm-sst.yaml", ["batch.micro_batch_size=8"]),
    "llama": ("recipes/llama-tiny.yaml", []),
    "moe": ("recipes/moe-tiny.yaml", []),
}


def zero(stage: int) -> list[str]:
    return ["strategy.name=zero", f"strategy.stage={stage}"]


def run(recipe: str, sets: list[str], *, nproc: int, steps: int, threads: int | None, label: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="host-time-") as tmp:
        out = Path(tmp) / "times.json"
        common = [f"train.max_steps={steps}", "train.eval_every=100000", "model.dropout=0.0",
                  f"output_dir={tmp}/run"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "benchmarks" / "host_time_worker.py"), "train", recipe,
               *[a for s in [*common, *sets] for a in ("--set", s)]]
        env = {**os.environ, "HOST_TIME_OUT": str(out), "HOST_TIME_SKIP": str(min(3, steps - 1))}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        print(f"[benchmark] {label} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode or not out.is_file():
            raise SystemExit(f"{label} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def predicted_tensors(recipe_path: str, sets: list[str], *, nproc: int, stage: int) -> tuple[int, int]:
    """(tensors a step's hooks visit, per-rank samples a step): at stage 3 those the plan's rules charge (the
    gathers' and reduce-scatters' tensors); at stage 2 each trainable gradient each micro-batch (its hook copies
    it into the reduce bucket)."""
    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import resolve
    from toolkit.config.recipe import plan_batch
    from toolkit.plan.predict import planned_model
    from toolkit.strategies.zero import collectives

    recipe = resolve(load_recipe(recipe_path, [*zero(stage), *sets]), world_size=nproc)
    plan = plan_batch(recipe.batch, world_size=nproc)
    model = planned_model(recipe)
    samples = plan.micro_batch_size * plan.grad_accum_steps
    if stage != 3:
        return plan.grad_accum_steps * sum(1 for p in model.parameters() if p.requires_grad), samples
    rules = collectives.predict(model, recipe, world_size=nproc, num_micro_batches=plan.grad_accum_steps)
    return round(sum(c.host_s for c in rules) / collectives.HOST_S_PER_TENSOR), samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, choices=(2, 3))
    args = parser.parse_args()
    from toolkit.launch.launcher import prepare_environment
    from toolkit.strategies.zero.collectives import HOST_S_PER_TENSOR

    prepare_environment()
    rows = []
    for name in args.cases.split(","):
        recipe, sets = CASES[name]
        tensors, samples = predicted_tensors(recipe, sets, nproc=args.nproc, stage=args.stage)
        # one rank: one thread, as the process it is set against (torch.distributed.run leaves a lone rank every core)
        ran = run(recipe, [*zero(args.stage), *sets], nproc=args.nproc, steps=args.steps,
                  threads=1 if args.nproc == 1 else None, label=f"{name}: zero{args.stage} at {args.nproc} ranks")
        alone = run(recipe, [*sets, f"batch.global_batch_size={samples}"], nproc=1, steps=args.steps, threads=1,
                    label=f"{name}: one process at 1 thread, {samples} samples")
        host = (ran["forward-backward"] - alone["forward-backward"] - ran.get("collectives", 0.0)) + \
            (ran["optimizer step"] - ran.get("adamw", 0.0))
        rows.append([name, f"{ran['step'] * 1e3:.0f}", f"{alone['forward-backward'] * 1e3:.0f}",
                     f"{ran.get('collectives', 0.0) * 1e3:.0f}", f"{host * 1e3:.0f}", str(tensors),
                     f"{host / tensors * 1e3:.2f}"])
    print_table(["case", f"zero{args.stage} step ms", "compute ms", "in collectives ms", "host ms", "tensors",
                 "host ms/tensor"], rows)
    print(f"the plan charges {HOST_S_PER_TENSOR * 1e3:.2f} ms a tensor (HOST_S_PER_TENSOR)")


if __name__ == "__main__":
    main()
