"""Mixture-of-experts layouts side by side: the experts' and the dense weights' state bytes per rank, the token
all-to-all bytes, the load-balance spread and tokens/s, for ddp (whole replicas), fsdp (everything sharded),
expert parallel at 2 ranks (`parallel.ep=2`: half the experts per rank) and at 4 (ep 2 × 2 ranks sharding each half),
and transformers' own expert parallel (`hf_native`, ep 2).

    python benchmarks/expert_parallel.py [--arms ddp,fsdp,ep2,...] [--steps 20]

Each arm is one real `toolkit launch` run of recipes/moe-tiny.yaml (a Qwen3-MoE-style model from a config: 8
experts per layer, top-2, 4 layers), global batch 32, eval off, whose run.json gives each rank's model-state bytes
as measured (distinct storages of parameters, gradients and AdamW state after the first step) and as `toolkit plan`
predicted them, the collective counter's bytes per op (rank 0, step 3), and the routing. The experts' share of a
rank's states is the plan's (toolkit/strategies/dims/expert.py's shard rule): the table says whether the plan's
total equals the measured one. tokens/s: the median of the steps after the first 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from toolkit_runs import REPO, launch, print_table

MiB = 2 ** 20
RECIPE = "recipes/moe-tiny.yaml"
ARMS = {  # name -> (ranks, overrides)
    "ddp": (2, ["strategy.name=ddp"]),
    "fsdp": (2, ["strategy.name=fsdp"]),
    "ep2": (2, ["parallel.ep=2"]),
    "ep2-4ranks": (4, ["parallel.ep=2", "batch.micro_batch_size=8"]),
    "hf-native-ep2": (2, ["strategy.name=hf_native", "strategy.ep_degree=2"]),
}


def expert_bytes(overrides: list[str], *, nproc: int) -> int:
    """The plan's bytes of expert parameters, gradients and AdamW state on rank 0 (the model on the meta device)."""
    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import resolve
    from toolkit.memory.state_bytes import adam_state
    from toolkit.model.build import meta_model
    from toolkit.observe.routing import STACKED, plan_of
    from toolkit.strategies import strategy_degrees
    from toolkit.strategies.dims.expert import local_numel

    recipe = resolve(load_recipe(REPO / RECIPE, overrides), world_size=nproc)
    model = meta_model(recipe.model)
    experts = {name for name, style in plan_of(model).items() if style == STACKED}
    named = [(n, p) for n, p in model.named_parameters() if n in experts]
    degrees = strategy_degrees(recipe, world_size=nproc)
    if degrees.ep > 1:
        local = local_numel(model, ep=degrees.ep, world_size=nproc, rank=0)
    elif recipe.strategy.name == "fsdp":  # FSDP's dim-0 shard over the world
        local = local_numel(model, ep=1, world_size=nproc, rank=0)
    else:  # a whole replica
        local = local_numel(model, ep=1, world_size=1, rank=0)
    states = adam_state(named, dtype=next(model.parameters()).dtype, local=local)
    return states.params_bytes + states.grads_bytes + states.optim_bytes


def run(arm: str, *, steps: int, out: Path) -> list[str]:
    nproc, overrides = ARMS[arm]
    sets = [*overrides, f"train.max_steps={steps}", "train.eval_every=null", "train.progress=false",
            "checkpoint.final=false", f"output_dir={out}"]
    try:
        launch(RECIPE, nproc=nproc, sets=sets, label=arm)
    except SystemExit as failed:
        print(str(failed).splitlines()[0])
        return [arm, "failed"] + [""] * 6
    info = json.loads((out / "run.json").read_text())
    steps_done = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [sum(r.values()) for r in info["model_state_bytes"]]
    predicted = info["memory_prediction"].get("model_state_bytes")
    exact = "n/a (not predicted)" if predicted is None else (
        "yes" if [sum(r.values()) for r in predicted] == measured else "no")
    comm = info["comm_per_step"]["bytes_by_op"]
    experts = expert_bytes(overrides, nproc=nproc) if predicted is not None else None
    tokens = statistics.median(m["tokens_per_s"] for m in steps_done[3:] or steps_done)
    return [arm, str(nproc), f"{max(measured) / MiB:,.2f}", exact,
            "" if experts is None else f"{experts / MiB:,.2f}",
            f"{comm.get('all_to_all_single', 0) / MiB:,.2f}", f"{info['experts']['spread_mean']:.2f}",
            f"{tokens:,.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(arm, steps=args.steps, out=Path(tmp) / arm) for arm in args.arms.split(",")]
    print(f"{RECIPE}: 8 experts per layer, top-2, 4 layers; {args.steps} steps of global batch 32, fp32, CPU")
    print_table(["arm", "ranks", "model states MiB/rank", "plan exact", "of which experts MiB/rank (plan)",
                 "all-to-all MiB/step (rank 0)", "load spread", "tokens/s"], rows)


if __name__ == "__main__":
    main()
