"""`toolkit` command line: a thin argparse layer; user mistakes become one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from toolkit.errors import NO_ROOM, USER_ERROR_EXIT_CODE, RecipeError, no_room_line, say_once, say_user_error
from toolkit.launch.rank import interrupted, quiet_libraries
from toolkit.process.console import outlive_reader

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _recipes_epilog() -> str:
    recipes = sorted(RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    lines = [f"  {p.relative_to(RECIPES_DIR.parent)}" for p in recipes]
    return "shipped recipes:\n" + ("\n".join(lines) or "  (none found)") + \
        "\n\nexamples:\n  toolkit train recipes/minilm-sst.yaml\n" \
        "  toolkit launch --nproc 2 recipes/minilm-sst.yaml --set strategy.name=ddp"


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set optim.lr=1e-4 (repeatable)")


def _add_resume(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="CHECKPOINT",
                        help="continue from the newest complete checkpoint in output_dir, or from CHECKPOINT")
    parser.add_argument("--resume-weights-only", action="store_true",
                        help="with --resume: take the weights, schedule and data position, start the optimizer afresh")


def _resume_of(args):
    if args.resume is None:
        if args.resume_weights_only:
            raise RecipeError("--resume-weights-only goes with --resume [CHECKPOINT]")
        return None
    from toolkit.checkpoint.run import Resume  # torch.distributed.checkpoint: ~0.4 s a launcher without --resume skips

    # `--resume=~/run/...` reaches us unexpanded (a shell expands `~` only at a word's start): as the recipe's paths
    return Resume(path=os.path.expanduser(args.resume) if args.resume else None, weights_only=args.resume_weights_only)


class OneLineParser(argparse.ArgumentParser):
    """argparse's own mistakes (an unknown command or option, a missing argument, a value that is not a number)
    in one line, as the toolkit's: argparse prints its usage block first, which buries the error under the
    options. The usage stays one --help away; subcommands' parsers are of this class too (add_subparsers)."""

    commands: Mapping[str, argparse.ArgumentParser] = {}  # the subcommands' parsers, by name (build_parser)

    given: Sequence[str] = ()  # the arguments this parser was handed (parse_known_args), for error's advice

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        say_once(f"{self.prog}: error: {message}{self._dash_value_advice(message)} (see {self.prog} --help)")
        sys.exit(USER_ERROR_EXIT_CODE)

    def _dash_value_advice(self, message: str) -> str:
        """argparse takes a value that starts with `-` (`--memory-per-rank -5GiB`) for an option, and says the
        option has no value: where one was given, say how to write it."""
        missing = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if missing is None or missing.group(1) not in self.given:
            return ""
        at = self.given.index(missing.group(1))
        value = self.given[at + 1] if at + 1 < len(self.given) else ""
        if not value.startswith("-") or value.startswith("--") or value in self._option_string_actions:
            return ""
        return f"; a value that starts with '-' is written {missing.group(1)}={value}"

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but an argument no parser took is reported by the subcommand it was given to, whose
        --help lists the options it has (argparse reports it from the top, as `toolkit: error: ...`)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.commands.get(getattr(parsed, "command", None), self).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="toolkit", description="Fine-tune Hugging Face models under any parallel strategy and compare them.",
        epilog=_recipes_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a recipe in this process (or as one rank under torchrun/accelerate)")
    train.add_argument("recipe")
    _add_overrides(train)
    _add_resume(train)

    launch = sub.add_parser("launch", help="run a recipe on N local ranks through torch.distributed.run")
    launch.add_argument("--nproc", type=int, default=1, help="ranks (processes) on this machine (default 1)")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a rank dies, restart every rank up to R times; they resume from the newest checkpoint")
    launch.add_argument("--nnodes", type=int, default=1, help="machines in the job; run this command on each")
    launch.add_argument("--node-rank", type=int, default=0, help="this machine's index (0..nnodes-1)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="where the machines meet (torchrun's c10d rendezvous, on one of them)")
    launch.add_argument("--rdzv-id", default="toolkit", help="the job's rendezvous id, the same on every machine")
    launch.add_argument("--local-addr", default=None, help="the address this machine is reached at by the others")
    launch.add_argument("recipe")
    _add_overrides(launch)
    _add_resume(launch)

    convert = sub.add_parser("convert", help="write a Hugging Face model folder from a training checkpoint")
    convert.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step-N)")
    convert.add_argument("out", help="the folder to write (must not exist)")

    validate = sub.add_parser("validate", help="check a recipe and print the resolved one")
    validate.add_argument("--nproc", type=int, default=1,
                          help="world size to check the batch arithmetic for (default 1)")
    validate.add_argument("recipe")
    _add_overrides(validate)

    sub.add_parser("strategies", help="list the strategies, their recipe options and the compare arm names")

    plan = sub.add_parser("plan", help="memory per rank of a recipe under each strategy, before any process starts",
                          description="Memory per rank of a recipe under each strategy, before any process starts. "
                          "Exit status: 0 when at least one arm fits as asked, 1 when none does or no arm can run "
                          "as given (each line says why), 2 for a mistake in the command or recipe.")
    plan.add_argument("recipe")
    plan.add_argument("--nproc", type=int, default=None,
                      help="ranks per multi-process strategy (default 2); with --hardware: GPUs per node, as "
                           "--gpus-per-node")
    plan.add_argument("--strategies", default=None, metavar="ARMS",
                      help="comma-separated compare arms (toolkit strategies lists them), each with per-arm overrides "
                           "as in toolkit compare (pp-1f1b@strategy.split=[2]); default: the recipe's")
    plan.add_argument("--memory-per-rank", default=None, metavar="SIZE",
                      help="e.g. 40GiB or 80GB (default: the GPU's memory, or host memory ÷ nproc)")
    plan.add_argument("--hardware", default=None, metavar="NAME|FILE",
                      help="predict step time and tokens/s per layout on this hardware (a profile name, e.g. "
                           "h100-sxm, or a profile file toolkit calibrate wrote) instead of this machine's memory")
    plan.add_argument("--nodes", type=int, default=1, help="with --hardware: machines in the cluster (default 1)")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="with --hardware: default the profile's")
    plan.add_argument("--layouts", default=None, metavar="auto|LAYOUTS",
                      help="with --hardware: auto (the sensible ones for the cluster; the default), or "
                           "comma-separated names of auto's layouts (fsdp-tp8-sp-lossp, hsdp-2x8) or of compare "
                           "arms, each with overrides as NAME@KEY=VALUE (pp-tp2@strategy.tp_degree=8)")
    plan.add_argument("--json", action="store_true", help="with --hardware: a JSON array, one object per layout")
    _add_overrides(plan)

    calibrate = sub.add_parser("calibrate", help="measure this machine for toolkit plan --hardware: a profile file",
                               description="Measure what a hardware profile can only estimate (matmul and attention "
                               "FLOP/s on the recipe's shapes, memory bandwidth, on a CPU a causal LM's loss per "
                               "logit, the all-reduce bus between local ranks) and write a profile file for toolkit "
                               "plan --hardware FILE.")
    calibrate.add_argument("recipe", nargs="?", default=None, help="the model whose shapes to measure (optional)")
    calibrate.add_argument("--hardware", required=True, metavar="NAME",
                           help="cpu (this machine's CPU and gloo), or the profile of this machine's GPU (e.g. h100-sxm)")
    calibrate.add_argument("--nproc", type=int, default=2, help="local ranks the bus and the threads are measured for")
    calibrate.add_argument("--output", default=None, metavar="FILE", help="default: hardware-NAME.yaml here")
    _add_overrides(calibrate)

    from toolkit.compare.cli import add_compare_commands

    add_compare_commands(sub, _add_overrides)
    parser.commands = sub.choices
    return parser


def cmd_train(args) -> int:
    from toolkit.launch.rank import run_rank

    return run_rank(args.recipe, args.overrides, _resume_of(args))


def cmd_launch(args) -> int:
    from toolkit.launch.launcher import launch_recipe

    _check_nproc(args.nproc)
    if args.max_restarts < 0:
        raise RecipeError("--max-restarts must be >= 0")
    return launch_recipe(args.recipe, args.overrides, nproc=args.nproc, nodes=_nodes_of(args),
                         max_restarts=args.max_restarts, resume=_resume_of(args))


def _check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise RecipeError(f"--nproc {nproc}: give the number of ranks, 1 or more")


def _nodes_of(args):
    from toolkit.launch.launcher import Nodes

    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise RecipeError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: give nnodes >= 1 and a node rank "
                          "from 0 to nnodes-1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise RecipeError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, an address of the first machine that every "
                          "machine reaches (e.g. its hostname and a free port such as 29500)")
    if args.rdzv_endpoint:
        from toolkit.launch.launcher import check_endpoint

        check_endpoint(args.rdzv_endpoint, hosted_here=args.nnodes == 1)
    return Nodes(count=args.nnodes, rank=args.node_rank, endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                 local_addr=args.local_addr)


def cmd_validate(args) -> int:
    from toolkit.config.parallel import resolve
    from toolkit.strategies import layout_line
    from toolkit.train.checks import check_recipe
    from toolkit.model.build import load_tokenizer
    from toolkit.train.notes import dropout_note, recipe_notes
    from toolkit.config.files import dump_recipe, load_recipe

    _check_nproc(args.nproc)
    recipe = resolve(load_recipe(args.recipe, args.overrides), world_size=args.nproc)  # degrees -> preset
    quiet_libraries()  # the checks build the model on the meta device: transformers' and peft's deprecation notes
    plan = check_recipe(recipe, world_size=args.nproc)
    print(dump_recipe(recipe), end="")
    print(f"# ok: {plan.world_size} ranks × micro {plan.micro_batch_size} × accum {plan.grad_accum_steps} "
          f"= global batch {plan.global_batch_size}")
    print(f"# parallel: {layout_line(recipe, world_size=args.nproc)}")
    # what the run would say at start (those that need no tokenized data): a run of train.epochs counts its
    # steps once its data is tokenized, so its warm-up is checked by the run alone
    tokenizer = load_tokenizer(recipe.model)
    for note in [*recipe_notes(recipe, tokenizer, total_steps=recipe.train.max_steps, world_size=plan.world_size),
                 *filter(None, [dropout_note(recipe, tokenizer), _output_dir_note(Path(recipe.output_dir))])]:
        print(note, file=sys.stderr)
    return 0


def _output_dir_note(out_dir: Path) -> str | None:
    """validate: an output_dir no run can make is an error (as train's); one that holds a run, or that a live run
    writes, is a note saying what `toolkit train` will answer (a validate before a --resume is no mistake)."""
    from toolkit.checkpoint.store import check_creatable, check_not_in_a_run, check_output_dir
    from toolkit.process.folder_lock import FolderInUse, check_free, run_in_use

    check_creatable(out_dir)
    check_not_in_a_run(out_dir, what="output_dir", fix="write this run elsewhere with --set output_dir=OTHER")
    try:
        check_free(out_dir, message=run_in_use(out_dir))
        check_output_dir(out_dir, resume=False)
    except FolderInUse as exc:
        return f"[toolkit] note: {exc}"
    except RecipeError as exc:
        return f"[toolkit] note: {exc} (what toolkit train answers without --resume)"
    return None


def cmd_calibrate(args) -> int:
    from toolkit.plan.commands import calibrate

    _check_nproc(args.nproc)
    quiet_libraries()
    return calibrate(args)


def cmd_scale_plan(args) -> int:
    from toolkit.plan.commands import scale_plan

    quiet_libraries()
    return scale_plan(args)


def cmd_plan(args) -> int:
    if args.hardware is not None:
        # the ranks on a node, as toolkit launch --nproc reads it (and as the fixes in the plan's messages name it)
        if args.nproc is not None and args.gpus_per_node not in (None, args.nproc):
            raise RecipeError(f"--nproc {args.nproc} and --gpus-per-node {args.gpus_per_node} each give the GPUs "
                              "per node with --hardware: give one")
        if args.nproc is not None:
            _check_nproc(args.nproc)
            args.gpus_per_node = args.nproc
        return cmd_scale_plan(args)
    args.nproc = 2 if args.nproc is None else args.nproc
    for flag, given in (("--json", args.json), ("--layouts", args.layouts is not None), ("--nodes", args.nodes != 1),
                        ("--gpus-per-node", args.gpus_per_node is not None)):
        if given:
            raise RecipeError(f"{flag} goes with --hardware NAME (a cluster to predict step time on)")
    import torch

    from toolkit.plan import predict as plan
    from toolkit.plan import advice as plan_advice
    from toolkit.train.checks import check_recipe
    from toolkit.compare.experiment import arm_overrides
    from toolkit.config.arm_specs import split_arms
    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import preset_of_given, resolve
    from toolkit.strategies import strategy_degrees, strategy_info, validate_strategy
    from toolkit.strategies.pipeline.rules import stage_lines

    _check_nproc(args.nproc)
    arms = split_arms(args.strategies) if args.strategies is not None else [None]
    try:  # as compare takes them: a named arm, with per-arm overrides as name@key=value
        sets = {arm: arm_overrides(arm, common=args.overrides) if arm else () for arm in arms}
    except RecipeError as exc:
        raise RecipeError(f"--strategies: {exc}") from None
    given = plan.parse_bytes(args.memory_per_rank) if args.memory_per_rank is not None else None

    def memory_per_rank(world: int) -> tuple[int, str]:  # a one-process arm has the host to itself
        return (given, "--memory-per-rank") if given is not None else plan.default_memory_per_rank(world)
    quiet_libraries()
    base = load_recipe(args.recipe, args.overrides)
    skeletons: dict = {}  # one per model the arms ask for (`name@model.lora=...` changes it)

    def skeleton(recipe):
        key = repr(recipe.model)
        if key not in skeletons:
            skeletons[key] = plan.planned_model(recipe)
        return skeletons[key]
    model = skeleton(base)
    runtime = plan.run_base_bytes(base)  # this process with what a rank has loaded by its first step
    recipes = {arm: load_recipe(args.recipe, [*args.overrides, *sets[arm]]) for arm in arms}

    def runs_as(recipe) -> str:  # the strategy a recipe's parallel degrees choose at --nproc ranks, as launch's
        try:
            return resolve(recipe, world_size=args.nproc).strategy.name
        except RecipeError:  # check_recipe says why, on the arm's line, at --nproc ranks (one_process below)
            return preset_of_given(recipe) or recipe.strategy.name
    strategies = {arm: runs_as(r) for arm, r in recipes.items()}
    # and what a rank imports beyond them (DeepSpeed), measured before anything else here imports it
    extra = {arm: plan.runtime_module_bytes(strategy_info(strategies[arm]).runtime_modules) for arm in recipes}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    planned: list[plan_advice.Planned] = []
    changes: dict[str, str] = {}
    recipes_by_name = {}
    for arm, recipe in recipes.items():
        name = arm or strategies[arm]
        recipes_by_name[name] = recipe
        one_process = strategy_info(strategies[arm]).one_process and not recipe.parallel.given
        world = 1 if one_process else args.nproc
        try:
            check_recipe(recipe, world_size=world)
        except RecipeError as exc:
            if arm is None:  # the recipe's own strategy, no --strategies: a mistake in it, as validate says it
                raise
            planned.append(plan_advice.Planned(name, str(exc)))
            continue
        try:  # a recipe that runs but that the plan cannot predict (hf_native): its row says why
            prediction = plan.predict(recipe, world_size=world, runtime_bytes=runtime + extra[arm], device_type=device,
                                      model=skeleton(recipe))
        except RecipeError as exc:
            planned.append(plan_advice.Planned(name, str(exc)))
            continue
        planned.append(plan_advice.Planned(name, prediction, memory_per_rank(world)[0]))

        def predict_with(more: tuple[str, ...], world: int, arm=arm):
            changed = load_recipe(args.recipe, [*args.overrides, *sets[arm], *more])
            validate_strategy(changed, world_size=world)  # an option the strategy does not take: refused
            return plan.predict(changed, world_size=world, runtime_bytes=runtime + extra[arm], device_type=device,
                                model=skeleton(changed), both=False)
        if not plan_advice.fits(planned[-1]):
            change = plan_advice.one_change(planned[-1], predict=predict_with, one_process=one_process,
                                            limit_at=lambda world: memory_per_rank(world)[0], batch=recipe.batch)
            if change is not None:
                changes[name] = change
    print(plan.render([(p.arm, p.prediction) for p in planned], memory_per_rank=memory_per_rank))
    for p in planned:  # a pipeline's stages: the table shows their memory, this their compute
        if isinstance(p.prediction, str):
            continue
        chosen, world = recipes_by_name[p.arm], p.prediction.world_size
        if strategy_degrees(chosen, world_size=world).pp > 1:
            lines = stage_lines(skeleton(chosen), chosen, world_size=world)
            print("\n".join([f"{p.arm} {lines[0]}", *lines[1:]]))
    if all(isinstance(p.prediction, str) for p in planned):
        return 1  # a script that plans before it launches stops here: no arm can run, so no launch of one can either
    print("\n".join(plan_advice.summary(planned, changes, num_params=sum(p.numel() for p in model.parameters()))))
    return 0 if any(plan_advice.fits(p) for p in planned) else 1  # nothing fits: no launch as asked would either


def cmd_strategies(args) -> int:
    from toolkit.config.files import override_value
    from toolkit.config.parallel import presets
    from toolkit.config.recipe import CP_METHODS
    from toolkit.config.strategy_options import StrategyConfig
    from toolkit.strategies import arm_aliases, strategy_info, strategy_names

    defaults = StrategyConfig()
    width = max(map(len, strategy_names()))
    for name in strategy_names():
        info = strategy_info(name)
        print(f"{name:<{width}}  {info.summary}")
        if info.options:  # each with its default (see the StrategyConfig comments in toolkit/config/recipe.py)
            shown = ", ".join(f"strategy.{key}={override_value(getattr(defaults, key))}" for key in info.options)
            print(f"{'':<{width}}  options: {shown}")
    print("\ncompare arms (toolkit compare --strategies a,b,...; add overrides as arm@key=value):")
    aliases = arm_aliases()
    for alias, overrides in aliases.items():
        print(f"  {alias:<{max(map(len, aliases))}} {' '.join(overrides)}")
    print(f"\ncontext parallel methods (parallel.cp_method): {', '.join(CP_METHODS)}")
    print("\nparallel degrees (a recipe's parallel: section; world = their product) and the preset that runs them:")
    rows = [(" × ".join(combination) or "(none)", name, options) for combination, name, options in presets()]
    width = max(24, *(len(degrees) for degrees, _, _ in rows))
    for degrees, name, options in rows:
        print(f"  {degrees:<{width}} {name}" + (f" ({', '.join(options)})" if options else ""))
    print(f"  {'ep (borrows from dp_shard)':<{width}} fsdp (strategy.ep_degree): each MoE layer's experts split over "
          "ep ranks, tokens by all-to-all; tested with dp_shard alone")
    return 0


def cmd_convert(args) -> int:
    from toolkit.checkpoint.convert import ConvertWriteError, Stopped, convert
    quiet_libraries()
    try:
        out = convert(Path(args.checkpoint), Path(args.out))
    except ConvertWriteError as exc:
        print(f"toolkit: {exc}", file=sys.stderr, flush=True)
        return 1
    except Stopped as stop:
        print(f"toolkit: stopped by {stop}; {args.out} was not written", file=sys.stderr, flush=True)
        return 128 + stop.signum
    print(f"[toolkit] wrote {out} (load it with from_pretrained)", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "launch": cmd_launch, "validate": cmd_validate, "strategies": cmd_strategies,
            "convert": cmd_convert, "plan": cmd_plan, "calibrate": cmd_calibrate}


def run() -> None:
    """The `toolkit` command (and `python -m toolkit`): main(), then the process ends without tearing its
    interpreter down. With torch and transformers loaded the teardown takes ~1.1 s (measured: 1.06-1.16 s
    from the last line to the exit, 0.05 s without), paid by the launcher and by every rank of a run, and
    it does nothing a run needs: the toolkit writes and closes its files before it returns, and the exit
    handlers (logging's flush, temporary folders' cleanup, finalizers) still run. Where a Python thread is
    still running, the normal exit waits for it as always."""
    code = main()
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    from toolkit.errors import ctrl_c_seen, note_ctrl_c

    note_ctrl_c()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C outside a rank's training (there: cmd_train, and the loop's stop signal)
        return interrupted()
    except Exception:
        if ctrl_c_seen():  # a Ctrl-C that a library's import turned into another error
            return interrupted()
        raise


def _main(argv: list[str] | None) -> int:
    outlive_reader()  # a console whose reader left (`| head`, a closed session) does not end the run
    args = build_parser().parse_args(argv)
    from toolkit.compare.cli import COMPARE_COMMANDS
    from toolkit.launch.launcher import prepare_environment

    prepare_environment()  # before any library import that reads it (DeepSpeed's accelerator, the hubs)

    handler = {**COMMANDS, **COMPARE_COMMANDS}[args.command]
    try:
        return handler(args) or 0
    except RecipeError as exc:
        say_user_error(exc)  # every rank of a launch finds the same mistake: one line
        return USER_ERROR_EXIT_CODE
    except OSError as exc:  # a full disk where no step of the command says it in its own words: one line, exit 1
        if exc.errno not in NO_ROOM:
            raise
        print(no_room_line(exc), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    run()
