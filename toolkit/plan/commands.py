"""`toolkit calibrate` and `toolkit plan --hardware`: the command-line ends of the step-time model (toolkit/cost/)
and the scale plan (toolkit/plan/scale.py); the parser is toolkit/cli.py's."""

from __future__ import annotations

import os
import sys

from toolkit.errors import RecipeError


def calibrate(args) -> int:
    """Measure this machine and write its profile (toolkit/cost/calibrate.py)."""
    from pathlib import Path

    from toolkit.config.files import load_recipe
    from toolkit.cost import calibrate, hardware
    from toolkit.model.precision import DTYPES
    from toolkit.plan.predict import planned_model

    recipe = load_recipe(args.recipe, args.overrides) if args.recipe is not None else None
    if recipe is None and args.overrides:
        raise RecipeError("--set changes a recipe: give the recipe too (toolkit calibrate RECIPE --hardware ...)")
    model = planned_model(recipe) if recipe is not None else None
    tokens = recipe.batch.micro_batch_size * recipe.data.max_length if recipe is not None else 2048
    dtype = DTYPES[recipe.precision if recipe is not None else "fp32"]
    out = Path(args.output or f"hardware-{args.hardware}.yaml")
    _check_profile_path(out)  # before the minutes of measuring
    if args.hardware == "cpu":
        print(f"[toolkit] calibrating the CPU for {args.nproc} rank(s): matmul, attention, memory, gloo...",
              file=sys.stderr, flush=True)
        try:
            profile = calibrate.cpu_profile(nproc=args.nproc, model=model, tokens=tokens, dtype=dtype)
        except calibrate.MeasurementFailed as exc:  # not the user's mistake (exit 1), but one line all the same
            print(f"toolkit: calibrate: {exc}; nothing written", file=sys.stderr, flush=True)
            return 1
    else:
        base = hardware.load(args.hardware)
        import torch

        if not torch.cuda.is_available():
            raise RecipeError(f"--hardware {args.hardware}: no GPU here to measure; use --hardware cpu on this machine")
        profile = calibrate.gpu_profile(base, nproc=args.nproc, model=model, tokens=tokens, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    hardware.write(profile, out, header=f"written by toolkit calibrate --hardware {args.hardware} "
                   f"--nproc {args.nproc}{' ' + args.recipe if args.recipe else ''}")
    m = profile.measured
    print(f"[toolkit] {out}: matmul {(m.matmul_flops_per_s or 0) / 1e12:.3f} TFLOP/s ({m.matmul_dtype}), memory "
          f"{(m.memory_bandwidth_bytes_per_s or 0) / 1e9:.1f} GB/s" +
          (f", loss {m.loss_seconds_per_logit * 1e9:.2f} ns a logit" if m.loss_seconds_per_logit else "") +
          (f", {m.seconds_per_op * 1e6:.1f} µs an op beside the matmuls" if m.seconds_per_op else "") +
          (f", all-reduce bus {m.bus_bandwidth_bytes_per_s / 1e9:.2f} GB/s" if m.bus_bandwidth_bytes_per_s else ""))
    return 0


def _check_profile_path(out) -> None:
    """--output names a file calibrate can write: not a folder, in a folder that is or can be made."""
    from toolkit.checkpoint.store import check_creatable

    if os.path.isdir(out):  # False, not an OSError, for a name the file system refuses (check_creatable says)
        raise RecipeError(f"--output {out} is a folder; name the profile file to write (say {out / 'cpu.yaml'})")
    try:
        check_creatable(out.parent, what="--output")
    except RecipeError as exc:  # it names the folder: the user gave the file
        raise RecipeError(str(exc).replace(f"--output {out.parent}:", f"--output {out}:", 1)) from None
    existing = next(p for p in out.parents if p.exists())  # the file system the folders made will be on
    if len(os.fsencode(out.name)) > os.pathconf(existing, "PC_NAME_MAX"):
        raise RecipeError(f"--output {out}: its file name is longer than the file system allows; choose a shorter one")


def scale_plan(args) -> int:
    """Step time, tokens/s per GPU, MFU and memory per layout on a cluster of --nodes × --gpus-per-node."""
    from toolkit.config.arm_specs import arm_parts, split_arms
    from toolkit.config.files import load_recipe, replaced_overrides
    from toolkit.plan import scale
    from toolkit.plan.predict import planned_model
    from toolkit.strategies import arm_aliases, strategy_info

    if args.strategies is not None or args.memory_per_rank is not None:
        raise RecipeError("--strategies and --memory-per-rank plan this machine; with --hardware use --layouts "
                          "(the hardware profile gives the memory)")
    cluster = scale.cluster_of(args.hardware, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    base = load_recipe(args.recipe, args.overrides)
    scale.check_degrees(base, cluster)
    model = planned_model(base)
    aliases = arm_aliases()
    def reads(own: tuple[str, ...], item: str) -> bool:
        """Whether a layout of overrides `own` reads the strategy option `item` sets: auto's rows without TP set
        sequence_parallel and loss_parallel off only so that a recipe's fsdp × tp options pass their check (they
        plan without them: scale.without_foreign_options), not as a value that would replace a --set."""
        key = item.partition("=")[0].strip()
        if not key.startswith("strategy.") or key == "strategy.name":
            return True
        name = next((o.partition("=")[2].strip() for o in reversed(own) if o.startswith("strategy.name=")),
                    base.strategy.name)
        return key.removeprefix("strategy.") in strategy_info(name).options

    if args.layouts in (None, "auto"):
        layouts, explicit = scale.auto_layouts(base, model, cluster), False
        replaced = sorted({given for name, own in layouts.items()
                           for given, theirs in replaced_overrides(args.overrides, own) if reads(own, theirs)})
        if replaced:  # the recipe's own row keeps them; a row named for its layout is that layout
            print(f"[toolkit] --set {', '.join(replaced)}: planned on the recipe's own row; auto's other rows set "
                  "these keys themselves (plan one with it as --layouts NAME@KEY=VALUE)", file=sys.stderr, flush=True)
    else:
        names = split_arms(args.layouts, option="--layouts")  # each once, none empty
        auto = scale.auto_layouts(base, model, cluster)  # auto's own names too (fsdp-tp8-sp-lossp, hsdp-2x8)
        auto.pop(scale.RECIPE_LAYOUT, None)
        # auto's row where both name one: its TP rows set sequence parallelism themselves (fsdp-tp2 too)
        known = {**aliases, **auto}
        layouts = {}
        for spec in names:  # a name, with per-layout overrides as in compare (pp-tp2@strategy.tp_degree=8)
            name, *extra = arm_parts(spec, what="layout")
            if name not in known:
                own = [n for n in known if n not in aliases]
                raise RecipeError(f"--layouts: unknown layout {name!r}; choose from auto, "
                                  + (f"the layouts auto plans here ({', '.join(own)}) " if own else "")
                                  + f"or the arms {', '.join(aliases)} (each with overrides as NAME@KEY=VALUE)")
            clash = [(given, theirs) for given, theirs in replaced_overrides(args.overrides, known[name], then=extra)
                     if reads(known[name], theirs)]
            if clash:
                given, theirs = clash[0]
                raise RecipeError(f"--layouts {name} sets {theirs} itself, which would replace --set {given}; give "
                                  f"it to the layout ({name}@{given}), or choose a layout that runs it")
            layouts[spec] = (*known[name], *extra)
        explicit = True
    runtime = 0
    if cluster.hardware.on_cpu:  # a rank's memory holds its process too
        from toolkit.plan.predict import run_base_bytes

        runtime = run_base_bytes(base)
    planned = []
    for number, (name, overrides) in enumerate(layouts.items(), 1):
        if not args.json:
            print(f"[toolkit] planning {name} ({number}/{len(layouts)})", file=sys.stderr, flush=True)
        done = scale.plan_layout(name, load_recipe(args.recipe, [*args.overrides, *overrides]), model, cluster,
                                 runtime_bytes=runtime)
        if explicit and done.refused is not None:  # asked for by name: a mistake in the command
            raise RecipeError(f"--layouts {name} at {cluster.world_size} GPUs: {done.refused}")
        planned.append(done)
    order = scale.ranked(planned)
    if args.json:
        print(scale.as_json(order))
    else:
        print(scale.render(order, cluster))
        print("\n".join(scale.reasons(order)))

        def plan_with(name: str, value: str) -> scale.Planned:
            changed = load_recipe(args.recipe, [*args.overrides, *layouts[name],
                                                f"train.activation_checkpointing={value}"])
            return scale.plan_layout(name, changed, model, cluster, runtime_bytes=runtime)
        line = scale.checkpointing_line(order, recompute=base.train.recompute, memory=cluster.hardware.memory_bytes,
                                        plan_with=plan_with)
        if line is not None:
            print(line)
    return 0 if any(p.fits for p in order) else 1
