"""An experiment: one base recipe, several arms (strategy × precision × accumulation), one global batch.

Every arm runs the same seed, data order and global batch size; grad_accum_steps is derived per arm
from the global batch (so `single` on 1 rank and `ddp` on 2 ranks see the same samples per step).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

from toolkit.errors import RecipeError
from toolkit.recipe import load_recipe, plan_batch
from toolkit.strategies import arm_aliases, make_strategy, strategy_info, validate_strategy

RECORD_GRADIENT_SCALE = "train.record_gradient_scale"  # the reference arm's gradient scale (see verdict.py)


@dataclass(frozen=True)
class Arm:
    name: str
    nproc: int
    overrides: tuple[str, ...]


@dataclass
class Experiment:
    recipe: str
    out_dir: Path
    arms: list[Arm]
    common: list[str] = field(default_factory=list)  # overrides applied to every arm

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {"recipe": self.recipe, "common": self.common, "arms": [asdict(a) for a in self.arms]}
        (self.out_dir / "experiment.json").write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, out_dir: Path) -> "Experiment":
        path = Path(out_dir) / "experiment.json"
        if not path.is_file():
            raise RecipeError(f"{out_dir} is not a compare experiment (no experiment.json); "
                              "pass the directory `toolkit compare` wrote")
        data = json.loads(path.read_text())
        arms = [Arm(a["name"], a["nproc"], tuple(a["overrides"])) for a in data["arms"]]
        return cls(recipe=data["recipe"], out_dir=Path(out_dir), arms=arms, common=data["common"])


def arm_overrides(spec: str) -> tuple[str, ...]:
    """`zero3` or `zero3@optim.lr=2e-4@seed=1`: a named arm plus per-arm recipe overrides."""
    strategy, *extra = spec.split("@")
    aliases = arm_aliases()
    if strategy not in aliases:
        raise RecipeError(f"unknown arm {strategy!r}; choose from {', '.join(aliases)} "
                          "(add per-arm overrides as name@key=value)")
    return (*aliases[strategy], *extra)


def build_experiment(recipe_path: str, *, strategies: list[str], precisions: list[str | None],
                     accums: list[int | None], nproc: int, steps: int | None, overrides: list[str]) -> Experiment:
    base = load_recipe(recipe_path, overrides)
    global_batch = plan_batch(base.batch, world_size=nproc).global_batch_size
    common = list(overrides)
    if steps is not None:
        common.append(f"train.max_steps={steps}")
    if base.model.dropout is None:
        common.append("model.dropout=0.0")  # masks depend on the batch split: exact comparison needs it off
    out = next((o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")), None)
    out_dir = Path(out) if out else Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-compare"
    arms = []
    for strategy in strategies:
        arm_recipe = load_recipe(recipe_path, [*overrides, *arm_overrides(strategy)])
        arm_nproc = 1 if strategy_info(arm_recipe.strategy.name).one_process else nproc
        # the global batch splits over the data-parallel shards (a pipeline's stages read the same samples)
        shards = make_strategy(arm_recipe).data_layout(arm_recipe, world_size=arm_nproc, rank=0).size
        for precision in precisions:
            for accum in accums:
                extra = [f"batch.global_batch_size={global_batch}"]
                if accum is None:
                    extra.append("batch.grad_accum_steps=null")
                else:
                    micro = global_batch // (shards * accum)
                    extra += [f"batch.grad_accum_steps={accum}", f"batch.micro_batch_size={micro}"]
                name = strategy.replace("/", "_")
                if precision:
                    extra.append(f"precision={precision}")
                    name += f"-{precision}" if len(precisions) > 1 else ""
                if accum is not None and len(accums) > 1:
                    name += f"-accum{accum}"
                arms.append(Arm(name, arm_nproc, (*arm_overrides(strategy), *extra)))
    common = [o for o in common if not o.startswith("output_dir=")]
    if arms:  # the reference arm records its gradient scale: the verdict tells noise-driven weights from it
        arms[0] = Arm(arms[0].name, arms[0].nproc, (*arms[0].overrides, f"{RECORD_GRADIENT_SCALE}=true"))
    experiment = Experiment(recipe=str(recipe_path), out_dir=out_dir, arms=arms, common=common)
    for arm in arms:  # every arm's strategy and batch arithmetic are checked before anything runs
        validate_strategy(load_recipe(recipe_path, [*common, *arm.overrides]), world_size=arm.nproc)
    return experiment


def load_matrix(path: str, *, nproc: int | None, steps: int | None, overrides: list[str]) -> Experiment:
    """A matrix file: {recipe, strategies, precisions?, grad_accum_steps?, nproc?, steps?, set?}."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    known = {"recipe", "strategies", "precisions", "grad_accum_steps", "nproc", "steps", "set"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RecipeError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if "recipe" not in data or "strategies" not in data:
        raise RecipeError(f"{path}: a matrix file needs `recipe` and `strategies`")
    return build_experiment(
        data["recipe"], strategies=list(data["strategies"]), precisions=list(data.get("precisions") or [None]),
        accums=list(data.get("grad_accum_steps") or [None]), nproc=nproc or int(data.get("nproc", 2)),
        steps=steps if steps is not None else data.get("steps"), overrides=[*data.get("set", []), *overrides])
