"""An experiment: one base recipe, several arms (strategy × precision × accumulation), one global batch.

Every arm runs the same seed, data order and global batch size; grad_accum_steps is derived per arm
from the global batch (so `single` on 1 rank and `ddp` on 2 ranks see the same samples per step).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from toolkit.atomic import write_text_whole
from toolkit.checkpoint.store import check_not_in_a_run
from toolkit.config.arm_specs import arm_parts, refuse_repeats
from toolkit.config.files import load_recipe, replaced_overrides
from toolkit.config.parallel import resolve
from toolkit.config.recipe import Recipe, plan_batch
from toolkit.config.yaml_files import read_yaml_mapping
from toolkit.errors import RecipeError
from toolkit.strategies import arm_aliases, data_layout, strategy_info, validate_strategy
from toolkit.train.checks import check_blocks, check_recipe

RECORD_GRADIENT_SCALE = "train.record_gradient_scale"  # the reference arm's gradient scale (see verdict.py)
# runs the verdict reads and the report does not show as arms: two bf16/fp16 reference runs per low precision, and
# the reference from a rounding-perturbed start (verdict.py)
CALIBRATION_PREFIX = "calibration-"
ROUNDING_ARM = f"{CALIBRATION_PREFIX}rounding"


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
        write_text_whole(self.out_dir / "experiment.json", json.dumps(data, indent=2))

    @classmethod
    def load(cls, out_dir: Path) -> "Experiment":
        path = Path(out_dir) / "experiment.json"
        if not path.is_file():
            raise RecipeError(f"{out_dir} is not a compare experiment (no experiment.json); "
                              "pass the directory `toolkit compare` wrote")
        try:  # a JSON or layout error (a ValueError, KeyError or TypeError) is a damaged file, not our bug
            data = json.loads(path.read_text(encoding="utf-8"))
            arms = [Arm(a["name"], a["nproc"], tuple(a["overrides"])) for a in data["arms"]]
            if not arms:  # written by hand: the report has no reference arm (an IndexError)
                raise ValueError("no arm")
            return cls(recipe=data["recipe"], out_dir=Path(out_dir), arms=arms, common=list(data["common"]))
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"no {exc} key" if isinstance(exc, KeyError) else "not the layout it writes" \
                if isinstance(exc, TypeError) else str(exc).splitlines()[0]
            raise RecipeError(f"{path} is not a readable compare experiment ({problem}); run `toolkit compare` "
                              f"again with a new --output, or pass a folder it wrote") from None


def arm_overrides(spec: str, *, common: list[str] | tuple[str, ...] = ()) -> tuple[str, ...]:
    """`zero3` or `zero3@optim.lr=2e-4@seed=1`: a named arm plus per-arm recipe overrides. An override for all arms
    (`common`: --set, a matrix file's set:) that the arm's own definition would replace by another value is refused:
    `--strategies pp-tp2 --set strategy.tp_degree=8` would run tp 2 without a word. Per-arm overrides win over both."""
    strategy, *extra = arm_parts(spec)
    aliases = arm_aliases()
    if strategy not in aliases:
        raise RecipeError(f"unknown arm {strategy!r}; choose from {', '.join(aliases)} "
                          "(add per-arm overrides as name@key=value)")
    clash = replaced_overrides(common, aliases[strategy], then=extra)
    if clash:
        given, theirs = clash[0]
        raise RecipeError(f"arm {strategy!r} sets {theirs} itself, which would replace {given} (set for all arms by "
                          f"--set, or a matrix file's set:); give it to the arm ({strategy}@{given}), or choose an "
                          "arm that runs it")
    return (*aliases[strategy], *extra)


def check_output_dir(out_dir: Path) -> None:
    """The experiment folder is a folder, or can be made: no file stands at its path or above it."""
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())  # `.` or `/` at the latest
    if not existing.is_dir():
        what = f"{out_dir} is a file" if existing == out_dir else f"{existing}, above {out_dir}, is a file"
        raise RecipeError(f"experiment folder: {what}, not a folder; pass another --output")
    check_not_in_a_run(out_dir, what="experiment folder", fix="pass another --output")
    # each arm runs afresh in out_dir/<arm>, replacing what is there: only a folder compare made is written into
    if existing == out_dir and any(out_dir.iterdir()) and not (out_dir / "experiment.json").is_file():
        raise RecipeError(f"experiment folder: {out_dir} holds files but no experiment.json (it is no compare "
                          "experiment, whose arm folders a run replaces); pass a new or empty --output")


def _key(override: str) -> str:
    return override.partition("=")[0].strip()


def refuse_replaced(strategies: list[str], *, overrides: list[str], precisions: list[str | None],
                    accums: list[int | None]) -> None:
    """What compare sets for every arm itself (build_experiment's batch, precision and the reference's gradient
    scale, run_arm's folders) would replace an arm's own value without a word: refused, naming why and what to do
    instead."""
    replaced = {
        "batch.global_batch_size": "every arm runs the same global batch, so that its loss compares with the "
                                   "reference's step for step; set it for all arms with "
                                   "--set batch.global_batch_size=N",
        "batch.grad_accum_steps": "each arm's accumulation follows from the global batch, its ranks and micro batch; "
                                  "vary it with a matrix file's grad_accum_steps: [1, 4], or per arm with "
                                  "NAME@batch.micro_batch_size=N",
        "output_dir": "each arm writes in EXPERIMENT/NAME; --output names the experiment folder",
        "train.tracking_dir": "trackers write into the experiment folder, one run per arm; drop it",
        RECORD_GRADIENT_SCALE: "on for the reference (first) arm only: the verdict reads its gradient scale to set "
                               "aside weights only rounding noise moved, and the other arms skip that pass over "
                               "their gradients; drop it",
    }
    if accums != [None]:
        replaced["batch.micro_batch_size"] = ("the matrix's grad_accum_steps sets each arm's micro batch (global "
                                              "batch ÷ data-parallel ranks ÷ accumulation); drop grad_accum_steps: "
                                              "to set it")
    if precisions != [None]:
        replaced["precision"] = "the matrix's precisions: sets each arm's precision; drop one of the two"
    for spec in strategies:
        key = next((_key(o) for o in arm_parts(spec)[1:] if _key(o) in replaced), None)
        if key is not None:
            raise RecipeError(f"arm {spec!r}: compare sets {key} for every arm itself ({replaced[key]})")
    # for all arms, the batch and output_dir are the experiment's own (the global batch, its folder); the
    # gradient scale would be recorded by every arm, or not by the reference
    for_all = replaced.keys() & {"precision", "train.tracking_dir", RECORD_GRADIENT_SCALE}
    key = next((_key(o) for o in overrides if _key(o) in for_all), None)
    if key is not None:
        raise RecipeError(f"{key} is set for all arms (--set, or a matrix file's set:), but compare sets it for "
                          f"every arm itself ({replaced[key]})")


DROPOUT_OFF = "model.dropout=0.0"


def dropout_note(common: list[str]) -> str | None:
    """The line compare says at its start and the report at its top where every arm runs without dropout."""
    if DROPOUT_OFF not in common:
        return None
    return ("dropout is off in every arm (model.dropout=0.0): a dropout mask depends on how the batch is split over "
            "ranks, so arms with it could not match the reference; compare sets it where the recipe leaves the "
            "model's own, and `--set model.dropout=P` keeps dropout (noisier losses to compare)")


def build_experiment(recipe_path: str, *, strategies: list[str], precisions: list[str | None],
                     accums: list[int | None], nproc: int, steps: int | None, overrides: list[str]) -> Experiment:
    refuse_replaced(strategies, overrides=overrides, precisions=precisions, accums=accums)
    base = load_recipe(recipe_path, overrides)
    global_batch = experiment_global_batch(base, nproc=nproc)
    common = list(overrides)
    if steps is not None:
        common.append(f"train.max_steps={steps}")
    if base.model.dropout is None:
        common.append(DROPOUT_OFF)  # masks depend on the batch split: exact comparison needs it off (said: dropout_note)
    # the last output_dir given: --output comes after the matrix file's `set:` and --set (the command line wins)
    out = next((o.partition("=")[2] for o in reversed(overrides) if _key(o) == "output_dir"), None)
    out_dir = Path(out) if out else Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-compare"
    check_output_dir(out_dir)
    arms = [arm for spec in strategies for arm in _spec_arms(recipe_path, spec, overrides=overrides, nproc=nproc,
                                                             precisions=precisions, accums=accums,
                                                             global_batch=global_batch)]
    refuse_repeats([arm.name for arm in arms], where="strategies")
    common = [o for o in common if _key(o) != "output_dir"]
    if arms:  # the reference arm records its gradient scale: the verdict tells noise-driven weights from it
        arms[0] = Arm(arms[0].name, arms[0].nproc, (*arms[0].overrides, f"{RECORD_GRADIENT_SCALE}=true"))
    # absolute: experiment.json and each arm's launch read it from wherever compare or report is run next
    experiment = Experiment(recipe=os.path.abspath(recipe_path), out_dir=out_dir, arms=arms, common=common)
    # every arm's recipe, strategy and batch arithmetic are checked before anything runs; the data, tokenizer and
    # model the arms share, once (a mistake there failed every arm, one after the other)
    for index, arm in enumerate(arms):
        check_arm(recipe_path, common=common, arm=arm, whole=index == 0)
    return experiment


def experiment_global_batch(base: Recipe, *, nproc: int) -> int:
    """The one global batch every arm runs: the recipe's global_batch_size as given; without one, micro × accum
    on --nproc data-parallel ranks (what ddp runs there). Whether it splits over an arm's ranks is each arm's own
    check (check_arm): its data-parallel size is its strategy's, not --nproc (a pipeline's stages and tp's ranks
    read the same samples; pp-ddp at 4 ranks has 2 data-parallel ranks)."""
    if base.batch.global_batch_size is not None:
        return base.batch.global_batch_size
    return plan_batch(base.batch, world_size=nproc).global_batch_size


def _accumulation(global_batch: int, *, shards: int, accum: int | None, arm: str) -> list[str]:
    """An arm's accumulation overrides: derived from the global batch (None), or a matrix's grad_accum_steps with
    the micro batch that follows: the global batch ÷ the arm's data-parallel ranks ÷ the accumulation."""
    if accum is None:
        return ["batch.grad_accum_steps=null"]
    if global_batch % (shards * accum):
        raise RecipeError(f"arm {arm}: global batch {global_batch} does not split into {shards} data-parallel "
                          f"rank(s) × accum {accum}; make batch.global_batch_size a multiple of {shards * accum}, "
                          "or change the matrix's grad_accum_steps")
    return [f"batch.grad_accum_steps={accum}", f"batch.micro_batch_size={global_batch // (shards * accum)}"]


def _spec_arms(recipe_path: str, spec: str, *, overrides: list[str], nproc: int, precisions: list[str | None],
               accums: list[int | None], global_batch: int) -> list[Arm]:
    """The arms of one --strategies entry (`zero3`, `zero3@optim.lr=2e-4`): one per precision × accumulation, each
    splitting the global batch over its strategy's data-parallel ranks. A refusal of the entry's recipe or strategy
    names the arms it would have made."""
    named = [(precision, accum, spec.replace("/", "_") + (f"-{precision}" if precision and len(precisions) > 1 else "")
              + (f"-accum{accum}" if accum is not None and len(accums) > 1 else ""))
             for precision in precisions for accum in accums]
    names = [name for *_, name in named]
    strategy = arm_overrides(spec, common=overrides)  # an unknown arm's refusal names it
    with naming_arms(names):
        arm_recipe = load_recipe(recipe_path, [*overrides, *strategy])
        arm_nproc = 1 if strategy_info(arm_recipe.strategy.name).one_process else nproc
    with naming_arms(names, nproc=arm_nproc):
        # the global batch splits over the data-parallel shards (a pipeline's stages read the same samples)
        shards = data_layout(resolve(arm_recipe, world_size=arm_nproc), world_size=arm_nproc, rank=0).size
    return [Arm(name, arm_nproc, (*strategy, f"batch.global_batch_size={global_batch}",
                                  *_accumulation(global_batch, shards=shards, accum=accum, arm=name),
                                  *([f"precision={precision}"] if precision else [])))
            for precision, accum, name in named]


def check_arm(recipe_path: str, *, common: list[str], arm: Arm, whole: bool = False) -> None:
    """The arm's recipe and validate_strategy at its ranks, as `toolkit launch` reads and runs them (`whole`: every
    check launch makes, data files and model included); a refusal names the arm, its ranks and how many of them
    split the global batch (its strategy's data-parallel size)."""
    with naming_arms([arm.name], nproc=arm.nproc):
        recipe = load_recipe(recipe_path, [*common, *arm.overrides])
    with naming_arms([arm.name], nproc=arm.nproc, recipe=recipe):
        if whole:
            check_recipe(recipe, world_size=arm.nproc)
        else:
            validate_strategy(recipe, world_size=arm.nproc)
            check_blocks(recipe)


@contextlib.contextmanager
def naming_arms(names: list[str], *, nproc: int | None = None, recipe: Recipe | None = None) -> Iterator[None]:
    """A RecipeError raised inside, as one line that starts with the arm(s) it refuses (with 6 arms of a matrix, a
    bare `schedule 1f1b needs ...` leaves the user to guess which), then their ranks where known, and of them how
    many split the global batch where the recipe is read."""
    try:
        yield
    except RecipeError as exc:
        ranks = f" ({nproc} rank(s){_data_parallel(recipe, nproc=nproc)})" if nproc is not None else ""
        raise RecipeError(f"arm{'s' if len(names) > 1 else ''} {', '.join(names)}{ranks}: {exc}") from None


def _data_parallel(recipe: Recipe | None, *, nproc: int) -> str:
    if recipe is None:
        return ""
    try:
        shards = data_layout(resolve(recipe, world_size=nproc), world_size=nproc, rank=0).size
        return f", {shards} of them data-parallel"
    except RecipeError:  # the layout is what was refused
        return ""


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


# each matrix-file key: whether a value has its form, and that form in words (null: an optional key left out)
MATRIX_KEYS = {
    "recipe": (lambda v: isinstance(v, str), "a recipe file's path, e.g. recipe: recipes/llama-tiny.yaml"),
    "strategies": (lambda v: _strings(v) and len(v) > 0, "a list of arms, e.g. strategies: [ddp, fsdp]"),
    "precisions": (_strings, "a list, e.g. precisions: [fp32, bf16]"),
    "grad_accum_steps": (lambda v: isinstance(v, list) and all(map(_whole, v)),
                         "a list of whole numbers >= 1, e.g. grad_accum_steps: [1, 2]"),
    "nproc": (_whole, "a whole number >= 1, e.g. nproc: 2"),
    "steps": (_whole, "a whole number >= 1, e.g. steps: 20"),
    "set": (lambda v: _strings(v) and all("=" in o for o in v),
            "a list of KEY=VALUE overrides, e.g. set: [train.max_steps=20]"),
}


def read_matrix(path: str) -> dict:
    """A matrix file's keys, each checked for its form: {recipe, strategies, precisions?, grad_accum_steps?,
    nproc?, steps?, set?}; a slip (`strategies: ddp,fsdp`, a string) is one line naming the key and its form."""
    data = read_yaml_mapping(Path(path), what="matrix file", holds="keys (recipe, strategies, ...)")
    unknown = sorted(set(data) - set(MATRIX_KEYS))
    if unknown:
        raise RecipeError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(MATRIX_KEYS))}")
    if data.get("recipe") is None or data.get("strategies") is None:
        raise RecipeError(f"{path}: a matrix file needs `recipe` and `strategies`")
    for key, value in data.items():
        has_form, form = MATRIX_KEYS[key]
        if value is not None and not has_form(value):
            raise RecipeError(f"{path}: {key} must be {form}; got {value!r}")
    return data


def matrix_recipe(matrix: Path, recipe: str, *, note: Callable[[str], None]) -> str:
    """A matrix file's `recipe:` as an absolute path. A relative one is read from the matrix file's folder, as a
    config file's paths are, so `toolkit compare path/to/matrix.yaml` reads the same recipe from any folder. One
    found only from the current folder (where compare read it before) is still taken, with a note saying how to
    write it; one found in both is the matrix folder's, with a note naming the other."""
    given = Path(recipe).expanduser()
    if given.is_absolute():
        return str(given)
    beside, here = os.path.abspath(matrix.parent / given), os.path.abspath(given)
    if os.path.isfile(beside):
        if os.path.isfile(here) and not os.path.samefile(beside, here):
            note(f"[compare] note: {matrix}: recipe: {recipe} is read from the matrix file's folder ({beside}), "
                 f"not from the current folder ({here})")
        return beside
    if os.path.isfile(here):
        note(f"[compare] note: {matrix}: recipe: {recipe} is not in the matrix file's folder; read {here} from the "
             f"current folder (relative paths are read from the matrix file's folder: write recipe: "
             f"{os.path.relpath(here, matrix.parent)})")
        return here
    raise RecipeError(f"{matrix}: recipe: {recipe} not found at {beside} (a relative recipe: is read from the "
                      "matrix file's folder); give its path from there, or an absolute one")


def load_matrix(path: str, *, nproc: int | None, steps: int | None, overrides: list[str],
                note: Callable[[str], None]) -> Experiment:
    """The experiment of a matrix file (see read_matrix); nproc, steps and overrides from the command line win;
    `note` is told where a relative recipe: was found other than the matrix file's folder (see matrix_recipe)."""
    data = read_matrix(path)
    return build_experiment(
        matrix_recipe(Path(path), data["recipe"], note=note), strategies=data["strategies"], precisions=data.get("precisions") or [None],
        accums=data.get("grad_accum_steps") or [None], nproc=nproc if nproc is not None else data.get("nproc") or 2,
        steps=steps if steps is not None else data.get("steps"), overrides=[*(data.get("set") or []), *overrides])
