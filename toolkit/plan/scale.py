"""`toolkit plan RECIPE --hardware NAME --nodes N`: which layout for this model on that cluster, and how fast.

Each layout is a compare arm (toolkit strategies) at the cluster's world size: its collectives
(StrategyRules.predict_collectives, the rules the counter holds them to on CPU), memory per GPU (toolkit/plan/
predict.py on a GPU: no host memory in it) and step time (toolkit/cost/step_time.py) for the rank that works most.
`auto` enumerates the sensible ones: ddp, fsdp, HSDP with a replica per node, zero 1-3, fsdp × tp inside a node (at
each degree that divides its GPUs and the model takes), a pipeline across nodes (its stages tensor-parallel inside
a node too), context parallel for long sequences.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, cast

from torch import nn

from toolkit.config.parallel import resolve
from toolkit.config.recipe import Recipe, plan_batch
from toolkit.cost import hardware as profiles
from toolkit.cost import step_time
from toolkit.cost.collectives import loop_collectives
from toolkit.errors import RecipeError
from toolkit.model import tp_plan
from toolkit.plan.predict import GiB, predict, runtime_module_bytes, trace_dtypes
from toolkit.strategies import (data_layout, strategy_degrees, strategy_info, strategy_rules, validate_strategy,
                                 without_foreign_options)

LONG_SEQUENCE = 8192  # from this length on, auto also tries context parallel
# the share of a GPU's memory the plan's fastest checkpointing setting is warned to leave free: the CUDA caching
# allocator reserves more than the tensors' peak (benchmarks/scale_prediction.py: torchtitan's runs, +6 to +19 %)
RESERVE = 0.10
RECIPE_LAYOUT = "the recipe's parallel:"  # auto's one layout where the recipe sets its parallel degrees
TIE = 0.02  # two layouts predicted this close are called a tie: the published runs' errors are larger


@dataclass(frozen=True, kw_only=True)
class Planned:
    layout: str
    world_size: int
    step: step_time.StepTime | None
    peak_bytes_per_gpu: int | None
    fits: bool
    refused: str | None = None  # why the layout cannot run, where it cannot
    work: step_time.Work | None = None  # what the busiest rank does, the step time's input
    without: tuple[str, ...] = ()  # the recipe's options for another strategy, which this layout's does not read

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.layout, "world_size": self.world_size, "fits": self.fits}
        if self.without:
            out["without"] = list(self.without)
        if self.refused is not None:
            return {**out, "refused": self.refused}
        step = cast(step_time.StepTime, self.step)
        return {**out, "step_time_s": step.step_time_s, "tokens_per_s_per_gpu": step.tokens_per_s_per_gpu,
                "mfu": step.mfu, "peak_bytes_per_gpu": self.peak_bytes_per_gpu,
                "largest_costs": step.largest(),
                "costs": [{"what": c.what, "seconds": c.seconds, "exposed_s": c.exposed_s} for c in step.costs]}


def auto_layouts(recipe: Recipe, model: nn.Module, cluster: step_time.Cluster) -> dict[str, tuple[str, ...]]:
    """Layout name -> its recipe overrides, for this world size; a recipe that sets its parallel degrees is its own
    one layout."""
    if any(vars(recipe.parallel).get(k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")):
        return {RECIPE_LAYOUT: ()}
    nodes, per_node = cluster.num_nodes, cluster.gpus_per_node
    # the rows without TP set its options off: a recipe that turns them on (for its own fsdp x tp) does not make
    # them refused; ddp's and zero's, at their defaults, pass the check of options set for another strategy
    plain = ("strategy.sequence_parallel=false", "strategy.loss_parallel=false")
    out: dict[str, tuple[str, ...]] = {"ddp": ("strategy.name=ddp", *plain), "fsdp": ("strategy.name=fsdp", *plain)}
    if nodes > 1:
        out[f"hsdp-{nodes}x{per_node}"] = ("strategy.name=fsdp", f"strategy.replicate_degree={nodes}", *plain)
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = ("strategy.name=zero", f"strategy.stage={stage}", *plain)
    for tp in (d for d in range(2, per_node + 1) if per_node % d == 0):  # inside a node: degrees that tile it
        try:
            tp_plan.check_degree(model, tp)  # and the model's heads and widths split by it
        except RecipeError:
            continue
        for suffix, options in tp_options(recipe, model, tp=tp):
            out[f"fsdp-tp{tp}{suffix}"] = ("strategy.name=fsdp", f"strategy.tp_degree={tp}", *options)
            if nodes > 1:  # HSDP's replica groups across the nodes, tp inside one
                out[f"hsdp-{nodes}x{per_node}-tp{tp}{suffix}"] = (
                    "strategy.name=fsdp", f"strategy.replicate_degree={nodes}", f"strategy.tp_degree={tp}", *options)
    if nodes > 1:
        out[f"pp{nodes}-fsdp"] = ("strategy.name=hybrid", f"strategy.pipeline_degree={nodes}",
                                  "strategy.data_parallel=fsdp", *plain)
        out.update(pipeline_tp_layouts(recipe, model, nodes=nodes, per_node=per_node))
    if recipe.data.max_length >= LONG_SEQUENCE and per_node % 2 == 0:  # a sequence split over 2 GPUs of a node
        out["fsdp-cp2"] = ("strategy.name=fsdp", "strategy.cp_degree=2", *plain)
        if nodes > 1:  # HSDP's replica groups across the nodes, each sequence split inside one
            out[f"hsdp-{nodes}x{per_node}-cp2"] = ("strategy.name=fsdp", f"strategy.replicate_degree={nodes}",
                                                    "strategy.cp_degree=2", *plain)
    return out


def pipeline_tp_layouts(recipe: Recipe, model: nn.Module, *, nodes: int,
                        per_node: int) -> dict[str, tuple[str, ...]]:
    """A stage per node, tensor-parallel inside it (Megatron's and torchtitan's 3-D layout): tp over a degree that
    tiles the node, FSDP over the node's other GPUs (`pp{nodes}-fsdp-tp{tp}`), or over none where tp takes the whole
    node (`pp{nodes}-tp{per_node}`: the pipeline with tp_degree). Each in the variants tp_options plans for FSDP × TP:
    the last stage's head and loss split over the vocabulary (`-lossp`) where the model takes it, with and without
    sequence parallelism (`-sp`)."""
    out: dict[str, tuple[str, ...]] = {}
    for tp in (d for d in range(2, per_node + 1) if per_node % d == 0):
        try:
            tp_plan.check_degree(model, tp)
        except RecipeError:
            continue
        for suffix, options in tp_options(recipe, model, tp=tp):
            if tp == per_node:
                out[f"pp{nodes}-tp{tp}{suffix}"] = ("strategy.name=pipeline", f"strategy.tp_degree={tp}", *options)
            else:
                out[f"pp{nodes}-fsdp-tp{tp}{suffix}"] = ("strategy.name=hybrid", f"strategy.pipeline_degree={nodes}",
                                                         "strategy.data_parallel=fsdp", f"strategy.tp_degree={tp}",
                                                         *options)
    return out


def tp_options(recipe: Recipe, model: nn.Module, *, tp: int) -> list[tuple[str, tuple[str, ...]]]:
    """How auto runs TP over `tp` ranks: (the layout name's suffix, its overrides) for each variant worth planning.
    The loss over the vocabulary split (`-lossp`: a causal LM whose vocabulary tp divides, without tiled loss) where
    the model takes it, for a rank holds and computes 1/tp of the head and logits; with and without sequence
    parallelism (`-sp`: Llama-style blocks) where it takes that, for it holds less (the norms' activations 1/tp) and
    moves two gathers a micro-batch more, whose time the plan counts and the norms' saved time not: the table shows
    both. torchtitan runs both by default. Each variant sets both on or off itself: a recipe that turns one on must
    not make a row named without it a second row with it."""
    vocabulary: tuple[str, ...] = ()
    if recipe.model.task == "causal-lm" and not recipe.train.tiled_loss:
        try:
            tp_plan.vocab_modules(model, degree=tp)
            vocabulary = ("strategy.loss_parallel=true",)
        except RecipeError:
            pass
    suffix = "-lossp" if vocabulary else ""
    vocabulary = vocabulary or ("strategy.loss_parallel=false",)
    variants = [(suffix, ("strategy.sequence_parallel=false", *vocabulary))]
    try:
        tp_plan.sequence_parallel_plan(model)
        variants.append((f"-sp{suffix}", ("strategy.sequence_parallel=true", *vocabulary)))
    except RecipeError:
        pass
    return variants


def plan_layout(name: str, recipe: Recipe, model: nn.Module, cluster: step_time.Cluster, *,
                runtime_bytes: int = 0) -> Planned:
    """One layout's prediction, or why it cannot run. A layout of auto or an arm plans without the recipe's options
    for a strategy other than its own (zero's offload_optimizer on the fsdp row): the recipe's own layout is
    refused with them, as its run is. On a CPU profile (toolkit calibrate --hardware cpu) a rank computes on its share
    of the cores (at_ranks), and its memory holds its process as well, `runtime_bytes` (as toolkit plan without
    --hardware counts it) and its strategy's libraries; a GPU's holds neither."""
    world = cluster.world_size
    without: tuple[str, ...] = ()
    try:
        recipe = resolve(recipe, world_size=world)
        if name != RECIPE_LAYOUT:
            recipe, without = without_foreign_options(recipe)
        validate_strategy(recipe, world_size=world)
        cpu = cluster.hardware.on_cpu
        if cpu:  # a rank computes on its share of the cores
            cluster = dataclasses.replace(cluster, hardware=at_ranks(cluster.hardware, world))
        work, step = busiest_work(recipe, model, cluster, world_size=world, shapes=None)
        runtime = runtime_bytes + runtime_module_bytes(strategy_info(recipe.strategy.name).runtime_modules) \
            if cpu else 0
        memory = predict(recipe, world_size=world, runtime_bytes=runtime, device_type="cpu" if cpu else "cuda",
                         model=model, both=False)
    except RecipeError as exc:
        return Planned(layout=name, world_size=world, step=None, peak_bytes_per_gpu=None, fits=False,
                       refused=str(exc), without=without)
    peak = memory.peak_bytes
    return Planned(layout=name, world_size=world, step=step, peak_bytes_per_gpu=peak,
                   fits=peak <= cluster.hardware.memory_bytes, work=work, without=without)


def at_ranks(profile: profiles.Hardware, world: int) -> profiles.Hardware:
    """A CPU profile's compute rates for a rank of `world` on the machine it was measured on: a rank computes on
    cores ÷ ranks threads (toolkit.launch), a one-process arm on all of them. A profile measured at 2 ranks of one
    thread planned single at one thread's rate: twice its step time (0.87 s against 0.39-0.44 measured)."""
    from toolkit.cost.calibrate import at_cores, rank_cores

    measured = profile.measured
    cores = max(1, round((measured.cores or measured.threads or 1) * (measured.num_ranks or 1)))
    return at_cores(profile, rank_cores(max(1, cores // world), world=world, cores=cores))


def busiest_work(recipe: Recipe, model: nn.Module, cluster: step_time.Cluster, *, world_size: int,
                 shapes: list[list[tuple[int, int]]] | None) -> tuple[step_time.Work, step_time.StepTime]:
    """The rank whose step is the longest, its work and step time: the last rank, or under a pipeline each
    pipeline rank's first (its stages' compute, collectives, optimizer step and, holding the head, loss) and the
    slowest of them. `shapes`: each rank's micro-batches (None: the recipe's, every one at data.max_length)."""
    ranks = [world_size - 1]
    if strategy_degrees(recipe, world_size=world_size).pp > 1:
        from toolkit.strategies.pipeline.layout import grid_of

        grid = grid_of(recipe, world_size)
        ranks = [next(r for r in range(world_size) if grid.coords(r)[0] == p) for p in range(grid.pp)]
    planned = []
    for rank in ranks:
        work = work_for_shapes(recipe, model, world_size=world_size, rank=rank,
                               shapes=shapes[rank] if shapes is not None else None)
        if cluster.hardware.measured.seconds_per_op:  # a CPU profile: each op's host time is a cost
            try:
                work = dataclasses.replace(work, ops_per_micro_batch=rank_ops(recipe, model, world_size=world_size,
                                                                              rank=rank))
            except RecipeError:  # a model the trace cannot run: its step predicted without them, not refused
                pass
        planned.append((work, step_time.predict(model, work, cluster)))
    return max(planned, key=lambda done: done[1].step_time_s)


def rank_ops(recipe: Recipe, model: nn.Module, *, world_size: int, rank: int) -> int:
    """The ops a micro-batch dispatches on `rank` beside its matmuls and attention, as the activation trace counts
    them in the dtypes the strategy computes in: the whole model's, or under a pipeline the sum of the rank's
    stages' own traces (their blocks, embeddings, head or its rows, as its run cuts them)."""
    from toolkit.memory.activations import traced_ops

    params_dtype, autocast_dtype = trace_dtypes(recipe, strategy_rules(recipe).info(recipe))
    how: dict[str, Any] = {"params_dtype": params_dtype, "autocast_dtype": autocast_dtype,
                           "checkpointing": recipe.train.activation_checkpointing}
    if strategy_degrees(recipe, world_size=world_size).pp == 1:
        return traced_ops(model, recipe, **how).total
    from toolkit.strategies.pipeline.layout import grid_of
    from toolkit.strategies.pipeline.memory import stage_traces

    pp_rank = grid_of(recipe, world_size).coords(rank)[0]
    return sum(trace.ops for trace in stage_traces(model, recipe, world_size=world_size, pp_rank=pp_rank,
                                                   how=how).values())


def work_for_shapes(recipe: Recipe, model: nn.Module, *, world_size: int, rank: int,
                    shapes: list[tuple[int, int]] | None) -> step_time.Work:
    """What `rank` does in a step of micro-batches `shapes` (samples, padded length; None: the recipe's micro
    batch at data.max_length, every one)."""
    rules = strategy_rules(recipe)
    shards = data_layout(recipe, world_size=world_size, rank=rank).size
    batch = plan_batch(recipe.batch, world_size=shards)
    length = recipe.data.max_length
    if shapes is None:
        shapes = [(batch.micro_batch_size, length)] * batch.grad_accum_steps
    else:
        length = round(sum(r * n for r, n in shapes) / sum(r for r, _ in shapes))  # their mean padded length
    collectives = rules.predict_collectives(model, recipe, world_size=world_size, rank=rank, shapes=shapes) + \
        loop_collectives(world_size=world_size)
    state = rules.predict_state_bytes(model, recipe, world_size=world_size)[rank]
    # AdamW reads a parameter, its gradient and both moments, and writes the parameter and the moments
    moved = 2 * state.params_bytes + state.grads_bytes + 2 * state.optim_bytes
    options = recipe.strategy
    # offloaded: the rank's gradient partition goes to the host and its updated parameters come back, each step
    offloaded = 2 * state.grads_bytes if (getattr(options, "offload_optimizer", False) or
                                          getattr(options, "cpu_offload", False)) else 0
    degrees = strategy_degrees(recipe, world_size=world_size)
    bubble = 0.0
    pipeline_rank = None
    if degrees.pp > 1:
        from toolkit.strategies.pipeline.layout import grid_of, head_rows_of, stage_of_blocks
        from toolkit.strategies.pipeline.schedules import theoretical_bubble

        bubble = theoretical_bubble(options.schedule, pp=degrees.pp, stages_per_rank=options.stages_per_rank,
                                    micro_batches=batch.grad_accum_steps)
        grid = grid_of(recipe, world_size)
        parts, num_stages = stage_of_blocks(model, recipe, grid)  # as the run splits it
        stages = grid.stage_ids(grid.coords(rank)[0], options.stages_per_rank)
        rows = head_rows_of(model, recipe, grid)  # split_head: the stages' rows of the head, else the last's
        vocab = max((r[1] for r in rows if r is not None), default=1)
        head = sum((r[1] - r[0]) / vocab for s, r in enumerate(rows) if r is not None and s in stages) \
            if any(rows) else float(num_stages - 1 in stages)
        pipeline_rank = (sum(parts.count(s) for s in stages) / len(parts), head)
    work = step_time.Work(degrees=degrees,
                          global_tokens=batch.global_batch_size * length, seq_len=length,
                          precision=recipe.precision, checkpointing=recipe.train.recompute,
                          num_micro_batches=batch.grad_accum_steps,
                          bubble=bubble,
                          collectives=collectives, optimizer_bytes=moved, offloaded_bytes=offloaded,
                          vocab_split=degrees.tp > 1 and recipe.strategy.loss_parallel, pipeline_rank=pipeline_rank)
    return work


def ranked(planned: list[Planned]) -> list[Planned]:
    """Those that fit first, fastest first; then those that do not fit; then those that cannot run."""
    def key(p: Planned):
        speed = p.step.tokens_per_s_per_gpu if p.step is not None else 0.0
        return (p.refused is not None, not p.fits, -speed)
    return sorted(planned, key=key)


def reasons(order: list[Planned]) -> list[str]:
    """Why each layout that fits wins over the next, in one line: the exposed cost that differs most."""
    lines = []
    fitting = [p for p in order if p.fits and p.step is not None]
    for first, second in zip(fitting, fitting[1:]):
        a, b = cast(step_time.StepTime, first.step), cast(step_time.StepTime, second.step)
        exposed_a = {c.what: c.exposed_s for c in a.costs}
        exposed_b = {c.what: c.exposed_s for c in b.costs}
        costs = set(exposed_a) | set(exposed_b)
        what = max(costs, key=lambda w: exposed_b.get(w, 0.0) - exposed_a.get(w, 0.0))
        ratio = a.tokens_per_s_per_gpu / b.tokens_per_s_per_gpu
        why = (f"{second.layout} spends {_ms(exposed_b.get(what, 0.0))} a step on {what}, {first.layout} "
               f"{_ms(exposed_a.get(what, 0.0))}")
        # and what the first pays that the second does not (zero2 beside pp2-fsdp: its gradients' all-reduce
        # against the other's bubble), so that a tie or a narrow win does not read as a cost on one side only
        back = max(costs, key=lambda w: exposed_a.get(w, 0.0) - exposed_b.get(w, 0.0))
        if exposed_a.get(back, 0.0) > exposed_b.get(back, 0.0):
            why += (f"; {first.layout} spends {_ms(exposed_a.get(back, 0.0))} on {back}, {second.layout} "
                    f"{_ms(exposed_b.get(back, 0.0))}")
        if ratio < 1 + TIE:
            lines.append(f"{first.layout} and {second.layout} tie (within {100 * TIE:.0f} %, below what this model "
                         f"tells apart): {why}")
        else:
            lines.append(f"{first.layout} over {second.layout}: {ratio:.2f}x the tokens/s; {why}")
    return lines


# train.activation_checkpointing's settings (TrainConfig.recompute's names), each as its --set value
CHECKPOINTING_VALUES = {"none": "false", "selective": "selective", "full": "true"}


def checkpointing_line(order: list[Planned], *, recompute: str, memory: float,
                       plan_with: Callable[[str, str], Planned]) -> str | None:
    """One line: the first layout of `order` that runs, under each activation checkpointing setting (`recompute`:
    the recipe's, already planned; `plan_with(layout, value)` plans another), and the fastest of them that fits
    (`memory`: a GPU's bytes), with the --set that chooses it where it is not the recipe's. The trade each setting
    makes, memory for a recompute, is one no layout of the table varies."""
    first = next((p for p in order if p.refused is None), None)
    if first is None:
        return None
    done = {mode: first if mode == recompute else plan_with(first.layout, value)
            for mode, value in CHECKPOINTING_VALUES.items()}
    parts = []
    for mode, planned in done.items():
        own = " (the recipe's)" if mode == recompute else ""
        if planned.refused is not None or planned.step is None:
            parts.append(f"{mode} cannot run{own}")
            continue
        parts.append(f"{mode} {planned.step.tokens_per_s_per_gpu:,.0f} tokens/s/GPU at "
                     f"{cast(int, planned.peak_bytes_per_gpu) / 1e9:.1f} GB{'' if planned.fits else ' (NO fit)'}{own}")

    def fastest(limit: float) -> str | None:
        within = [(mode, p) for mode, p in done.items()
                  if p.step is not None and p.peak_bytes_per_gpu is not None and p.peak_bytes_per_gpu <= limit]
        if not within:
            return None
        mode, _ = max(within, key=lambda item: cast(step_time.StepTime, item[1].step).tokens_per_s_per_gpu)
        chosen = f" (--set train.activation_checkpointing={CHECKPOINTING_VALUES[mode]})"
        return mode + ("" if mode == recompute else chosen)

    fits, roomy = fastest(memory), fastest((1 - RESERVE) * memory)
    best = f"the fastest that fits: {fits}" if fits else "none of them fits"
    if fits and roomy != fits:  # the fastest fits within the reserve only
        best += (f", within {100 * RESERVE:.0f} % of the {memory / 1e9:.0f} GB, which the CUDA allocator's reserve "
                 "can take (torchtitan's published runs reserved 6-19 % above the plan's peak); the fastest with "
                 f"{100 * RESERVE:.0f} % free: {roomy or 'no setting'}")
    return f"activation checkpointing for {first.layout}: " + "; ".join(parts) + f"; {best}"


def _ms(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def render(planned: list[Planned], cluster: step_time.Cluster) -> str:
    hw = cluster.hardware
    limit = f"{hw.memory_bytes / 1e9:{',.0f' if hw.memory_bytes >= 1e11 else '.3g'}}"  # a CPU profile's 1 TB: 1,030
    head = ["layout", "GPUs", "step s", "tokens/s/GPU", "MFU", "peak GB/GPU", f"fits {limit} GB",
            "largest exposed costs"]
    rows = []
    for p in planned:
        if p.refused is not None:
            rows.append([p.layout, str(p.world_size), "-", "-", "-", "-", "cannot run", p.refused])
            continue
        step = cast(step_time.StepTime, p.step)
        rows.append([p.layout, str(p.world_size), f"{step.step_time_s:.3f}", f"{step.tokens_per_s_per_gpu:,.0f}",
                     f"{100 * step.mfu:.1f} %", f"{cast(int, p.peak_bytes_per_gpu) / 1e9:.1f}",
                     "yes" if p.fits else "NO", "; ".join(step.largest())])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head[:-1])]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[-1]]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    out += without_lines(planned)
    out.append(f"{cluster.num_nodes} node(s) × {cluster.gpus_per_node} {hw.name}; predicted, not measured: "
               "toolkit/cost/step_time.py says how")
    return "\n".join(out)


def without_lines(planned: list[Planned]) -> list[str]:
    """Which rows planned without which of the recipe's options for another strategy: one line per set of rows."""
    rows_of: dict[str, tuple[str, ...]] = {}
    for option in dict.fromkeys(option for p in planned for option in p.without):
        rows_of[option] = tuple(p.layout for p in planned if option in p.without)
    lines = []
    for rows in dict.fromkeys(rows_of.values()):
        options = " and ".join(option for option, its in rows_of.items() if its == rows)
        others = [p.layout for p in planned if p.layout not in rows]
        who = ("every layout" if not others else f"every layout but {', '.join(others)}"
               if len(others) < len(rows) else ", ".join(rows))
        lines.append(f"{who}: planned without the recipe's {options} (read by another strategy only)")
    return lines


def as_json(planned: list[Planned]) -> str:
    return json.dumps([p.as_dict() for p in planned], indent=1)


def check_degrees(recipe: Recipe, cluster: step_time.Cluster) -> None:
    """A recipe whose parallel: section sets degrees must multiply to the cluster's GPUs."""
    degrees = {k: v for k, v in vars(recipe.parallel).items() if k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
               and v}
    product = 1
    for value in degrees.values():
        product *= value
    if degrees and (product != cluster.world_size if "dp_shard" in degrees else cluster.world_size % product):
        shown = " × ".join(f"{k} {v}" for k, v in degrees.items())
        raise RecipeError(f"parallel: {shown} = {product} ranks, but --nodes {cluster.num_nodes} × --gpus-per-node "
                          f"{cluster.gpus_per_node} = {cluster.world_size}; make them equal (or leave dp_shard unset "
                          "to take the rest)")


def cluster_of(name: str, *, nodes: int, gpus_per_node: int | None) -> step_time.Cluster:
    hw = profiles.load(name)
    if nodes < 1:
        raise RecipeError(f"--nodes {nodes}: give 1 or more")
    per_node = gpus_per_node if gpus_per_node is not None else hw.gpus_per_node
    if per_node < 1:
        raise RecipeError(f"--gpus-per-node {per_node}: give 1 or more")
    return step_time.Cluster(hardware=hw, num_nodes=nodes, gpus_per_node=per_node)
