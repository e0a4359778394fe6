"""Memory per rank before a run: model states exactly, activations and the peak as estimates.

Model states (parameters, gradients, optimizer state) come from the model built on the meta device and the
strategy's own rules (`StrategyRules.predict_state_bytes`): a run measures the same bytes (run.json's
`model_state_bytes`; every run also writes this prediction beside them).

Activations are traced, not guessed (toolkit/memory/activations.py): one micro-batch's forward, loss and backward on
fake tensors, in the dtypes the strategy computes in, with and without activation checkpointing; their peak
(T = micro_batch_size × max_length tokens) beside the model states; a pipeline rank traces its own stages and
holds as many micro-batches as its schedule keeps in flight (`StrategyRules.predict_activation_bytes`,
toolkit/strategies/pipeline/memory.py); a tensor-parallel rank (tp, fsdp's tp_degree) traces the model with
its share of heads and MLP columns (`memory.tp_rank.local_model`). Gradients are model states, but a
strategy that gives them back between steps (`StrategyInfo.holds_gradients` false) has none while a step's
first micro-batch holds its activations: with one micro-batch per step its training peak is the larger of
(parameters + optimizer state + activations), (all model states at the end of backward, with a tied
embedding's gradients being summed: `tied_gradients_beyond_states`, from `StrategyInfo.tied_gradients`; under
ZeRO-1 every gradient, not yet reduced: `StrategyInfo.whole_gradients_in_backward`) and (all model states at the
end of backward and in the optimizer step, once the activations are gone, with what each rank copies there:
ZeRO's float64 norm pieces, its flat gradient partition, ZeRO-3's largest gradient being reduced:
`StrategyRules.predict_step_bytes`, per rank).
The peak adds what is not model state: the runtime (the Python process with torch and transformers loaded: measured
here), the parameters a rank gathers from the others (`StrategyRules.predict_gathered_bytes`, per rank: one block under
FSDP2, under ZeRO-3 what DeepSpeed's reuse distance keeps, a pipeline's fsdp replica its own stages), and on CPU two
peaks of their own: loading, where a strategy copies the weights it built into its own tensors
(`StrategyRules.predict_load_bytes`; none where the built tensors are its parameters, only its part under low-memory
loading), and the export, for which rank 0 gathers or copies the whole model. Not counted: what the process itself grows
by once training runs (code pages, the allocator's small blocks: measured 50-330 MiB on CPU over 3 steps, more for a
larger model).
"""

from __future__ import annotations

import functools
import re
from typing import Callable
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from toolkit.config.parallel import resolve
from toolkit.config.recipe import Recipe, plan_batch
from toolkit.errors import RecipeError
from toolkit.memory.state_bytes import StateBytes, element_bytes
from toolkit.model.build import meta_model
from toolkit.model.precision import DTYPES
from toolkit.strategies import strategy_degrees, strategy_rules
from toolkit.strategies.base import StrategyInfo

MiB = 2 ** 20
GiB = 2 ** 30
UNITS = {"b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
         "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


@dataclass(frozen=True, kw_only=True)
class Prediction:
    strategy: str
    world_size: int
    per_rank: list[StateBytes]
    activation_bytes: list[int]  # per rank, this recipe's activation checkpointing setting
    activation_bytes_checkpointed: list[int] | None  # the same with activation checkpointing (None: not traced)
    load_bytes: int  # the whole model in its load dtype
    built_bytes: list[int]  # per rank, the weights it builds beyond its model states (0 where they are its
    # parameters, or under low-memory loading)
    runtime_bytes: int  # the process itself (interpreter, torch, transformers), before any model
    peak_bytes_per_rank: list[int]
    # per rank, the peak by the end of setup (before the first step): its build beside the parameters it keeps
    # (run.json's peak_memory setup_peak_bytes measures it)
    setup_peak_bytes_per_rank: list[int] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The largest rank's estimate."""
        return max(self.peak_bytes_per_rank)

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "world_size": self.world_size,
                "model_state_bytes": [r.as_dict() for r in self.per_rank],
                "activation_bytes": self.activation_bytes,
                "activation_bytes_checkpointed": self.activation_bytes_checkpointed,
                "load_bytes": self.load_bytes, "built_bytes": self.built_bytes, "runtime_bytes": self.runtime_bytes,
                "peak_bytes": self.peak_bytes, "peak_bytes_per_rank": self.peak_bytes_per_rank,
                "setup_peak_bytes_per_rank": self.setup_peak_bytes_per_rank}


def predict(recipe: Recipe, *, world_size: int, runtime_bytes: int, device_type: str = "cpu",
            model: nn.Module | None = None, both: bool = True, resuming: bool = False) -> Prediction:
    """The recipe's memory per rank at `world_size`; `model`: the recipe's model on the meta device, if built.
    On a GPU the peak is the allocator's (no runtime, no host-side load); on CPU the process's resident set.
    both=False: activations traced for the recipe's own activation checkpointing setting only (a run's record).
    From the strategy's rules (its module's RULES): no strategy object is made. `resuming`: the weights come from
    a checkpoint (StrategyRules.predict_load_bytes)."""

    recipe = resolve(recipe, world_size=world_size)  # parallel degrees -> their preset
    model = model if model is not None else planned_model(recipe)
    rules = strategy_rules(recipe)
    info = rules.info(recipe)
    per_rank = rules.predict_state_bytes(model, recipe, world_size=world_size)
    built = rules.predict_load_bytes(model, recipe, world_size=world_size, resuming=resuming)
    load = sum(p.numel() for p in model.parameters()) * element_bytes(DTYPES[recipe.model.load_dtype])
    params_dtype, autocast_dtype = trace_dtypes(recipe, info)
    how = {"params_dtype": params_dtype, "autocast_dtype": autocast_dtype}
    checkpointing = recipe.train.activation_checkpointing  # False, True (full) or "selective"
    trace = functools.partial(rules.predict_activation_bytes, model, recipe, world_size=world_size)
    activations = trace(how={**how, "checkpointing": checkpointing})
    # the table's (AC) column: under full checkpointing, whatever the recipe's own setting
    checkpointed = activations if checkpointing is True else trace(how={**how, "checkpointing": True}) if both \
        else None
    gathered = rules.predict_gathered_bytes(model, recipe, world_size=world_size)
    steps = rules.predict_step_bytes(model, recipe, world_size=world_size, device_type=device_type)
    shards = rules.data_layout(recipe, world_size=world_size, rank=0).size
    accumulates = plan_batch(recipe.batch, world_size=shards).grad_accum_steps > 1

    # a strategy that keeps autograd's gradients (2) already holds one from a step's second micro-batch on:
    # the sum is then a tensor of its own, added into it (3)
    copies = 3 if accumulates and info.tied_gradients == 2 else info.tied_gradients
    # in the gradients' dtype: the parameters' a rank computes with
    tied = tied_gradients_beyond_states(tied_gradient_bytes(model, params_dtype), copies,
                                        vocabulary_share=vocabulary_share(recipe, world_size=world_size))
    # ZeRO-1: every gradient, unreduced, until backward ends (its model states count its partition's)
    unreduced = sum(p.numel() for p in model.parameters() if p.requires_grad) * \
        element_bytes(params_dtype) if info.whole_gradients_in_backward else 0

    def training(state: StateBytes, activations: int, step: int) -> int:
        """Model states and the rank's activations at their peak (gradients there only if held), the end of
        backward (all model states, and a tied weight's gradients being summed: StrategyInfo.tied_gradients), or
        the end of backward and the optimizer step (all model states, and what the rank copies there:
        StrategyRules.predict_step_bytes)."""
        held = state.total_bytes if info.holds_gradients or accumulates else \
            state.total_bytes - state.grads_bytes
        end_of_backward = state.total_bytes - state.grads_bytes + max(state.grads_bytes, unreduced) + tied
        return max(held + activations, end_of_backward, state.total_bytes + step)

    # On CPU a rank builds its weights in host memory before setup. A strategy that keeps the tensors it built
    # as its parameters (single, dp, ddp) adds nothing (`built` 0); one that copies them into its own (FSDP's
    # shards, ZeRO's flat buffers, TP's slices, a pipeline's stages) holds the build beside them until setup
    # drops it, and with train.host_memory predictable glibc gives freed pages back (toolkit/process/host_memory.py): the build
    # is a loading peak of its own, not part of training's. Under low-memory loading a rank builds no more than
    # its own part. Rank 0 also exports: the whole model gathered or copied to write it, except where its
    # parameters are the weights it built (the export reads them). A GPU sees only what is moved to it.
    setup = [b + r.params_bytes + (0 if device_type == "cuda" else runtime_bytes) for r, b in zip(per_rank, built)]
    if device_type == "cuda":
        peaks = [training(r, a, s) + g for r, a, s, g in zip(per_rank, activations, steps, gathered)]
    else:
        peaks = [runtime_bytes + max(training(r, a, s) + g, b + r.params_bytes)
                 for r, a, s, g, b in zip(per_rank, activations, steps, gathered, built)]
        if not info.exports_in_place:  # at the end: gradients only if held
            kept = per_rank[0].total_bytes - (0 if info.holds_gradients else per_rank[0].grads_bytes)
            peaks[0] = max(peaks[0], runtime_bytes + kept + load)
    return Prediction(strategy=recipe.strategy.name, world_size=world_size, per_rank=per_rank,
                      activation_bytes=activations, activation_bytes_checkpointed=checkpointed, load_bytes=load,
                      built_bytes=built, runtime_bytes=runtime_bytes, peak_bytes_per_rank=peaks,
                      setup_peak_bytes_per_rank=setup)


def run_base_bytes(recipe: Recipe) -> int:
    """This process's resident set once it holds what every rank has imported by its first step, whatever its
    strategy: the base a memory prediction starts from. Imported first: the model class's code
    (transformers' modeling modules and what they pull in: torch._dynamo, scipy; ~128 MiB here) and the data
    reader's (datasets with pyarrow and pandas, ~120 MiB): a single process imported the model's code only when it
    built the model (its peak came out ~85 MiB over its prediction), and toolkit plan, which reads no data, planned
    each rank ~84 MiB under what it measured."""
    import datasets  # noqa: F401  (imported for its resident set)

    from toolkit.model.build import hf_config
    from toolkit.model.config import auto_class
    from toolkit.observe.metrics import process_bytes

    mapping = getattr(auto_class(recipe.model), "_model_mapping", None)  # as check_architecture reads it
    if mapping is not None:
        mapping[type(hf_config(recipe.model))]  # the lazy mapping imports the class
    return process_bytes()


_IMPORTED_BYTES: dict[str, int] = {}


def runtime_module_bytes(modules: tuple[str, ...]) -> int:
    """What importing a strategy's runtime modules (StrategyInfo.runtime_modules) adds to this process's resident
    set, measured at their first import here: a rank imports them before it measures its runtime (toolkit.train.loop),
    so a plan made in a process without them adds this to its own runtime."""
    from toolkit.observe.metrics import process_bytes
    from toolkit.strategies.base import import_runtime_module

    for name in modules:
        if name not in _IMPORTED_BYTES:
            before = process_bytes()
            import_runtime_module(name)
            _IMPORTED_BYTES[name] = max(0, process_bytes() - before)
    return sum(_IMPORTED_BYTES[name] for name in modules)


def tied_gradient_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Gradient bytes of the trainable weights a forward uses twice (a tied embedding and head): one gradient
    of each.

    Autograd sums the gradients a weight gets from its uses before accumulating them, out of place (seen under a
    dispatch mode: `aten.add`, not `add_`, fp32 and bf16 autocast alike): at the end of backward the head's
    gradient, the embedding's dense vocab × hidden one and their sum exist at once, beside every other gradient
    (measured on CPU, 76M Llama with a 30522 × 1024 embedding: single +2 × 119 MiB over the same model untied, the
    sum being its gradient; ddp +3 × 119, copying the sum into its bucket)."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return sum(p.numel() for p in model.parameters() if uses[id(p)] > 1 and p.requires_grad) * element_bytes(dtype)


def vocabulary_share(recipe: Recipe, *, world_size: int) -> int:
    """Over how many ranks strategy.loss_parallel splits the vocabulary (its TP degree); 1 without it."""
    if not recipe.strategy.loss_parallel:
        return 1
    return strategy_degrees(recipe, world_size=world_size).tp


def tied_gradients_beyond_states(whole: int, copies: int, *, vocabulary_share: int = 1) -> int:
    """What a tied weight's gradients hold beyond the model states at the end of backward (`whole`: one gradient
    of it, tied_gradient_bytes; `copies`: StrategyInfo.tied_gradients). Where loss_parallel splits the vocabulary
    over `vocabulary_share` ranks, the head's gradient, the embedding's and their sum are a rank's rows, but
    DTensor first computes the row-wise embedding's gradient whole (embedding_dense_backward over every row), then
    copies its rows out, the whole alive until the sum: one whole gradient more than the copies, each a share
    (measured on the tied model over torch's fake process group, tests/test_loss_parallel.py: tp 2 and 4 hold
    2 and 1.5 gradients beyond the state's share, fsdp x tp 2.5 and 1.75; tp 4 on a micro-batch after the first,
    its 3 copies, 1.75)."""
    if vocabulary_share == 1 or copies == 0:
        return whole * copies
    return whole + copies * whole // vocabulary_share


def trace_dtypes(recipe: Recipe, info: StrategyInfo) -> tuple[torch.dtype, torch.dtype | None]:
    """(params_dtype, autocast_dtype) a rank computes in, as the activation trace takes them: its parameters' (the
    strategy's cast, else the load dtype; its gradients' too) and autocast's (None where the parameters already are
    in the precision's)."""
    stored, compute = DTYPES[recipe.model.load_dtype], DTYPES[recipe.precision]
    casts = info.casts_parameters
    return (compute if casts else stored), (None if casts or compute == stored else compute)


def planned_model(recipe: Recipe) -> nn.Module:
    """The recipe's model on the meta device, with its LoRA adapters when it has them."""
    model = meta_model(recipe.model)
    if recipe.model.lora is not None:
        from toolkit.model.lora import apply_lora

        with torch.device("meta"):  # the adapters too: peft would allocate them on the CPU
            apply_lora(model, recipe.model.lora, task=recipe.model.task)
    return model


def parse_bytes(text: str) -> int:
    """'40GiB', '80 GB', '512MiB', '1e9B' -> bytes. The unit is required, and the size at least 1 MiB (less holds
    no model): a bare `40`, read as 40 bytes, would say that nothing fits. A RecipeError naming the form otherwise."""
    match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match and unit in ("k", "m", "g", "t"):  # 2**30 or 10**9: 7 % apart, so the fit may differ
        number, letter = match.group(1), match.group(2).upper()
        raise RecipeError(f"--memory-per-rank: {text.strip()} is ambiguous: write {number}{letter}iB or "
                          f"{number}{letter}B")
    size_bytes = float(match.group(1)) * UNITS[unit] if match and unit in UNITS else 0.0
    if not MiB <= size_bytes < float("inf"):
        raise RecipeError(f"--memory-per-rank: {text!r} is not a size of 1 MiB or more with its unit; write it like "
                          "40GiB, 80GB or 512MiB")
    return int(size_bytes)


def default_memory_per_rank(nproc: int) -> tuple[int, str]:
    """(bytes, what they are): a GPU's memory, or on CPU the host's memory shared by `nproc` ranks."""
    import os

    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name} memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(nproc, 1), f"host memory ÷ {nproc} rank(s)"


def _size(size: int) -> str:
    """A memory limit in the peak column's unit and rounding (MiB), so that a row's yes or NO reads true beside it:
    in GiB to one place, 1.04 GiB showed as 1.0 above a peak of 1041 MiB that fits."""
    return f"{size / MiB:.0f} MiB"


def _size_in_both(size: int) -> str:
    return _size(size) + (f" = {size / GiB:.1f} GiB" if size >= GiB else "")


def render(rows: list[tuple[str, Prediction | str]], *,
           memory_per_rank: Callable[[int], tuple[int, str]]) -> str:
    """The plan table: one line per arm (per rank where ranks differ); an arm that cannot run says why. Each arm
    is judged against `memory_per_rank(its world size)`: (bytes, what they are), host memory ÷ its own ranks on
    CPU (a one-process arm has the host to itself)."""
    worlds = sorted({p.world_size for _, p in rows if not isinstance(p, str)})
    limits = {world: memory_per_rank(world) for world in worlds}
    one = len({limit for limit, _ in limits.values()}) == 1  # the header states it (every arm failed: none)
    head = ["arm", "rank", "params MiB", "grads MiB", "optim MiB", "model states MiB", "activations MiB (AC)",
            "peak MiB", f"fits {_size(next(iter(limits.values()))[0])}" if one else "fits (MiB)" if limits else "fits"]
    lines: list[list[str]] = []
    refused: list[str] = []  # under the table: a reason would set its last column's width
    for arm, prediction in rows:
        if isinstance(prediction, str):
            lines.append([arm, "-", *["-"] * 6, "cannot run (below)"])
            refused.append(f"{arm} cannot run: {prediction}")
            continue
        limit = limits[prediction.world_size][0]
        checkpointed = prediction.activation_bytes_checkpointed or [0] * prediction.world_size
        columns = list(zip(prediction.per_rank, prediction.activation_bytes, checkpointed,
                           prediction.peak_bytes_per_rank))
        distinct = {(tuple(state.as_dict().values()), *rest) for state, *rest in columns}
        ranks = [(f"all {prediction.world_size}", columns[0])] if len(distinct) == 1 else \
            [(str(i), column) for i, column in enumerate(columns)]
        for label, (state, activations, with_ac, peak) in ranks:
            fits = "yes" if peak <= limit else "NO"
            lines.append([arm, label, f"{state.params_bytes / MiB:.1f}", f"{state.grads_bytes / MiB:.1f}",
                          f"{state.optim_bytes / MiB:.1f}", f"{state.total_bytes / MiB:.1f}",
                          f"{activations / MiB:.0f} ({with_ac / MiB:.0f})", f"{peak / MiB:.0f}",
                          fits if one else f"{fits} ({limit / MiB:.0f})"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)] if lines else map(len, head)
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out += refused
    if not limits:
        out.append("no arm can run as given: each line says why.")
        return "\n".join(out)
    where = "; ".join(f"{_size_in_both(limit)} ({source})" for limit, source in sorted(set(limits.values())))
    out.append(f"memory per rank: {where}.")
    out.append("Model states are exact (the run measures the same bytes); activations and peak are estimates: see "
               "toolkit/plan/.")
    return "\n".join(out)
