"""The Strategy protocol: everything the loop, the launcher and the report need from a parallel strategy.

The loop calls, per optimizer step:
    loss_sums = strategy.forward_backward(micro_batches, loss_sum=..., share=...)
    strategy.step(max_grad_norm=...)

`loss_sum(logits, micro_batch)` is the sum of a micro-batch's loss terms; `share(that sum)` is its share
of the global-batch mean loss, scaled by the loop for the strategy's gradient reduction (see
`StrategyInfo.averages_gradients`): backward runs on the share, so whatever the strategy's collective does,
the gradient every rank ends up with is the gradient of the global-batch mean. Most strategies run the
micro-batches one by one (`each_micro_batch`); a pipeline hands all of them to its schedule.

A strategy is one module in this package exposing `INFO`, `RULES` (its StrategyRules: checks, data layout,
memory rules), `build()` (the Strategy a rank trains with) and `degrees()`, plus one line in the registry
(`toolkit/strategies/__init__.py`). Nothing outside this package compares strategy names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Protocol, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.checkpoint.fragments import Fragments
from toolkit.checkpoint.loading import ModelSource
from toolkit.checkpoint.state import Read
from toolkit.config.recipe import Recipe
from toolkit.cost.collectives import Collective
from toolkit.data.losses import TILED, tiled_loss_sum
from toolkit.data.splits import DataLayout
from toolkit.errors import RecipeError
from toolkit.memory.state_bytes import StateBytes
from toolkit.model.precision import StepResult
from toolkit.model.tied import tied_aliases
from toolkit.observe.metrics import storage_key
from toolkit.process.dist import DistEnv, all_reduce_max


LossSum = Callable[[torch.Tensor, dict], torch.Tensor]  # (logits, micro-batch) -> sum of its loss terms
Share = Callable[[torch.Tensor], torch.Tensor]  # a micro-batch's loss sum -> what backward runs on


class OptimizerFactory(Protocol):
    def __call__(self, model: nn.Module, *, fused_ok: bool = True) -> torch.optim.Optimizer:
        """The recipe's AdamW over `model`; fused_ok=False where the strategy's step cannot drive a fused one."""


SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True, kw_only=True)
class StrategyInfo:
    """What a strategy is, for `toolkit strategies`, recipe checks and `toolkit compare`."""

    name: str
    summary: str  # what each rank holds and what it trades, one line
    options: tuple[str, ...] = ()  # the strategy.<option> recipe keys it reads
    arms: dict[str, tuple[str, ...]] = field(default_factory=dict)  # compare arm name -> recipe overrides
    one_process: bool = False  # runs in exactly one process (a compare arm of it gets 1 rank)
    averages_gradients: bool = False  # its reduction averages over ranks: the loop scales the loss by the world size
    # a full replica per rank and the batch split over all ranks, nothing else: the yardstick toolkit compare's
    # recommendation sets every other arm's memory and tokens/s against
    plain_data_parallel: bool = False
    accelerate_plugin: str | None = None  # the `accelerate launch` plugin it runs (fsdp, deepspeed)
    lora: bool = True  # trains model.lora adapters (checked: single, ddp, fsdp, zero; not yet split models)
    compiles: bool = True  # runs train.compile's blocks (tp: torch 2.13's dynamo fails on DTensor-split blocks)
    # computes train.tiled_loss: its micro-batches go through logits_of, the output layer's weight whole inside the
    # model's forward and again in backward (checked: single, ddp, fsdp without tp or cp, zero 0-3)
    tiles_loss: bool = False
    # computes with its parameters cast to the 16-bit precision (FSDP2's MixedPrecisionPolicy, DeepSpeed's 16-bit
    # weights), not under autocast: what its forward saves for backward differs (toolkit/memory/activations.py)
    casts_parameters: bool = False
    # keeps its gradients' memory from step to step (DDP's buckets, ZeRO-3's flat buffer); False: its
    # zero_grad(set_to_none) or step gives them back (ZeRO-1/2: zero's build sets it), and a step's first
    # micro-batch and the export run without them (toolkit plan)
    holds_gradients: bool = True
    # how many gradients of a tied weight (embedding and head) exist beyond the model states at the end of
    # backward (toolkit plan's tied_gradient_bytes): autograd sums the head's and the embedding's out of place,
    # so both and their sum exist at once. The sum is the gradient a strategy that keeps autograd's gradients
    # holds (single, dp, tp): 2 more; one whose gradient states are buffers of its own (DDP's buckets, FSDP's
    # shards, ZeRO's partitions) copies the sum into them: 3; a pipeline's end stages hold a copy each: 0. Under
    # loss_parallel each is a rank's rows, and the embedding's whole gradient, from which DTensor copies its rows,
    # is one more (toolkit plan's tied_gradients_beyond_states)
    tied_gradients: int = 3
    # every rank holds every trainable parameter's gradient, unreduced, at the end of backward, beyond those its
    # model states count: ZeRO-1 reduces them only once backward is done (zero's build sets it; toolkit plan)
    whole_gradients_in_backward: bool = False
    # its export reads the parameters where they are on CPU (single, dp, ddp: full replicas in the load dtype);
    # False: rank 0 gathers or copies the whole model to write it (toolkit plan's export term)
    exports_in_place: bool = False
    # the libraries its ranks import beyond torch and transformers, part of the runtime a memory prediction
    # starts from (DeepSpeed: +51-105 MiB resident on CPU beyond the toolkit's own imports, measured; toolkit
    # plan imports them to measure it); a submodule the installed version lacks is skipped (import_runtime_module)
    runtime_modules: tuple[str, ...] = ()


def import_runtime_module(name: str) -> None:
    """Import `name`, one of a strategy's runtime_modules. A library that is missing is an error as ever; a submodule
    that does not import (DeepSpeed's Muon optimizer, new in 0.18) is skipped, as the library's own import of it is
    (DeepSpeed's is_zero_supported_optimizer)."""
    import importlib

    library = name.partition(".")[0]
    importlib.import_module(library)
    if name != library:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


@dataclass(frozen=True, kw_only=True)
class SetupArgs:
    recipe: Recipe
    env: DistEnv
    grad_accum_steps: int
    total_steps: int
    build_optimizer: OptimizerFactory  # the recipe's AdamW (groups, implementation): every strategy uses it
    build_scheduler: SchedulerFactory  # the recipe's warm-up + decay schedule, stepped once per optimizer step
    source: ModelSource | None = None  # where the weights come from, for a model build_model left empty


@dataclass(frozen=True, kw_only=True)
class Replicas:
    """Tensors that several ranks hold identical copies of, and the group of ranks that hold them."""

    named: list[tuple[str, torch.Tensor]]
    group: object | None  # a torch.distributed ProcessGroup; None = every rank
    description: str  # e.g. "2 ranks hold full replicas"
    # local SGD: () -> whether the replicas were made equal after the last step; between syncs they differ by
    # design, and the replica check measures their drift instead of stopping the run. None: equal after every step
    synced: Callable[[], bool] | None = None


class StrategyRules(Protocol):
    """What a strategy is before any process group exists: the checks the launcher and every rank make, which
    data shard a rank reads, and the memory rules `toolkit plan` predicts with. Each strategy module exposes one
    as `RULES`; the object a rank trains with (Strategy) does not carry them."""

    def info(self, recipe: Recipe) -> StrategyInfo:
        """What the strategy is under this recipe (ZeRO's stage decides whether it holds gradients)."""

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        """Raise RecipeError for a recipe this strategy cannot run at this world size. It may run where no
        process group exists: `validate`, a launcher of several machines before its ranks start; a rank runs it
        before setup (and, under `toolkit launch` on one machine, with the recipe's checks before that)."""

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        """Which shard of each global batch `rank` reads (no process group needed)."""

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        """Per rank, the parameter, gradient and optimizer-state bytes a run will measure, from `model` built
        on the meta device and this strategy's sharding and precision rules (toolkit plan; no process group)."""

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        """Per rank, the bytes of weights it builds beyond its model states while the model is loaded: the whole
        model where every rank builds it and then copies what it keeps into tensors of its own (freed after
        setup: a loading peak), nothing where the built tensors are its parameters (single, dp, ddp) or under
        low-memory loading, the whole model on rank 0 only where it builds it for the others (`model`: on the
        meta device; toolkit plan, no process group). `resuming`: the run's weights come from a checkpoint (DCP),
        from which a rank that builds only its part reads only that part: no whole model on any rank."""

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        """Per rank, what the end of backward and the optimizer step hold beyond the model states at once, when
        the activations are gone: a copy the step makes (ZeRO flattens a rank's gradients into one fp32 partition
        and takes each gradient to float64 for the norm), a whole gradient being reduced (ZeRO-3's largest
        parameter); 0 where the step works in place (`model`: on the meta device; toolkit plan, no process group;
        `device_type`: cuda or cpu, whose gloo collectives copy their unsharded side)."""

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        """Per rank, the most parameter bytes it gathers from the others and holds at once during a step, beyond
        its own shard (`model`: on the meta device; toolkit plan, no process group)."""

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        """What `rank` hands to collectives in one optimizer step, beside the loop's own
        (cost.collectives.loop_collectives), in the collective counter's terms: a run counts the same bytes
        (run.json's `comm_per_step` beside its `comm_prediction`). `shapes`: (samples, padded length) of each
        micro-batch the rank computes in the step (`model`: on the meta device; toolkit plan, no process group).
        A RecipeError where the layout's collectives are not modelled yet."""

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        """Per rank, the most activation bytes it holds during a step, traced on fake tensors
        (toolkit/memory/activations.py; `how`: the dtypes and checkpointing its micro-batches compute with): one
        micro-batch through the whole stack (a tensor-parallel rank: with its share of the split layers), or a
        pipeline rank's stages with the micro-batches its schedule keeps in flight."""


class StrategyState(Protocol):
    """What a rank holds, for checkpoints, the export and the run's checks: read from the live objects after setup."""

    def checkpoint_tensors(self) -> dict[str, dict[str, Any]] | Fragments:
        """This rank's part of a checkpoint in the shared layout (toolkit/checkpoint/state.py): {"model":
        state_dict entries (fp32 masters), "optim": {"state.<name>.<key>": tensor}}, or, where the state lies
        in flat partitions of the strategy's own, this rank's pieces of those tensors (each rank writes its
        own: checkpoint/fragments.py). Collective if it gathers."""

    def load_optimizer_state(self, read: Read) -> None:
        """Collective, after setup: build this rank's optimizer state template in the shared layout, have
        `read` fill it from the checkpoint, and make it the optimizer's state."""

    def checkpoint_extra(self) -> dict[str, Any]:
        """The LR schedule's and the loss scaler's state as plain numbers (the same on every rank)."""

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None: ...

    def communication_state(self) -> bytes | None:
        """This rank's own state of its gradient communication (PowerSGD's error and factors), serialized; None where
        it keeps none."""

    def load_communication_state(self, read: Callable[[], bytes | None]) -> None:
        """Where this rank keeps such state: what `read()` gives, which communication_state returned on this rank of
        the run that saved (None: the checkpoint holds none for it); `read` is not called otherwise."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full model weights on CPU on rank 0 (fp32 masters where kept), None elsewhere."""

    def export_module(self) -> nn.Module:
        """The unwrapped transformers model (its config and save_pretrained are used for export)."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors holding parameters, gradients and optimizer state (for exact byte counts)."""

    def precision_audit(self) -> dict[str, str]:
        """Dtypes read from the live objects: forward params, master weights, grads, reduction, optimizer state."""

    def replicas(self) -> list[Replicas]:
        """What this rank holds identical copies of, one entry per group of ranks holding them (a stage's
        data-parallel replicas; a pipeline's first and last stage, which both hold a tied embedding). The
        replica consistency check compares each entry over its group, in list order: every rank of a group
        must list it at the same position. Empty when nothing is replicated (one process, or every rank holds
        a different shard)."""

    def gradient_abs_max(self) -> dict[str, float] | None:
        """Collective, after the last backward of a step and before step(): per parameter name, the largest
        |element| of its full gradient over all ranks. None where this strategy cannot read full gradients."""


@dataclass(frozen=True, kw_only=True)
class StrategyReport:
    """What a run says about its strategy once set up (the start lines, run.json)."""

    layout: str  # where the model lives after setup, in one line
    # why this machine runs something other than the strategy asked for, in one line (dp without 2+ GPUs runs as
    # single), or None where it runs as itself: run.json's `fallback`, for a report to flag
    fallback: str | None
    measurements: dict[str, Any]  # what this rank measured that only this strategy can (a pipeline's bubble)


class Strategy(Protocol):
    """The object a rank trains with: what the loop drives. Made once per rank (make_strategy), set up once."""

    info: StrategyInfo

    def build_model(self, source: ModelSource, *, env: DistEnv) -> nn.Module:
        """The model setup gets: `source.whole()`, or under low-memory loading a model whose weights setup (or
        the build itself) loads part by part."""

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        """Wrap/shard the model (on CPU, in its load dtype), move it to the device, build optimizer + schedule."""

    @property
    def model(self) -> nn.Module:
        """The module(s) this rank runs; .train()/.eval() switch dropout."""

    def forward_backward(self, micro_batches: list[dict], *, loss_sum: LossSum, share: Share) -> torch.Tensor:
        """Forward and backward every micro-batch of one optimizer step, gradients reduced after the last.
        Returns this rank's summed loss sums (float64; zero on a rank that computes no loss)."""

    def forward_only(self, micro_batches: list[dict], *, loss_sum: LossSum) -> tuple[torch.Tensor, int]:
        """Evaluation forward of up to grad_accum_steps micro-batches: (their loss sum, their number of loss
        terms) on a rank that computes the loss, (0, 0) on one that does not. Collective where the model
        is sharded or pipelined."""

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        """Clip, optimizer step, schedule step, zero grads."""

    def discard_step(self) -> StepResult:
        """Drop this step's gradients without an update (a non-finite loss); the LR schedule advances, as
        it does for a step fp16 loss scaling skips. Returns the step's result (StepResult.dropped)."""

    def lr(self) -> float: ...

    @property
    def state(self) -> StrategyState:
        """Checkpoint, export and the live tensors: one object (TorchState for most)."""

    def report(self) -> StrategyReport:
        """Where the model lives, any fallback, and what only this strategy measures."""

    def close(self) -> None:
        """After the last output is written: release the wrapped model, optimizer and engine, which hold
        the process group, so that destroy_process_group can free it."""


class MicroBatchStrategy(Protocol):
    """What `each_micro_batch` needs: a model to call, autocast, accumulation without sync, backward."""

    @property
    def model(self) -> nn.Module: ...

    def forward_context(self) -> ContextManager: ...

    def accumulate(self, *, sync: bool) -> ContextManager: ...

    def backward(self, loss_share: torch.Tensor) -> None: ...


def refuse_untested(recipe: Recipe, *, layout: str, drop: str, lora_why: str, compile_why: str,
                    selective_tested: bool = False) -> None:
    """model.lora, train.compile and (unless `selective_tested`) selective checkpointing under a layout no test has
    run them with: one line each, saying why and what to drop (`layout`: "context parallel"; `drop`: the recipe key
    that turns the layout off)."""
    if not selective_tested:
        refuse_selective_checkpointing(recipe, layout=layout, fix=f"set it to true or drop {drop}")
    if recipe.model.lora is not None:
        raise RecipeError(f"model.lora is not available with {layout} yet ({lora_why}); drop model.lora or {drop}")
    if recipe.train.compile:
        raise RecipeError(f"train.compile is not available with {layout} yet ({compile_why}); set train.compile: "
                          f"false or drop {drop}")


def refuse_selective_checkpointing(recipe: Recipe, *, layout: str, fix: str) -> None:
    """Selective checkpointing where no test has run it: under context and expert parallel a block's recompute
    runs collectives again (all-to-all, key and value gathers) whose count is checked under full checkpointing only.
    (Tensor parallel's equal full's, counted and tested: its policy keeps no collective's output.)"""
    if recipe.train.recompute == "selective":
        raise RecipeError(f"train.activation_checkpointing: selective is not available with {layout} yet (not "
                          f"tested with it; full checkpointing is); {fix}")


def every_rank_a_shard(*, world_size: int, rank: int) -> DataLayout:
    """The data-parallel layout: each rank reads its own shard of every global batch."""
    return DataLayout(rank=rank, size=world_size)


ROUTER_LOSS = "router_loss"  # a micro-batch's key for its weighted router auxiliary loss (logits_of puts it there)


def logits_of(strategy: MicroBatchStrategy, batch: dict, device: torch.device) -> torch.Tensor:
    """The micro-batch's logits. A mixture-of-experts model whose config sets output_router_logits returns its
    router's auxiliary (load-balancing) loss too, computed by transformers on this micro-batch's tokens (padding
    masked): weighted by the model's router_aux_loss_coef, it goes into batch[ROUTER_LOSS] for the loop's loss.
    A micro-batch marked TILED (train.tiled_loss) runs the model with its output layer computing the loss sum in
    tiles (data/losses.py) where it would compute the logits: inside the model's forward, where a wrapper holds the
    layer's weight whole (FSDP's root unit, gathered until its backward) and under its autocast; that sum is what
    the forward returns, and what is returned here in place of the logits (data/losses.py forward_loss_sum)."""
    model: Any = getattr(strategy.model, "module", strategy.model)  # DDP's or DeepSpeed's wrapper: the model
    head = model.get_output_embeddings() if batch.get(TILED) else None
    tiled = tiled_head(head, batch, device) if head is not None else contextlib.nullcontext()
    with strategy.forward_context(), tiled:
        out = strategy.model(input_ids=batch["input_ids"].to(device, non_blocking=True),
                             attention_mask=batch["attention_mask"].to(device, non_blocking=True))
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        batch[ROUTER_LOSS] = aux.float() * float(model.config.router_aux_loss_coef)
    return out.logits


@contextlib.contextmanager
def tiled_head(head: nn.Module, batch: dict, device: torch.device) -> Iterator[None]:
    """Inside, `head` turns the last hidden states into the micro-batch's loss sum, tile by tile (each tile through
    the layer's own forward, again in backward), instead of the logits; `batch`: its labels (and labels_shifted
    where each already names the next token, as a context-parallel rank's do)."""
    # the layer's declared width: ZeRO-3 leaves its weight a 0-element partition outside its forward
    own, vocab = head.forward, int(getattr(head, "out_features", 0) or cast(torch.Tensor, head.weight).shape[0])
    labels, shifted = batch["labels"].to(device, non_blocking=True), "labels_shifted" in batch
    head.forward = lambda hidden: tiled_loss_sum(hidden, own, labels, shifted=shifted,  # type: ignore[method-assign]
                                                 vocab=vocab)
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def whole_stack_activations(model: nn.Module, recipe: Recipe, *, world_size: int, how: dict[str, Any],
                            tp_degree: int = 1) -> list[int]:
    """Every rank holds one micro-batch's activations through the whole layer stack at a time; `tp_degree` > 1:
    its split layers' 1/N share of them (a tensor-parallel rank)."""
    from toolkit.memory.activations import traced_activations  # transformers' logging: not at the launcher's import

    return [traced_activations(model, recipe, **how, tp_degree=tp_degree)] * world_size


def each_micro_batch(strategy: MicroBatchStrategy, micro_batches: list[dict], *, loss_sum: LossSum, share: Share,
                     device: torch.device) -> torch.Tensor:
    """The step of every strategy but a pipeline: forward and backward one micro-batch at a time, gradient
    reduction skipped (accumulate(sync=False)) on all but the last. `device`: where inputs go."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for index, batch in enumerate(micro_batches):
        with strategy.accumulate(sync=index == len(micro_batches) - 1):
            micro_sum = loss_sum(logits_of(strategy, batch, device), batch)
            strategy.backward(share(micro_sum))
        total += micro_sum.detach().double().to(device)
    return total


def forward_once(strategy: MicroBatchStrategy, micro_batches: list[dict], *, loss_sum: LossSum,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """Evaluation forward, micro-batch by micro-batch, on a strategy whose every rank computes its loss."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for batch in micro_batches:
        total += loss_sum(logits_of(strategy, batch, device), batch).detach().double().to(device)
    return total, sum(int(batch["num_items"]) for batch in micro_batches)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[tuple, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()  # DTensor: this rank's shard
        if storage.nbytes() == 0:
            continue
        seen[storage_key(tensor)] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0]


def optimizer_label(optimizer: torch.optim.Optimizer) -> str:
    """"torch AdamW (fused)": the class and the implementation that runs its step."""
    defaults = optimizer.defaults
    impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "loop"
    return f"torch {type(optimizer).__name__} ({impl})"


def first_dtype(tensors: Iterator[torch.Tensor] | Iterable[torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in tensors if t is not None and t.is_floating_point()), None)


def no_context() -> ContextManager:
    return contextlib.nullcontext()


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights on CPU for an export, which only reads them: the live tensors where they are already
    there (a copy would add the whole model to rank 0's peak), else one copy per tensor, a tied weight's names
    sharing it."""
    aliases = tied_aliases(module)
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        owner = aliases.get(name, name)
        out[name] = out[owner] if owner in out else value.detach().to("cpu")  # no copy of a CPU tensor
    return out


def local_abs_max(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> dict[str, float]:
    """Largest |element| per named gradient (DTensor: this rank's shard); one device sync for all."""
    names, maxima = [], []
    for name, grad in named_grads:
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        names.append(name)
        maxima.append(local.detach().abs().max().float() if local.numel() else local.new_zeros((), dtype=torch.float32))
    if not names:
        return {}
    values = torch.stack(maxima).double().cpu().tolist()  # device sync: only on steps that record it
    return dict(zip(names, values))


def sharded_abs_max(model: nn.Module, env: DistEnv, *, scale: float = 1.0) -> dict[str, float]:
    """gradient_abs_max where each rank holds shards of the gradients (DTensors): its local maxima, then the
    maximum over ranks (a collective); `scale` is the loss scale still in the gradients."""
    maxima = local_abs_max((n, p.grad) for n, p in model.named_parameters())
    names = sorted(maxima)
    values = torch.tensor([maxima[n] for n in names], dtype=torch.float64)
    all_reduce_max(values, env)
    return {n: float(v) / scale for n, v in zip(names, values)}


def gathered_state_dict(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor] | None:
    """Collective: the full weights of a model holding DTensors, gathered on CPU; rank 0 gets them.

    Each tensor is gathered once and a tied weight appears under each of its names, sharing the one copy.
    torch's get_model_state_dict(full_state_dict=True) gathers a tied weight once per name: with tied
    embeddings rank 0 held two copies of the embedding while it exported (measured on the 302M benchmark
    model: 119 MiB more at the export's peak; for a model with a large vocabulary, gigabytes)."""
    from torch.distributed.tensor import DTensor

    aliases = tied_aliases(model)
    full: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if aliases.get(name, name) != name:
            continue  # a tied alias: its first name's copy, below
        if isinstance(value, DTensor):
            value = value.full_tensor()  # every rank takes part
        if env.is_main:
            full[name] = value.detach().to("cpu")
        del value  # another rank's copy goes at once
    if not env.is_main:
        return None
    for name, owner in aliases.items():
        if owner != name and owner in full:
            full[name] = full[owner]
    return full
