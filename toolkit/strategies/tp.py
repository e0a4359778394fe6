"""`tp`: tensor parallel over every rank (DTensor `parallelize_module`, plan in model/tp_plan.py).

Every rank reads the same micro-batches (one data shard) and holds 1/N of each attention and MLP weight;
embeddings, norms and the head are replicated and get identical full gradients on every rank, so no
gradient is reduced: the activations are (one all-reduce per attention and per MLP block, each way). The
exception: norms inside attention that see only a rank's heads (Qwen3's q_norm, k_norm), whose gradients
are summed over the ranks once per step (tensor_parallel.sum_partial_gradients). strategy.loss_parallel splits the
head (and a tied embedding) over the vocabulary too, the loss reduced across the ranks (tp_plan.vocab_plan).
For TP inside groups with data parallel across them, use fsdp with strategy.tp_degree.
"""

from __future__ import annotations

from typing import Any, ContextManager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.checkpoint.loading import ModelSource, whole_model_bytes
from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.cost.collectives import Collective
from toolkit.errors import RecipeError
from toolkit.memory.state_bytes import StateBytes, adam_state, of_shapes
from toolkit.model import tp_plan as tensor_parallel
from toolkit.model.precision import DTYPES, Amp, dtype_name
from toolkit.model.tied import first_names, head_tied_to_embedding
from toolkit.process.dist import DistEnv, ensure_process_group, world_mesh
from toolkit.strategies.base import (DataLayout, LossSum, Replicas, SetupArgs, Share, StrategyInfo, StrategyReport,
                                     each_micro_batch, first_dtype, forward_once, no_context, sharded_abs_max,
                                     whole_stack_activations)
from toolkit.strategies.dims import norm_comm
from toolkit.strategies.dims.comm import sequence_parallel_params, tp_collectives
from toolkit.strategies.dims.parallelize import parallelize
from toolkit.strategies.optim.torch_optim import TorchOptim, TorchState, TrainsOneModule

@strategy_options
class TpOptions:
    """The strategy.<option> keys tp reads (their defaults and trade-offs: docs/recipe-keys.md)."""

    tp_degree: int | None  # unset, or the world size: tp always splits over every rank
    sequence_parallel: bool
    loss_parallel: bool


OPTIONS = TpOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="tp", averages_gradients=True, lora=False, compiles=False, holds_gradients=False, tied_gradients=2,
    tiles_loss=True,  # the plans split the blocks' layers only: the output layer is whole on every rank (unless
    #   loss_parallel splits it, which refuses tiled_loss)
    options=option_names(TpOptions),
    summary="tensor parallel: attention heads and MLP columns split over the ranks, one activation all-reduce "
            "per block; every rank reads the same batch",
    arms={"tp": ("strategy.name=tp",), "tp-sp": ("strategy.name=tp", "strategy.sequence_parallel=true"),
          "tp-lossp": ("strategy.name=tp", "strategy.loss_parallel=true")})


class TpRules:
    """What tp is before any process group: its checks, data layout and memory rules (toolkit plan)."""

    def info(self, recipe: Recipe) -> StrategyInfo:
        return INFO

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        degree = options_of(TpOptions, recipe).tp_degree
        if degree is not None and degree != world_size:
            # fsdp's tp_degree is the other reading only for a group size it can make of these ranks
            groups = 1 < degree < world_size and world_size % degree == 0
            raise RecipeError(f"strategy tp splits every layer over all {world_size} ranks, but tp_degree is "
                              f"{degree}; drop tp_degree" + (f", or use strategy.name=fsdp with tp_degree {degree} "
                                                            "for tensor parallel inside groups and FSDP across them"
                                                            if groups else ""))
        tensor_parallel.check_recipe(recipe, degree=world_size)

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        return DataLayout(rank=0, size=1)  # every rank computes on the whole global batch

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        local = of_shapes(tensor_parallel.local_shapes(  # split layers 1/N, the rest whole
            model, world_size, loss_parallel=options_of(TpOptions, recipe).loss_parallel))
        return [adam_state(model.named_parameters(), dtype=DTYPES[recipe.model.load_dtype], local=local)] * world_size

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        return [whole_model_bytes(model, recipe)] * world_size  # every rank builds the whole model: each then keeps its slices of the split layers

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        # the recipe's AdamW; fused (what auto resolves to) makes no copy, the per-tensor loop's temporaries
        # (about 2 x the largest parameter) are not counted
        return [0] * world_size

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        # each rank computes with its own slices (sequence parallelism gathers activations, not weights)
        return [0] * world_size

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        # autocast: the split layers' outputs are in the compute precision, their inputs (norms' outputs) in the
        # weights' (the stream's dtype: comm.tp_collectives)
        options, stored = options_of(TpOptions, recipe), DTYPES[recipe.model.load_dtype]
        # the gradient norm over the split weights' DTensor gradients; the sequence-parallel norms' partial ones
        norms = norm_comm.norm_collectives(norm_comm.by_layout(model, shard=1, tp=world_size,
                                                               loss_parallel=options.loss_parallel), dtype=stored)
        partial = norm_comm.partial_gradient_norms(sequence_parallel_params(model), tp=world_size, dtype=stored) \
            if options.sequence_parallel else []
        return [*tp_collectives(model, tp=world_size, shapes=shapes, activation_dtype=DTYPES[recipe.precision],
                                sequence_parallel=options.sequence_parallel, recompute=recipe.train.recompute != "none",
                                loss_parallel=options.loss_parallel, stream_dtype=stored),
                *norms, *partial]

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        return whole_stack_activations(model, recipe, world_size=world_size, how=how, tp_degree=world_size)


class TpStrategy(TrainsOneModule):
    info = INFO

    def forward_backward(self, micro_batches: list[dict], *, loss_sum: LossSum, share: Share) -> torch.Tensor:
        total = each_micro_batch(self, micro_batches, loss_sum=loss_sum, share=share, device=self.env.device)
        tensor_parallel.sum_partial_gradients(self.partial, self.mesh.get_group(), device=self.env.device)
        return tensor_parallel.first_of_group(total, tp_rank=self.env.rank)

    def forward_only(self, micro_batches: list[dict], *, loss_sum: LossSum) -> tuple[torch.Tensor, int]:
        total, count = forward_once(self, micro_batches, loss_sum=loss_sum, device=self.env.device)
        return (total, count) if self.env.rank == 0 else (torch.zeros_like(total), 0)


    def build_model(self, source: ModelSource, *, env: DistEnv) -> nn.Module:
        return source.whole()

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        options = options_of(TpOptions, args.recipe)
        self.env, self.sequence_parallel = args.env, options.sequence_parallel
        self.loss_parallel = options.loss_parallel
        ensure_process_group(args.env, strategy=self.info.name)
        self.mesh = world_mesh(args.env, degrees(args.recipe, world_size=args.env.world_size), keep=("tp",))
        # tp alone: no data-parallel wrap (every rank computes the whole batch, no gradient to reduce)
        self._model = parallelize(model.to(args.env.device), mesh=self.mesh, env=args.env, units=[],
                                  data_parallel=None, sequence_parallel=self.sequence_parallel,
                                  loss_parallel=self.loss_parallel)
        self.partial = tensor_parallel.partial_gradient_params(self._model)  # Qwen3's q_norm, k_norm, ...
        self.whole_experts = tensor_parallel.whole_experts(self._model)  # MoE experts the plan does not split
        self.amp = Amp(args.recipe.precision, args.env.device)
        # auto: fused, as elsewhere; the split layers (DTensors) and the replicated rest (plain) in groups of their
        # own, since one fused call refuses the mix
        optimizer = args.build_optimizer(self._model)
        self.optim = TorchOptim(optimizer, args.build_scheduler(optimizer), amp=self.amp,
                                names=lambda: first_names(self._model), clip=tensor_parallel.clip_global_norm)
        self.state = TorchState(self._model, self.optim, env=args.env, gathered=True,
                                replicas=self._replicas, gradient_abs_max=self._gradient_abs_max,
                                audit=self._precision_audit)

    @property
    def model(self) -> nn.Module:
        return self._model

    def report(self) -> StrategyReport:
        return StrategyReport(layout=self._layout(), fallback=self._fallback(), measurements=self._measurements())

    def forward_context(self) -> ContextManager:
        return self.amp.autocast()

    def accumulate(self, *, sync: bool) -> ContextManager:
        return no_context()  # no gradient is reduced per micro-batch: nothing to skip (the per-head norms' are
        # summed once, after the last; forward_backward)

    def _replicas(self) -> list[Replicas]:
        named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in self._model.named_parameters()
                                                 if not isinstance(p, DTensor)]
        if not named or self.env.world_size == 1:
            return []
        whole = "embeddings, norms and head"
        if self.loss_parallel:  # the head split; the input embedding with it where tied
            whole = "norms" if head_tied_to_embedding(self._model) else "input embedding and norms"
        if self.whole_experts:
            whole = whole.replace(" and ", ", ") + " and MoE experts"
        return [Replicas(named=named, group=None, description=f"{self.env.world_size} ranks hold the {whole} "
                         "in full")]

    def _gradient_abs_max(self) -> dict[str, float] | None:
        return sharded_abs_max(self._model, self.env)  # each rank saw its shards of the split weights

    def _measurements(self) -> dict:
        return {}

    def _layout(self) -> str:
        rest = "embeddings, norms and head replicated"
        if self.loss_parallel:
            rest = ("head and its tied embedding split over the vocabulary (loss_parallel), norms replicated"
                    if head_tied_to_embedding(self._model)
                    else "head split over the vocabulary (loss_parallel), embeddings and norms replicated")
        experts = " (each MoE layer's experts whole on every rank)" if self.whole_experts else ""
        return (f"attention heads and MLP columns split over {self.env.world_size} ranks{experts}; {rest}"
                + ("; norms computed on sequence shards" if self.sequence_parallel else ""))

    def _fallback(self) -> str | None:
        return None  # runs as itself on any machine

    def close(self) -> None:
        del self._model, self.optim, self.state, self.mesh, self.partial

    def _precision_audit(self) -> dict[str, str]:
        params = list(self._model.parameters())
        master = dtype_name(first_dtype(p.to_local() if isinstance(p, DTensor) else p for p in params))
        compute = master if self.amp.precision == "fp32" else self.amp.precision
        grads = [p.grad for p in params if p.grad is not None]
        return {
            "forward_params": compute if self.amp.precision == "fp32" else f"{compute} (autocast)",
            "master_weights": master + " (split weights sharded)",
            "gradients": dtype_name(first_dtype(grads)) if grads else master,
            "grad_reduction": "none (every rank computes the whole batch); " + tensor_parallel.activation_reduction(
                sequence_parallel=self.sequence_parallel, dtype=compute, stream=master),
            **self.optim.audit(),
        }


RULES = TpRules()


def build(recipe: Recipe) -> TpStrategy:
    return TpStrategy()


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    return Degrees(tp=world_size)
