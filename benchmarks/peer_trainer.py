"""The toolkit against the tool a user would pick instead: the same job as `toolkit train` (single process)
and through transformers' `Trainer`, alternating, each a process of its own started as its user starts it:
`python -m toolkit train RECIPE --set ...` with the environment this script was given (the toolkit's own
settings are what the command makes of it), and a plain Trainer script (this file, `--trainer-side`) with that
same environment. Same model, data file, max_length, batch (micro 16 × accum 2 = 32), AdamW (Trainer's default
fused one; the toolkit's optim.implementation auto), warm-up + cosine schedule (the warm-up's lrs differ:
(k+1)/(w+1) of lr here, k/w in Trainer; the same work), clipping at 1.0, no eval.

    python benchmarks/peer_trainer.py [--recipe recipes/minilm-sst.yaml] [--steps 40] [--rounds 3]

Prints samples/s per round (median over the steps after warm-up: the toolkit's from its metrics.jsonl, the
Trainer's from a callback around each step) and the toolkit/Trainer ratio. Target: the toolkit at or above
1.05× the Trainer on the default job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from toolkit.compare.measure import warmup_steps  # noqa: E402
from toolkit.observe.metrics import read_jsonl  # noqa: E402

NO_EVAL = ["train.eval_every=null", "data.eval=null", "train.progress=false"]


def toolkit_round(recipe_path: str, *, steps: int, out: Path) -> float:
    """`toolkit train` as a user runs it; its samples/s from metrics.jsonl."""
    sets = [f"train.max_steps={steps}", *NO_EVAL, "checkpoint.final=false", f"output_dir={out}"]
    run([sys.executable, "-m", "toolkit", "train", recipe_path, *(a for s in sets for a in ("--set", s))], "toolkit")
    metrics = read_jsonl(out / "metrics.jsonl")
    return statistics.median(m["samples_per_s"] for m in metrics[warmup_steps(len(metrics)):])


def trainer_round(recipe_path: str, *, steps: int, out: Path) -> float:
    """The Trainer script below in a process of its own; the samples/s it writes."""
    out.mkdir(parents=True)
    run([sys.executable, __file__, "--trainer-side", str(out), "--recipe", recipe_path, "--steps", str(steps)],
        "Trainer")
    return float((out / "samples_per_s").read_text())


def run(cmd: list[str], label: str) -> None:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{label} failed (exit {result.returncode}): {' '.join(cmd)}\n{result.stderr[-3000:]}")


def trainer_side(recipe_path: str, *, steps: int, out: Path) -> None:
    """What a Trainer user writes for the recipe's job (the recipe only supplies the numbers)."""
    import datasets
    import transformers

    from toolkit.model.build import load_tokenizer, resolve_path
    from toolkit.config.recipe import plan_batch
    from toolkit.config.files import load_recipe

    transformers.logging.set_verbosity_error()
    recipe = load_recipe(recipe_path)
    tokenizer = load_tokenizer(recipe.model)
    data = datasets.load_dataset("json", data_files=recipe.data.train, split="train")
    text, label = recipe.data.text_column, recipe.data.label_column
    data = data.map(lambda b: {**tokenizer(b[text], truncation=True, max_length=recipe.data.max_length),
                               "labels": b[label]}, batched=True, remove_columns=data.column_names)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(resolve_path(recipe.model.path)), num_labels=recipe.model.num_labels)
    times: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    plan, optim = plan_batch(recipe.batch, world_size=1), recipe.optim
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum_steps, max_steps=steps,
        learning_rate=optim.lr, weight_decay=optim.weight_decay, warmup_steps=optim.warmup_steps,
        lr_scheduler_type=optim.schedule, max_grad_norm=optim.max_grad_norm, save_strategy="no", report_to=[],
        logging_steps=10 ** 6, use_cpu=True, dataloader_num_workers=0, seed=recipe.seed, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimes()],
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    steady = times[warmup_steps(len(times)):]
    (out / "samples_per_s").write_text(str(plan.global_batch_size / statistics.median(steady)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/minilm-sst.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trainer-side", metavar="OUT", help=argparse.SUPPRESS)  # the Trainer's own process
    args = parser.parse_args()
    if args.trainer_side:
        trainer_side(args.recipe, steps=args.steps, out=Path(args.trainer_side))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            # alternate which goes first, so neither always runs on a warmer machine
            order = [("toolkit", toolkit_round), ("trainer", trainer_round)]
            if index % 2:
                order.reverse()
            result = {}
            for name, side in order:
                result[name] = side(args.recipe, steps=args.steps, out=Path(tmp) / f"{name}-{index}")
                print(f"[peer] round {index + 1} {name}: {result[name]:.1f} samples/s", file=sys.stderr, flush=True)
            rows.append(result)
    print(f"\n{'round':<7}{'toolkit samples/s':>19}{'Trainer samples/s':>19}{'ratio':>8}")
    for index, r in enumerate(rows, start=1):
        print(f"{index:<7}{r['toolkit']:>19.1f}{r['trainer']:>19.1f}{r['toolkit'] / r['trainer']:>8.2f}")
    toolkit = statistics.median(r["toolkit"] for r in rows)
    trainer = statistics.median(r["trainer"] for r in rows)
    print(f"{'median':<7}{toolkit:>19.1f}{trainer:>19.1f}{toolkit / trainer:>8.2f}   (target ≥ 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
