"""`toolkit compare` and `toolkit report` (registered into the main parser)."""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path

from toolkit.errors import RecipeError, first_line

DEFAULT_ARMS = "single,ddp,fsdp,zero2,zero3"  # the first is the reference


def add_compare_commands(sub, add_overrides) -> None:
    compare = sub.add_parser("compare", help="run one job under several strategies; report speed, memory, "
                                             "MFU and whether they computed the same thing")
    compare.add_argument("recipe", help="a recipe YAML, or a matrix file with `recipe:` and `strategies:`")
    compare.add_argument("--strategies", default=None,
                         help=f"comma-separated arms, first = reference (default {DEFAULT_ARMS})")
    compare.add_argument("--nproc", type=int, default=None, help="ranks per multi-process arm (default 2)")
    compare.add_argument("--steps", type=int, default=None, help="optimizer steps per arm")
    compare.add_argument("--hardware", default=None, metavar="NAME|FILE",
                         help="the profile each arm's step time is predicted on (toolkit calibrate writes one); "
                              "default on a CPU: this machine, measured after the arms")
    compare.add_argument("--output", default=None, metavar="DIR",
                         help="the experiment folder (default runs/<date>-compare); run again with the same "
                              "DIR to finish the arms not completed")
    add_overrides(compare)
    report = sub.add_parser("report", help="re-render the report of a compare experiment directory")
    report.add_argument("experiment_dir")


# a calibration run is no arm of the experiment: its curves (train.report_to) would stand beside the arms' as one
UNTRACKED = "train.report_to=[]"


def calibration_arms(experiment) -> list:
    """Two reference runs per low precision, differing only in reduction order, and where the reference is fp32
    one run of it on one process from a rounding-perturbed start (see verdict.py); none tracked."""
    from toolkit.compare.experiment import RECORD_GRADIENT_SCALE, Arm
    from toolkit.config.files import load_recipe
    from toolkit.strategies import validate_strategy

    reference = experiment.arms[0]
    rounding = rounding_arm(experiment)
    out = [rounding] if rounding is not None else []
    precisions = set()
    for arm in experiment.arms:
        recipe = load_recipe(experiment.recipe, [*experiment.common, *arm.overrides])
        if recipe.precision != "fp32":
            precisions.add(recipe.precision)
    for precision in sorted(precisions):
        base = [o for o in reference.overrides if not o.startswith(("precision=", "batch.", RECORD_GRADIENT_SCALE))]
        recipe = load_recipe(experiment.recipe, [*experiment.common, *reference.overrides])
        plan = validate_strategy(recipe, world_size=reference.nproc)  # over its data-parallel ranks, not all ranks
        micro = plan.micro_batch_size // 2 if plan.micro_batch_size % 2 == 0 else 1
        batch = [f"batch.global_batch_size={plan.global_batch_size}", "batch.grad_accum_steps=null"]
        out.append(Arm(f"calibration-{precision}-a", reference.nproc,
                       (*base, *batch, f"batch.micro_batch_size={plan.micro_batch_size}", f"precision={precision}",
                        UNTRACKED)))
        out.append(Arm(f"calibration-{precision}-b", reference.nproc,
                       (*base, *batch, f"batch.micro_batch_size={micro}", f"precision={precision}", UNTRACKED)))
    return out


def rounding_arm(experiment):
    """The reference arm's job on one process (strategy single: one reduction order, the whole model built as
    loaded, so every strategy's reference can be perturbed) from weights × (1 + 1e-7·N(0,1)); None for a
    reference in bf16 or fp16, which calibration judges."""
    from toolkit.compare.experiment import RECORD_GRADIENT_SCALE, ROUNDING_ARM, Arm, arm_overrides
    from toolkit.compare.verdict import ROUNDING_PERTURBATION
    from toolkit.config.files import load_recipe
    from toolkit.strategies import validate_strategy

    reference = experiment.arms[0]
    recipe = load_recipe(experiment.recipe, [*experiment.common, *reference.overrides])
    if recipe.precision != "fp32":
        return None
    plan = validate_strategy(recipe, world_size=reference.nproc)
    own = [o for o in reference.overrides if not o.startswith(("strategy.", "batch.", RECORD_GRADIENT_SCALE))]
    return Arm(ROUNDING_ARM, 1, (*arm_overrides("single"), *own, f"batch.global_batch_size={plan.global_batch_size}",
                                 f"batch.micro_batch_size={plan.micro_batch_size}", "batch.grad_accum_steps=null",
                                 f"train.init_perturbation={ROUNDING_PERTURBATION}", UNTRACKED))


def experiment_of(args):
    """The experiment `toolkit compare` was asked for: from a matrix file, or a recipe and --strategies."""
    from toolkit.compare.experiment import build_experiment, load_matrix
    from toolkit.config.arm_specs import split_arms
    from toolkit.config.yaml_files import read_yaml_mapping

    if not Path(args.recipe).is_file():
        raise RecipeError(f"{args.recipe} not found; pass a recipe or a matrix file")
    if args.nproc is not None and args.nproc < 1:  # None: the matrix file's nproc, else 2
        raise RecipeError(f"--nproc {args.nproc}: give the number of ranks per multi-process arm, 1 or more")
    data = read_yaml_mapping(Path(args.recipe), what="compare file",
                             holds="recipe sections (model, data, ...) or matrix keys (recipe, strategies, ...)")
    overrides = [*args.overrides, *([f"output_dir={args.output}"] if args.output else [])]
    if "strategies" in data:
        if args.strategies is not None:  # the file's arms would win without a word
            raise RecipeError(f"{args.recipe} is a matrix file: its `strategies:` lists the arms; drop --strategies, "
                              "or pass a recipe with --strategies")
        experiment = load_matrix(args.recipe, nproc=args.nproc, steps=args.steps, overrides=overrides,
                                 note=lambda line: print(line, file=sys.stderr, flush=True))
    else:
        strategies = split_arms(args.strategies if args.strategies is not None else DEFAULT_ARMS)
        experiment = build_experiment(args.recipe, strategies=strategies, precisions=[None], accums=[None],
                                      nproc=args.nproc or 2, steps=args.steps, overrides=overrides)
    experiment.arms += calibration_arms(experiment)
    if args.hardware is not None:  # a mistake found now, not after every arm ran
        from toolkit.cost import hardware

        hardware.load(args.hardware)
    return experiment



def cmd_compare(args) -> int:
    experiment = experiment_of(args)
    lock = hold_experiment(experiment.out_dir)
    try:
        return _compare(experiment, args)
    finally:
        lock.release()


def hold_experiment(out_dir: Path):
    """The experiment folder, held while this compare runs (process/folder_lock.py): a second compare into it
    would replace the arm folder a running arm writes (run_arm). Made here where the compare is to make it."""
    from toolkit.process import folder_lock

    with contextlib.suppress(OSError):  # a folder that cannot be made: experiment.json's write says so
        out_dir.mkdir(parents=True, exist_ok=True)
    return folder_lock.hold(out_dir, message=lambda who: (
        f"experiment folder {out_dir} is in use by a compare still running ({who}); let it end, or stop it (Ctrl-C "
        "in its terminal: its completed arms are kept) and run this again; or pass another --output"))


def _compare(experiment, args) -> int:
    from toolkit.compare.experiment import dropout_note
    from toolkit.compare.report import build_results, report_written
    from toolkit.compare.console import summary_lines, wrapped
    from toolkit.compare.runner import INTERRUPTED, Interrupted, run_experiment

    print("\n".join(wrapped(f"[compare] experiment {experiment.out_dir}: {len(experiment.arms)} arms "
                            f"({', '.join(a.name for a in experiment.arms)})")), flush=True)
    note = dropout_note(experiment.common)
    if note:
        print("\n".join(wrapped(f"[compare] {note}")), flush=True)
    try:
        statuses = run_experiment(experiment, log=lambda line: print(line, flush=True))
    except Interrupted as stop:
        kept = ", ".join(stop.completed) or "none"
        print(f"toolkit: compare interrupted during arm {stop.arm}; arms completed and kept in "
              f"{experiment.out_dir}: {kept}; run the rest with: toolkit {_again(experiment, args)}",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    try:
        measure_machine(experiment, args)
    except KeyboardInterrupt:  # every arm is done and kept: only the measurement and the report are left
        print(f"toolkit: compare interrupted while measuring this machine for the step-time predictions; every arm "
              f"ran and is kept in {experiment.out_dir}; measure it and write the report with: toolkit "
              f"{_again(experiment, args)}", file=sys.stderr, flush=True)
        return INTERRUPTED
    except RecipeError:
        raise
    except Exception as exc:  # the arms' results come first: a failed measurement costs the predictions only
        print(f"[compare] no predicted step times: measuring this machine failed ({first_line(exc)})", flush=True)
    results = build_results(experiment)
    print("\n".join(summary_lines(results)))  # the full table: report.md and report.html
    if not report_written(results, experiment.out_dir):  # a full disk: the table above is what the user has of it
        return 1
    print(f"[compare] report: {experiment.out_dir / 'report.html'}")
    print(f"[compare] also: report.md, results.json (every arm's resolved recipe) in {experiment.out_dir}")
    if (experiment.out_dir / "tensorboard").is_dir():  # train.report_to tensorboard: one run per arm
        print(f"[compare] curves: tensorboard --logdir {experiment.out_dir / 'tensorboard'}")
    return 1 if "failed" in statuses.values() else 0


def _again(experiment, args) -> str:
    """The command that goes on with this experiment: this one, with the folder it made."""
    again = " ".join(shlex.quote(a) for a in sys.argv[1:] if a)
    if "--output" not in sys.argv and not any(o.startswith("output_dir=") for o in args.overrides):
        again += f" --output {shlex.quote(str(experiment.out_dir))}"
    return again


def measure_machine(experiment, args) -> None:
    """The profile each arm's step time is predicted on: --hardware's, or on a CPU this machine's, measured once per
    experiment folder now that the arms are done (the machine idle; toolkit calibrate --hardware cpu's way)."""
    import torch

    from toolkit.compare import predictions as predicted
    from toolkit.config.files import load_recipe
    from toolkit.cost import hardware

    target = experiment.out_dir / predicted.PROFILE
    if args.hardware is not None:  # checked before any arm ran (experiment_of)
        hardware.write(hardware.load(args.hardware), target, header=f"toolkit compare --hardware {args.hardware}")
        return
    if torch.cuda.is_available() or target.is_file():
        return
    recipe = load_recipe(experiment.recipe, experiment.common) if isinstance(experiment.recipe, str) else None
    if recipe is not None:
        predicted.measure_profile(experiment.out_dir, recipe, nproc=max(a.nproc for a in experiment.arms),
                                  say=lambda line: print(f"[compare] {line}", flush=True))


def cmd_report(args) -> int:
    from toolkit.compare.experiment import Experiment
    from toolkit.compare.report import build_results, report_written
    from toolkit.compare.console import summary_lines, wrapped
    from toolkit.process import folder_lock

    experiment = Experiment.load(Path(args.experiment_dir))
    results = build_results(experiment)
    print("\n".join(summary_lines(results)))
    running = folder_lock.in_use(experiment.out_dir)
    if running is not None:  # the table so far; the folder is that compare's, which writes the report at its end
        print(f"[report] a compare is still running in {experiment.out_dir} ({running}): the arms it has not "
              "finished show as not run; it writes the report files there when it ends")
        return 0
    if not report_written(results, experiment.out_dir):  # a full disk
        return 1
    print(f"[report] {experiment.out_dir / 'report.html'}")
    return 0


COMPARE_COMMANDS = {"compare": cmd_compare, "report": cmd_report}
