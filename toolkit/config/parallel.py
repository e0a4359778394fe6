"""A run's parallel degrees, and the named strategy (preset) that runs each tested combination of them.

The degrees compose on one device mesh, in torchtitan's order (`ParallelDims`, outermost first):

    pp  ×  dp_replicate  ×  dp_shard  ×  cp  ×  tp        world = the product; ep borrows dp_shard × cp

so that tensor parallel takes neighbouring ranks (one node's fast links), the sharding of dp_shard the next ones,
and the pipeline's point-to-point sends the slowest links. An unset dp_shard takes the ranks the others leave
(torchtitan's -1); expert parallel's ranks come out of dp_shard × cp, as transformers' DistributedConfig defines
`ep_size` (a multiple of tp dividing fsdp × tp). ep is tested with dp_shard alone (fsdp's ep_degree).

A recipe gives either `parallel:` degrees or a `strategy.name` with its options (the presets, and the names compare
arms keep); `resolve` turns degrees into the preset that runs them, so every later part of a run reads one form.
A combination no test has run is refused in one line, never run untested."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import StrategyConfig
from toolkit.errors import RecipeError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first: how the ranks are laid out


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """How many ranks each dimension spans (1: not parallel along it)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # borrowed from dp_shard × cp: not a factor of the world

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def active(self) -> tuple[str, ...]:
        """The dimensions of more than one rank, in mesh order."""
        return tuple(name for name in MESH_ORDER if getattr(self, name) > 1)

    def describe(self) -> str:
        """`dp_replicate 2 × dp_shard 2`, `dp_shard 4 (ep 2 of them)`, or `all degrees 1` where nothing is parallel."""
        line = " × ".join(f"{name} {getattr(self, name)}" for name in self.active()) or "all degrees 1"
        return f"{line} (ep {self.ep} of them)" if self.ep > 1 else line

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# the tested combinations of degrees (the dimensions above 1) -> the preset that runs them and its options
PRESETS: dict[frozenset[str], tuple[str, Any]] = {
    frozenset(): ("single", lambda d: {}),
    frozenset({"dp_replicate"}): ("ddp", lambda d: {}),
    frozenset({"dp_shard"}): ("fsdp", lambda d: {}),
    frozenset({"dp_replicate", "dp_shard"}): ("fsdp", lambda d: {"replicate_degree": d.dp_replicate}),
    frozenset({"tp"}): ("tp", lambda d: {}),
    frozenset({"dp_shard", "tp"}): ("fsdp", lambda d: {"tp_degree": d.tp}),
    # HSDP × tp: FSDP over each replica group's dp_shard ranks, every weight split over tp first
    frozenset({"dp_replicate", "tp"}): ("fsdp", lambda d: {"replicate_degree": d.dp_replicate, "tp_degree": d.tp}),
    frozenset({"dp_replicate", "dp_shard", "tp"}): ("fsdp", lambda d: {"replicate_degree": d.dp_replicate,
                                                                         "tp_degree": d.tp}),
    frozenset({"cp"}): ("fsdp", lambda d: {"cp_degree": d.cp}),  # FSDP over the cp ranks, as over dp_shard × cp
    frozenset({"dp_shard", "cp"}): ("fsdp", lambda d: {"cp_degree": d.cp}),
    frozenset({"cp", "tp"}): ("fsdp", lambda d: {"cp_degree": d.cp, "tp_degree": d.tp}),
    # HSDP × cp: FSDP over dp_shard × cp within a replica group, gradients all-reduced across the groups
    frozenset({"dp_replicate", "cp"}): ("fsdp", lambda d: {"replicate_degree": d.dp_replicate, "cp_degree": d.cp}),
    frozenset({"dp_replicate", "dp_shard", "cp"}): ("fsdp", lambda d: {"replicate_degree": d.dp_replicate,
                                                                         "cp_degree": d.cp}),
    frozenset({"pp"}): ("pipeline", lambda d: {}),
    # each stage tensor-parallel: its blocks' attention heads and MLP columns split over the stage's tp ranks
    frozenset({"pp", "tp"}): ("pipeline", lambda d: {"tp_degree": d.tp}),
    frozenset({"pp", "dp_replicate"}): ("hybrid", lambda d: {"pipeline_degree": d.pp, "data_parallel": "ddp"}),
    frozenset({"pp", "dp_shard"}): ("hybrid", lambda d: {"pipeline_degree": d.pp, "data_parallel": "fsdp"}),
    # tensor-parallel stages, sharded by FSDP2 over the dp ranks of the same (stage, tp rank)
    frozenset({"pp", "dp_shard", "tp"}): ("hybrid", lambda d: {"pipeline_degree": d.pp, "data_parallel": "fsdp",
                                                               "tp_degree": d.tp}),
}
# combinations that cannot run as asked, with what runs instead
REFUSED: dict[frozenset[str], str] = {
    frozenset({"pp", "dp_replicate", "tp"}): "DDP cannot hold the stages' tensor-parallel (DTensor) weights; give "
                                             "the replicas as parallel.dp_shard (FSDP shards them)",
}


def presets() -> list[tuple[tuple[str, ...], str, tuple[str, ...]]]:
    """Each tested combination (its dimensions in mesh order), the preset that runs it and the strategy options the
    degrees set: what `toolkit strategies` lists."""
    return [(tuple(name for name in MESH_ORDER if name in combination), preset,
             tuple(f"strategy.{key}" for key in options_of(Degrees(**dict.fromkeys(combination, 2)))))
            for combination, (preset, options_of) in PRESETS.items()]


def degrees_of(recipe: Recipe, *, world_size: int) -> Degrees:
    """The recipe's `parallel:` degrees at `world_size`, an unset dp_shard filling the rest of the world."""
    given = recipe.parallel
    fixed = {name: getattr(given, name) or 1 for name in ("dp_replicate", "cp", "tp", "pp")}
    others = fixed["dp_replicate"] * fixed["cp"] * fixed["tp"] * fixed["pp"]
    shard = given.dp_shard
    if shard is None:
        if world_size == 1 and others > 1:  # `toolkit train` without a launcher
            raise RecipeError(f"parallel: {_product(fixed, total=others)} needs {others} ranks, and this run has 1; "
                              f"launch it on {others} (toolkit launch --nproc {others}), or leave the degrees out")
        if world_size % others:
            raise RecipeError(f"parallel: {_product(fixed, total=others)} does not divide the {world_size} ranks; the "
                              f"rest would be dp_shard; give degrees whose product divides {world_size}")
        shard = world_size // others
    degrees = Degrees(dp_shard=shard, ep=given.ep or 1, **fixed)
    if degrees.world_size != world_size:
        product = _product({**fixed, "dp_shard": shard}, total=degrees.world_size)
        raise RecipeError(f"parallel: {product} ranks, but the run has {world_size}; make the product {world_size} "
                          "or leave parallel.dp_shard unset")
    return degrees


def preset_of_given(recipe: Recipe) -> str | None:
    """The preset the recipe's `parallel:` degrees name, whatever the world size (those above 1; an unset dp_shard
    taken as filling more ranks, where it would): for a plan's line when they do not fit the world it is given.
    None where no degree is given or their combination is not tested."""
    if not recipe.parallel.given:
        return None
    given = {name for name in MESH_ORDER if (getattr(recipe.parallel, name) or 1) > 1}
    for combination in (given, given | {"dp_shard"}):
        if frozenset(combination) in PRESETS:
            return PRESETS[frozenset(combination)][0]
    return None


def resolve(recipe: Recipe, *, world_size: int) -> Recipe:
    """The recipe with its `parallel:` degrees turned into the preset that runs them (strategy.name and its
    options); unchanged where no degree is given. A strategy.name or option the degrees contradict is refused."""
    if not recipe.parallel.given:
        return recipe
    degrees = degrees_of(recipe, world_size=world_size)
    active = frozenset(degrees.active())
    if active in REFUSED:
        raise RecipeError(f"parallel: {' × '.join(degrees.active())}: {REFUSED[active]}")
    if active not in PRESETS:
        tested = "; ".join(" × ".join(name for name in MESH_ORDER if name in combo) for combo in PRESETS
                           if len(combo) > 1)
        raise RecipeError(f"parallel: {' × '.join(degrees.active())} together is not tested yet (tested: "
                          f"{tested}); drop one of them")
    name, options_of = PRESETS[active]
    options = options_of(degrees)
    if degrees.ep > 1:  # borrowed from dp_shard: tested with FSDP over the whole world, nothing else
        others = " × ".join(f"{d} {getattr(degrees, d)}" for d in degrees.active() if d != "dp_shard")
        if others:
            raise RecipeError(f"parallel.ep is tested with dp_shard alone, not beside {others} yet; drop "
                              f"{'them' if ' × ' in others else 'it'} or parallel.ep")
        if degrees.dp_shard == 1:
            raise RecipeError(f"parallel.ep {degrees.ep} borrows its ranks from dp_shard, which is 1 in a world of "
                              f"{world_size} rank(s); run it on a multiple of {degrees.ep} ranks (toolkit launch "
                              f"--nproc {degrees.ep}) or drop parallel.ep")
        options = {**options, "ep_degree": degrees.ep}
    current = recipe.strategy
    if current.name not in (StrategyConfig.name, name):
        raise RecipeError(f"strategy.name {current.name} and parallel ({degrees.describe()}, which runs as {name}) "
                          "disagree; give one of them")
    defaults = StrategyConfig()
    for key, value in options.items():
        set_to = getattr(current, key)
        if set_to != getattr(defaults, key) and set_to != value:
            raise RecipeError(f"strategy.{key}={set_to} disagrees with parallel ({degrees.describe()}), which sets "
                              f"{value}; give one of them")
    return dataclasses.replace(recipe, strategy=dataclasses.replace(current, name=name, **options))


def _product(degrees: dict[str, int], *, total: int) -> str:
    """`cp 2 × tp 2 = 4` (in mesh order); one degree alone without its product (`cp 3`)."""
    factors = [f"{name} {degrees[name]}" for name in MESH_ORDER if degrees.get(name, 1) > 1]
    return " × ".join(factors) + f" = {total}" if len(factors) > 1 else (factors[0] if factors else str(total))
