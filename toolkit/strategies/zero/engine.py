"""`zero`: DeepSpeed ZeRO stages 0-3 (+ CPU offload) through `deepspeed.initialize`.

Stage 1 shards optimizer state, 2 also gradients, 3 also parameters. DeepSpeed keeps fp32 master
weights whatever the compute dtype (unlike FSDP, which updates the load dtype). The optimizer and the
schedule are the recipe's, built by the same factories as every other strategy's and handed to
DeepSpeed as its client optimizer and scheduler (with the optimizer offloaded, the recipe's AdamW
becomes DeepSpeed's CPU Adam: zero/optim.py), unless a ds_config names its own `optimizer` or
`scheduler` block: DeepSpeed then builds that one, its "auto" values filled from the recipe
(zero/config.py). The loop owns the accumulation boundary: each micro-batch tells the engine whether it
is the last one, and the engine steps once per optimizer step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from toolkit.checkpoint.fragments import Fragments
from toolkit.checkpoint.loading import ModelSource
from toolkit.checkpoint.state import Read, load_schedule_state, schedule_state
from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe, plan_batch
from toolkit.errors import RecipeError
from toolkit.model.build import hf_config
from toolkit.model.precision import StepResult, dtype_name
from toolkit.model.tied import without_tied_aliases
from toolkit.process.dist import DistEnv, ensure_process_group
from toolkit.strategies.base import (LossSum, Replicas, SetupArgs, Share, StrategyReport, StrategyState,
                                     each_micro_batch, first_dtype, forward_once, local_abs_max, no_context,
                                     optimizer_state_tensors)
from toolkit.strategies.optim.adamw import param_groups, schedule_label
from toolkit.strategies.zero import checkpoint as zero_checkpoint, init as zero_init
from toolkit.strategies.zero.comm import init_deepspeed_comm
from toolkit.strategies.zero.config import configured_stage, hidden_size_of, offloads, resolve_ds_config, stage_of
from toolkit.strategies.zero.optim import cpu_adam_like, optimizer_label_of, optimizer_op, to_compile
from toolkit.strategies.zero.order import block_units
from toolkit.strategies.zero.rules import INFO, OPTIONS, RULES, partitioned_at_creation  # noqa: F401 (OPTIONS: the registry reads it here)


def gather_blocks_whole(model: nn.Module, config: dict, *, world_size: int) -> str:
    """Marks each transformer block a DeepSpeed leaf module where order.block_units takes blocks as ZeRO-3's
    units of gathering (the rule and its measurements are there: the plan predicts with the same one); returns
    how the parameters are gathered, for the layout line ("" at 2+ ranks: DeepSpeed's own units, unsaid)."""
    from deepspeed.utils import set_z3_leaf_module

    blocks, said = block_units(model, config, world_size=world_size)
    for block in blocks:
        set_z3_leaf_module(block, True)
    return said


# what DeepSpeed's warm-up schedulers (WarmupLR and its subclasses) log from their own constructor, which reads the
# learning rate before the first step: on every rank of every run whose JSON names one, about nothing the user did
CONSTRUCTOR_LR_NOTICE = "Attempting to get learning rate from scheduler before it has started"


@contextlib.contextmanager
def without_constructor_lr_notice() -> Iterator[None]:
    """Inside, DeepSpeed's logger drops CONSTRUCTOR_LR_NOTICE; its other records pass."""
    from deepspeed.utils import logger

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(CONSTRUCTOR_LR_NOTICE)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class ZeroStrategy:
    info = INFO
    gather_unit = ""  # stage 3: how its parameters are gathered (gather_blocks_whole)
    schedule_label = ""  # setup: the recipe's schedule, or the DeepSpeed scheduler a JSON block names
    loading = "every rank built the whole model, then kept its partition"  # build_model says otherwise

    def forward_backward(self, micro_batches: list[dict], *, loss_sum: LossSum, share: Share) -> torch.Tensor:
        return each_micro_batch(self, micro_batches, loss_sum=loss_sum, share=share, device=self.env.device)

    def forward_only(self, micro_batches: list[dict], *, loss_sum: LossSum) -> tuple[torch.Tensor, int]:
        return forward_once(self, micro_batches, loss_sum=loss_sum, device=self.env.device)

    def build_model(self, source: ModelSource, *, env: DistEnv) -> nn.Module:
        if not partitioned_at_creation(source.recipe):
            return source.whole()
        ensure_process_group(env, strategy=self.info.name, deepspeed=True)  # zero.Init partitions over the group
        init_deepspeed_comm()
        recipe = source.recipe
        config = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=env.world_size),
                                   hidden_size=hidden_size_of(hf_config(recipe.model)))
        self.loading = "each parameter partitioned as it was created (zero.Init), filled one module at a time"
        return zero_init.build_partitioned(source, config=config, env=env)

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        import deepspeed

        self.env, recipe = args.env, args.recipe
        ensure_process_group(args.env, strategy=self.info.name, deepspeed=True)  # DeepSpeed needs one, even for one rank
        init_deepspeed_comm()
        self.config = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=args.env.world_size),
                                        hidden_size=hidden_size_of(model.config), total_steps=args.total_steps)
        self.stage = stage_of(self.config)
        self.offload_optimizer, self.offload_param = offloads(self.config)
        compiled = to_compile(optimizer_op(self.config, offload_optimizer=self.offload_optimizer))
        if compiled is not None and self.env.is_main:
            print(f"[toolkit] zero: DeepSpeed compiles its {compiled[0]} op for this machine before the first step "
                  f"(once: a minute or two; then kept in {compiled[1]})", file=sys.stderr, flush=True)
        # a JSON optimizer / scheduler block is DeepSpeed's to build (its "auto" values are the recipe's); without
        # one, the recipe's AdamW and schedule, built by the factories every strategy uses
        optimizer = None if "optimizer" in self.config else args.build_optimizer(model)
        if optimizer is not None and self.offload_optimizer:
            optimizer = cpu_adam_like(optimizer)
        scheduler = None if "scheduler" in self.config else args.build_scheduler
        self.gather_unit = gather_blocks_whole(model, self.config, world_size=args.env.world_size) \
            if self.stage == 3 else ""
        with without_constructor_lr_notice():
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.config,
                model_parameters=param_groups(model, recipe.optim) if optimizer is None else None)
        self.module = self.engine.module
        self.schedule_label = (f"DeepSpeed {self.config['scheduler']['type']}" if scheduler is None
                               else schedule_label(recipe.optim))
        if self.env.is_main and (optimizer is None or scheduler is None):
            built = " and ".join(f"{kind} {self.config[kind]['type']}" for kind in ("optimizer", "scheduler")
                                 if kind in self.config)
            print(f"[toolkit] zero: DeepSpeed builds the {built} of {recipe.strategy.ds_config} (\"auto\" values "
                  f"from the recipe; ran: {optimizer_label_of(self._inner_optimizer())}, {self.schedule_label})",
                  file=sys.stderr, flush=True)

    @property
    def model(self) -> nn.Module:
        return self.engine

    @property
    def state(self) -> StrategyState:
        return self  # its checkpoint, export and live tensors are its engine's, read here

    def report(self) -> StrategyReport:
        return StrategyReport(layout=self._layout(), fallback=self._fallback(), measurements=self._measurements())

    def forward_context(self) -> ContextManager:
        return no_context()  # the engine holds the params in the compute dtype already

    def accumulate(self, *, sync: bool) -> ContextManager:
        # DeepSpeed's own API for a caller-owned boundary: reduce only in the last micro-batch's backward
        self.engine.set_gradient_accumulation_boundary(sync)
        return no_context()

    def backward(self, loss_share: torch.Tensor) -> None:
        # scale_wrt_gas=False: loss_share is already normalised over every micro-batch of the step, so
        # DeepSpeed must not divide by the accumulation steps again
        self.engine.backward(loss_share, scale_wrt_gas=False)

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        assert self.engine.is_gradient_accumulation_boundary()
        skipped_before = self.engine.skipped_steps
        own_norm = self._plain_optimizer_norm()
        self.engine.step()  # reduce (stage 1), clip at gradient_clipping, optimizer + lr schedule step
        norm = self.engine.get_global_grad_norm() if own_norm is None else own_norm
        scale = self.engine._get_optimizer_loss_scale() if self.engine.fp16_enabled() else None
        grad_norm = float(norm) if norm is not None else float("nan")  # nan: unknown, not non-finite
        return StepResult(grad_norm=grad_norm, skipped=self.engine.skipped_steps > skipped_before,
                          loss_scale=float(scale) if scale is not None else None,
                          nonfinite=norm is not None and scale is None and not math.isfinite(grad_norm))

    def _plain_optimizer_norm(self) -> float | None:
        """The pre-clip global gradient norm where the engine keeps none: stage 0 in fp32 steps the torch AdamW
        itself (no DeepSpeed optimizer to record a norm; its clip_fp32_gradients drops the one clip_grad_norm_
        returns), so metrics.jsonl read null, the progress line nan, and a non-finite gradient went unchecked.
        Its gradients are reduced in backward at the boundary (engine.allreduce_gradients): each rank holds them
        whole, and measures the same norm. None where a DeepSpeed optimizer keeps the norm (the condition is the
        engine's own for clip_fp32_gradients)."""
        engine = self.engine
        if engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization():
            return None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def discard_step(self) -> StepResult:
        raise RecipeError("train.on_nonfinite=skip is not available under zero")  # validate() refuses it first

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def replicas(self) -> list[Replicas]:
        if self.stage == 3 or self.env.world_size == 1:
            return []  # ZeRO-3: each rank holds a partition
        return [Replicas(named=list(self.module.named_parameters()), group=None,
                         description=f"{self.env.world_size} ranks hold full parameters (ZeRO-{self.stage})")]

    def gradient_abs_max(self) -> dict[str, float] | None:
        if self.engine.fp16_enabled():
            return None  # gradients still carry the loss scale here
        from deepspeed.utils import safe_get_full_grad

        # every rank calls it for every parameter: ZeRO-3 gathers; the full fp32 gradient on each rank
        return local_abs_max((name, safe_get_full_grad(param)) for name, param in self.module.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """fp32 master weights, gathered (a collective: every rank gathers each parameter in turn; only rank 0
        keeps them, the others drop each at once, so no rank but rank 0 holds the whole model), plus buffers."""
        from deepspeed.utils import safe_get_full_fp32_param

        if self.stage == 3:
            # ZeRO-3 keeps the parameters a forward after the last step gathered (the final evaluation's: every
            # parameter of a model under its reuse distance, 500M by default, the whole model in the compute
            # dtype on every rank) until they are used again, which at the export they are not: they go before
            # each rank gathers the fp32 masters one at a time (measured: minilm-sst at 2 ranks, 87 MiB per rank
            # held through the export without this). DeepSpeed's step releases them the same way; a mid-run
            # checkpoint through _gathered_checkpoint_tensors pays a gc.collect() for it.
            self.engine.empty_partition_cache()
        state: dict[str, torch.Tensor] = {}
        gathered: dict[int, torch.Tensor | None] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):  # tied weights: every name
            if id(param) not in gathered:
                full = safe_get_full_fp32_param(param)  # every rank calls it: stages 1-3 gather
                if full is None and self.stage == 3:  # a frozen parameter (LoRA's base) has no fp32 master
                    full = _gathered(param)
                kept = full if full is not None else param.detach()
                gathered[id(param)] = kept.to("cpu", torch.float32, copy=True) if self.env.is_main else None
            if (tensor := gathered[id(param)]) is not None:
                state[name] = tensor
        if not self.env.is_main:
            return None
        persistent = set(self.module.state_dict().keys())  # non-persistent buffers are not saved
        for name, buffer in self.module.named_buffers():
            if name in persistent:
                state[name] = buffer.detach().to("cpu", copy=True)
        return state

    def export_module(self) -> nn.Module:
        return self.module

    def _measurements(self) -> dict:
        return {}

    # Checkpoints. DeepSpeed keeps its fp32 masters and Adam moments in flat partitions that torch's
    # state_dict helpers cannot see. Each rank lists its pieces of them (zero/checkpoint.py) and writes them
    # as its chunks of the full per-parameter tensors, the layout every other strategy writes
    # (checkpoint/fragments.py): no rank holds a full tensor. The alternative, DeepSpeed's own checkpoint
    # plus its universal converter, does not load a stage-2 save into stage 3.
    def checkpoint_tensors(self) -> dict[str, dict[str, Any]] | Fragments:
        self._link_optimizer_state()
        if not zero_checkpoint.readable(self.optimizer):
            return self._gathered_checkpoint_tensors()
        return zero_checkpoint.fragments(self.module, optimizer=self.optimizer, inner=self._inner_optimizer(),
                                         stage=self.stage, is_main=self.env.is_main, step=self._optimizer_step())

    def _gathered_checkpoint_tensors(self) -> dict[str, dict[str, Any]]:
        """Through DeepSpeed's accessors, which swap NVMe-offloaded partitions in: collectives on DeepSpeed's
        groups, so on the training thread even with checkpoint.async."""
        from deepspeed.utils import safe_get_full_optimizer_state

        model = self.full_state_dict()  # collective under ZeRO-3; on rank 0 only
        model = without_tied_aliases(self.module, model) if model is not None else {}
        optim: dict[str, Any] = {}
        step = self._optimizer_step()
        for name, param in self.module.named_parameters():
            for key in zero_checkpoint.MOMENTS:
                full = safe_get_full_optimizer_state(param, key)  # every rank calls it: a collective
                if full is not None and self.env.is_main:
                    optim[f"state.{name}.{key}"] = full.detach().to("cpu", torch.float32, copy=True)
            if step is not None and self.env.is_main:
                optim[f"state.{name}.step"] = torch.tensor(float(step))
        return {"model": model, "optim": optim}

    def load_optimizer_state(self, read: Read) -> None:
        step = zero_checkpoint.load_optimizer_state(self.module, optimizer=self.optimizer,
                                                    inner=self._inner_optimizer(), stage=self.stage,
                                                    device=self.env.device, read=read)
        self.engine.global_steps = int(step)

    def _link_optimizer_state(self) -> None:
        zero_checkpoint.link_optimizer_state(self.optimizer)

    def _optimizer_step(self) -> float | None:
        for state in self._inner_optimizer().state.values():
            if "step" in state:
                return float(state["step"])
        return None

    def checkpoint_extra(self) -> dict[str, Any]:
        extra = schedule_state(self.scheduler, None)
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if self.engine.fp16_enabled() and scaler is not None:
            extra["scaler"] = {k: _number(getattr(scaler, k)) for k in DS_SCALER_FIELDS if hasattr(scaler, k)}
        return extra

    def communication_state(self) -> bytes | None:
        return None  # no communication hook keeps state here

    def load_communication_state(self, read: Callable[[], bytes | None]) -> None:
        pass

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        load_schedule_state(self.scheduler, None, extra)
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if self.engine.fp16_enabled() and scaler is not None:
            saved = extra.get("scaler") or {}
            if "scale" in saved and "cur_scale" not in saved:  # written by a torch GradScaler
                saved = {"cur_scale": saved["scale"]}
            for key, value in saved.items():
                if key in DS_SCALER_FIELDS:
                    setattr(scaler, key, value)

    def _layout(self) -> str:
        held = {0: "full parameters, gradients and optimizer state", 1: "full parameters and gradients, 1/N of the "
                "optimizer state", 2: "full parameters, 1/N of gradients and optimizer state",
                3: "1/N of parameters, gradients and optimizer state"}[self.stage]
        where = " (optimizer on CPU)" if self.offload_optimizer else ""
        gathers = f"; gathers {self.gather_unit}" if self.gather_unit else ""
        return (f"ZeRO-{self.stage}: each of {self.env.world_size} ranks holds {held}{where}{gathers}; "
                f"weights: {self.loading}")

    def _fallback(self) -> str | None:
        return None  # runs as itself on any machine

    def close(self) -> None:
        self.engine.destroy()  # removes ZeRO-3's hooks and the optimizer's buffers
        del self.engine, self.optimizer, self.scheduler, self.module

    def _inner_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _master_tensors(self) -> list[torch.Tensor]:
        """The fp32 weights the optimizer updates: ZeRO's partitions where it keeps them, else its params."""
        for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
            found = [t for t in getattr(self.optimizer, attr, None) or [] if torch.is_tensor(t)]
            if found:
                return found
        inner = self._inner_optimizer()
        return [p for group in inner.param_groups for p in group["params"]]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        if self.stage == 3:
            params = [p.ds_tensor for p in params]  # this rank's partition; p itself is an empty placeholder
        masters = self._master_tensors()
        model_ptrs = {t.untyped_storage().data_ptr() for t in params}
        masters = [m for m in masters if m.untyped_storage().data_ptr() not in model_ptrs]
        grads = [m.grad for m in self._master_tensors() if m.grad is not None]
        grads += [g for group in getattr(self.optimizer, "averaged_gradients", {}).values() for g in group or []]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        # the reduce bucket gradients are copied into before their reduce-scatter: ZeRO-3 keeps it for the run
        grads += [b.buffer for b in getattr(self.optimizer, "ipg_buckets", {}).values()
                  if isinstance(getattr(b, "buffer", None), torch.Tensor)]
        # ZeRO-3's flat buffer of this rank's gradient partitions; with the optimizer offloaded it is a second
        # copy beside the fp32 masters' .grad (found by the live-tensor census)
        flat = getattr(self.optimizer, "grad_partitions_flat_buffer", None)
        grads += [flat] if isinstance(flat, torch.Tensor) else []
        return {"params": params, "grads": grads,
                "optim": masters + optimizer_state_tensors(self._inner_optimizer())}

    def precision_audit(self) -> dict[str, str]:
        params = list(self.module.parameters())
        forward = first_dtype(p.ds_tensor if self.stage == 3 else p for p in params)
        masters = first_dtype(self._master_tensors())
        inner = self._inner_optimizer()
        grads = [p.grad for p in params if p.grad is not None] or [m.grad for m in self._master_tensors()
                                                                   if m.grad is not None]
        scaling = "off"
        if self.engine.fp16_enabled():
            scale = self.engine._get_optimizer_loss_scale()
            scaling = f"dynamic (DeepSpeed, init {scale:g})" if scale is not None else "dynamic (DeepSpeed)"
        where = "cpu" if self.offload_optimizer else self.env.device.type
        return {
            "forward_params": dtype_name(forward),
            "master_weights": f"{dtype_name(masters)} (ZeRO-{self.stage}, {where})",
            "gradients": dtype_name(first_dtype(grads)) if grads else dtype_name(forward),
            "grad_reduction": f"{'reduce-scatter' if self.stage >= 2 else 'all-reduce'} mean "
                              f"({dtype_name(self.engine.communication_data_type)})",
            "optimizer_state": dtype_name(first_dtype(optimizer_state_tensors(inner)) or masters),
            "loss_scaling": scaling,
            "optimizer": optimizer_label_of(inner) + (", offloaded" if self.offload_optimizer else ""),
            "scheduler": self.schedule_label,
        }


# DeepSpeed's DynamicLossScaler: what a resumed fp16 run needs to go on with the same scale
DS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _number(value):
    return value.item() if torch.is_tensor(value) else value


def _gathered(param: torch.Tensor) -> torch.Tensor:
    """Collective under ZeRO-3: a full copy of a partitioned parameter (in its own dtype)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().clone()


def build(recipe: Recipe) -> ZeroStrategy:
    strategy = ZeroStrategy()
    strategy.info = RULES.info(recipe)  # the stage decides whether it holds gradients
    return strategy


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    # DeepSpeed's engine: stage 0 keeps full replicas; stages 1-3 shard the optimizer state (and gradients,
    # parameters) over every rank
    if configured_stage(recipe) == 0:
        return Degrees(dp_replicate=world_size)
    return Degrees(dp_shard=world_size)
