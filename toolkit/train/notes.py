"""What a recipe that runs may not do as its author meant: one line each, said by `train` once the run goes ahead
and by `validate` before it (a note, never a refusal: the run is still what the recipe asks for)."""

from __future__ import annotations

from toolkit.config.recipe import EVAL_EVERY_DEFAULT, Recipe


def warmup_note(warmup_steps: int, total_steps: int) -> str:
    """Optimizer step k of a warm-up of w steps runs at (k+1)/(w+1) of optim.lr (toolkit.strategies.optim.adamw.lr_factor): a
    warm-up as long as the run never reaches optim.lr nor follows optim.schedule."""
    return (f"[toolkit] optim.warmup_steps {warmup_steps} is not below the run's {total_steps} optimizer steps: "
            f"the lr ends at {total_steps / (warmup_steps + 1):.0%} of optim.lr and never follows optim.schedule")


def recipe_notes(recipe: Recipe, tokenizer, *, total_steps: int | None, world_size: int) -> list[str]:
    """The notes on `recipe` at `world_size` ranks that need no tokenized data; `total_steps` None where it is not
    known yet (a run of train.epochs, before the data is read), which leaves the warm-up unchecked."""
    notes = []
    if zero := lone_zero_note(recipe, world_size):
        notes.append(zero)
    if recipe.data.eval is None and recipe.train.eval_every not in (None, EVAL_EVERY_DEFAULT):
        # said, not refused: a recipe's eval_every stays when a run drops its eval data (--set data.eval=null)
        notes.append(f"[toolkit] train.eval_every {recipe.train.eval_every} is ignored: data.eval is null, so "
                     "nothing is evaluated; give data.eval a file to evaluate")
    if total_steps is not None and recipe.optim.warmup_steps >= total_steps:  # a smoke run on a recipe's warm-up
        notes.append(warmup_note(recipe.optim.warmup_steps, total_steps))
    if tokenizer.pad_token_id is None:
        key = "model.tokenizer" if recipe.model.tokenizer else "model.path"
        notes.append(f"[toolkit] {key}: the tokenizer has no pad, eos or unk token; batches are padded with id 0 "
                     "(masked out of attention and the loss)")
    lora = recipe.model.lora
    if lora is not None and recipe.model.path is None and not lora.merge_on_export:
        notes.append("[toolkit] model.lora on a model built from model.config: its base weights are saved "
                     "nowhere, so output_dir/model (the adapter alone) loads onto no base; "
                     "model.lora.merge_on_export=true writes a usable model, as `toolkit convert` does from a checkpoint")
    return notes


def lone_zero_note(recipe: Recipe, world_size: int) -> str | None:
    """ZeRO on one rank without offload shards nothing and keeps what single keeps, yet pays DeepSpeed's
    per-parameter hooks: stage 3 ran a 1B Llama's step in 584 ms on one H200 against single's 195
    (docs/benchmarks.md), before stage 3 on one rank gathered a block at a time (zero/order.py's
    block_units: 0.28× single -> 0.49× on this CPU; the GPU not re-measured). Said, not refused: the same
    recipe at more ranks, or a comparison, is what it is for."""
    s = recipe.strategy
    stage = 2 if s.stage is None else s.stage
    if s.name != "zero" or world_size != 1 or stage == 0 or s.offload_optimizer or s.offload_param or s.ds_config:
        return None
    return (f"[toolkit] zero stage {stage} on one rank shards nothing: it holds what single holds and pays "
            "DeepSpeed's hooks (stage 3 ran 3.0× single's step on one H200 with a hook per module, 2.1× on a CPU "
            "gathering a block at a time, docs/benchmarks.md); "
            "strategy.name=single runs the same job, strategy.offload_optimizer=true fits a larger model")


def dropout_note(recipe: Recipe, tokenizer) -> str | None:
    """validate's note where the run drops out: its losses depend on how each global batch is split (the README's
    claim that 1 rank × accum 4 and 2 ranks × accum 2 log the same numbers holds with dropout off)."""
    from toolkit.model.build import hf_config

    if recipe.model.dropout is not None:
        rate, whose = recipe.model.dropout, "model.dropout"
    else:
        rates = [v for k, v in hf_config(recipe.model, tokenizer=tokenizer).to_dict().items()
                 if k.endswith(("dropout", "dropout_prob")) and isinstance(v, (int, float)) and not isinstance(v, bool)]
        rate, whose = max(rates, default=0.0), "the model's own; model.dropout null keeps it"
    if not rate:
        return None
    return (f"[toolkit] dropout {rate:g} ({whose}): a dropout mask depends on how each global batch is split over "
            "ranks and micro-batches, so this recipe at other ranks × accum (1 × 4, 2 × 2) logs other losses; "
            "model.dropout: 0.0 makes them log the same numbers (as `toolkit compare` sets)")
