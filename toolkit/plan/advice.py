"""What `toolkit plan` says under its table: which arms fit as asked, and which would with one change (selective,
then full activation checkpointing, a smaller micro-batch with the global batch kept, offload, twice the ranks), each
change predicted like the arm itself, not inferred from a column."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from toolkit.config.recipe import BatchConfig
from toolkit.errors import RecipeError
from toolkit.plan.predict import Prediction

# one change at a time, by what it trades; a strategy that does not take an option refuses it (check_recipe)
# (selective checkpointing first: it recomputes less than full does, for more memory)
CHANGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train.activation_checkpointing=selective", ("train.activation_checkpointing=selective",)),
    ("train.activation_checkpointing=true", ("train.activation_checkpointing=true",)),
    ("strategy.cpu_offload=true", ("strategy.cpu_offload=true",)),
    ("strategy.offload_optimizer=true", ("strategy.offload_optimizer=true",)),
    ("strategy.offload_optimizer=true, strategy.offload_param=true",
     ("strategy.offload_optimizer=true", "strategy.offload_param=true")),
)


@dataclass(frozen=True)
class Planned:
    """One arm: its prediction at its world size, or why it cannot run."""
    arm: str
    prediction: Prediction | str
    limit_bytes: int = 0  # the memory per rank it is judged against


def fits(planned: Planned) -> bool:
    """Every rank's peak within the arm's memory per rank."""
    return not isinstance(planned.prediction, str) and planned.prediction.peak_bytes <= planned.limit_bytes


def one_change(planned: Planned, *, predict: Callable[[tuple[str, ...], int], Prediction],
               one_process: bool, limit_at: Callable[[int], int] | None = None,
               batch: BatchConfig | None = None) -> str | None:
    """The first change under which an arm that runs but does not fit would: `predict(extra overrides, world)`
    raises RecipeError for a change the arm's strategy refuses; `limit_at(world)`: the memory per rank at another
    world size (on CPU the host's ÷ the ranks; default: the arm's own limit); `batch`: the arm's, whose micro-batch
    is tried halved, accumulation keeping the global batch (where activations dominate, the change that fits)."""
    if isinstance(planned.prediction, str):
        return None
    world = planned.prediction.world_size
    for label, overrides in [*CHANGES[:2], *_smaller_micro_batches(batch), *CHANGES[2:]]:
        try:
            if predict(overrides, world).peak_bytes <= planned.limit_bytes:
                return label
        except RecipeError:  # not an option of this strategy, or already set
            continue
    if not one_process:
        try:
            limit = limit_at(2 * world) if limit_at is not None else planned.limit_bytes
            if predict((), 2 * world).peak_bytes <= limit:
                return f"{2 * world} ranks"
        except RecipeError:
            pass
    return None


def _smaller_micro_batches(batch: BatchConfig | None) -> list[tuple[str, tuple[str, ...]]]:
    """batch.micro_batch_size halved, then halved again (to 1), each with the accumulation that keeps the global
    batch: the same samples per optimizer step, the same maths up to summation order."""
    if batch is None:
        return []
    micro = batch.micro_batch_size
    changes: list[tuple[str, tuple[str, ...]]] = []
    smaller = micro // 2
    while smaller >= 1:
        if micro % smaller == 0:
            accum = "null" if batch.global_batch_size is not None else \
                str((batch.grad_accum_steps or 1) * (micro // smaller))
            overrides = (f"batch.micro_batch_size={smaller}", f"batch.grad_accum_steps={accum}")
            # each override the prediction made, as the user sets it: an accumulation the recipe leaves null already
            # follows its global batch
            said = overrides[:1] if accum == "null" and batch.grad_accum_steps is None else overrides
            changes.append((f"{', '.join(said)} (the same global batch)", overrides))
        smaller //= 2
    return changes


def summary(planned: list[Planned], changes: dict[str, str], *, num_params: int) -> list[str]:
    """The lines under the table: the model's size, what fits as asked, what would with one change."""
    fitting = [p.arm for p in planned if fits(p)]
    size = f"{num_params / 1e9:,.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:,.1f}M"
    lines = [f"model: {size} parameters"]
    lines.append(f"fits as asked: {', '.join(fitting)}" if fitting else "fits as asked: none")
    if changes:
        lines.append("fits with one change:")
        lines += [f"  {arm} with {how}" for arm, how in changes.items()]
    elif not fitting:
        lines.append("fits with one change: none (activation checkpointing, smaller micro-batches, offload, twice the "
                     "ranks were tried);")
        lines.append("  more memory per rank, LoRA (model.lora) or a smaller model would be needed")
    return lines
