"""The toolkit against the tool a user would pick instead: the same job through `toolkit train` (single
process) and through transformers' `Trainer`, alternating in one process, so both see the same machine
state. Same model, data file, max_length, batch (micro 16 × accum 2 = 32), AdamW (Trainer's default
fused one; the toolkit's optim.implementation auto), warm-up + cosine schedule (the warm-up's lrs differ:
(k+1)/(w+1) of lr here, k/w in Trainer; the same work), clipping at 1.0, no eval.

    python benchmarks/peer_trainer.py [--recipe recipes/minilm-sst.yaml] [--steps 40] [--rounds 3]

Prints samples/s per round (median over steps after warm-up) and the toolkit/Trainer ratio. Target:
the toolkit at or above 1.05× the Trainer on the default job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from toolkit.compare.measure import warmup_steps  # noqa: E402
from toolkit.recipe import plan_batch  # noqa: E402
from toolkit.recipe_files import load_recipe  # noqa: E402


def toolkit_round(recipe_path: str, *, steps: int, out: Path) -> float:
    from toolkit.dist import DistEnv
    from toolkit.loop import train
    from toolkit.metrics import read_jsonl

    import torch

    recipe = load_recipe(recipe_path, [f"train.max_steps={steps}", "train.eval_every=null", "data.eval=null",
                                       "train.progress=false", f"output_dir={out}"])
    train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    metrics = read_jsonl(out / "metrics.jsonl")
    return statistics.median(m["samples_per_s"] for m in metrics[warmup_steps(len(metrics)):])


def trainer_round(recipe_path: str, *, steps: int, out: Path) -> float:
    import datasets
    import transformers

    from toolkit.model import load_tokenizer, resolve_path

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
    return plan.global_batch_size / statistics.median(steady)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/minilm-sst.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            # alternate which goes first, so neither always runs on a warmer machine
            order = [("toolkit", toolkit_round), ("trainer", trainer_round)]
            if index % 2:
                order.reverse()
            result = {}
            for name, run in order:
                result[name] = run(args.recipe, steps=args.steps, out=Path(tmp) / f"{name}-{index}")
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
