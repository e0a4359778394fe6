"""`fsdp`: FSDP2 (`fully_shard`, DTensor parameters). Each transformer block is one shard unit, then the root.

Memory vs speed knobs (recipe `strategy.*`):
  reshard_after_forward  True: free gathered block params after forward, gather again in backward
                         (ZeRO-3-like); False: keep them until backward (ZeRO-2-like, more memory)
  cpu_offload            sharded params, grads and optimizer step on CPU
  replicate_degree       >1: HSDP, a 2-D mesh (replicate × shard): shard within a group, all-reduce across;
                         with tp_degree or cp_degree too, each group is the FSDP (× tp, or over dp_shard × cp)
                         below, the mesh dp_replicate × dp_shard × tp or dp_replicate × dp_shard_cp
  sync_every             >1 with replicate_degree: local SGD over the replica groups (dims/local_sgd.py): each
                         group an FSDP of its own over dp_shard (no all-reduce across groups), each rank's shards
                         averaged with the same shards of the other groups every sync_every steps
  tp_degree              >1: tensor parallel inside groups of that many ranks (model/tp_plan.py), FSDP over
                         the groups (HSDP with replicate_degree): a 2-D mesh (dp × tp) composed as torchtitan
                         does (TP first, then fully_shard over dp); the ranks of a TP group read the same batch

Precision: parameters are stored (and updated) in the load dtype; `precision: bf16|fp16` sets
MixedPrecisionPolicy.param_dtype for compute and reduces gradients in fp32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ContextManager, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from toolkit.checkpoint.loading import ModelSource, load_sharded, materialize, whole_model_bytes
from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import option_names, options_of, strategy_options
from toolkit.cost.collectives import Collective
from toolkit.errors import RecipeError
from toolkit.memory.state_bytes import (LocalNumel, StateBytes, adam_state, dim0_held, dim0_shard, dim0_shard_of,
                                        element_bytes)
from toolkit.model import tp_plan as tensor_parallel
from toolkit.model.blocks import transformer_blocks
from toolkit.model.precision import DTYPES, Amp, StepResult, dtype_name
from toolkit.model.tied import first_names, head_tied_to_embedding
from toolkit.process.dist import DistEnv, ensure_process_group, world_mesh
from toolkit.strategies.base import (DataLayout, LossSum, Replicas, SetupArgs, Share, StrategyInfo, StrategyReport,
                                     each_micro_batch, every_rank_a_shard, first_dtype, forward_once, no_context,
                                     refuse_untested,
                                     sharded_abs_max, whole_stack_activations)
from toolkit.strategies.dims import comm, context, expert, norm_comm
from toolkit.strategies.dims.compression import check_reduce_dtype
from toolkit.strategies.dims.levers import LocalSgdOptions, local_sgd_of
from toolkit.strategies.dims.local_sgd import LocalSgd, local_sgd_collectives, outer_state
from toolkit.strategies.dims.parallelize import FsdpWrap, parallelize
from toolkit.strategies.optim.torch_optim import TorchOptim, TorchState, TrainsOneModule

@strategy_options
class FsdpOptions(LocalSgdOptions):
    """The strategy.<option> keys fsdp reads (their defaults and trade-offs: docs/recipe-keys.md): local SGD's over
    HSDP's replica groups (dims/levers.py) and FSDP's own."""

    reshard_after_forward: bool
    cpu_offload: bool
    replicate_degree: int  # > 1: HSDP (parallel.dp_replicate)
    blocks: tuple[str, ...] | None
    tp_degree: int | None  # > 1: fsdp × tp (parallel.tp)
    cp_degree: int | None  # > 1: context parallel, FSDP over dp_shard × cp (parallel.cp)
    ep_degree: int | None  # > 1: expert parallel, the experts split over ep ranks, FSDP over the rest (parallel.ep)
    sequence_parallel: bool
    loss_parallel: bool
    reduce_dtype: str | None  # fp32 | bf16 (MixedPrecisionPolicy.reduce_dtype); None: fp32


OPTIONS = FsdpOptions  # the registry reads it by this name


INFO = StrategyInfo(
    name="fsdp", averages_gradients=True, tiles_loss=True, accelerate_plugin="fsdp", casts_parameters=True,
    holds_gradients=False,
    options=option_names(FsdpOptions),
    summary="FSDP2 fully_shard per block: params, grads, optimizer state sharded 1/N; all-gathers per block",
    arms={"fsdp": ("strategy.name=fsdp",),
          "fsdp-noreshard": ("strategy.name=fsdp", "strategy.reshard_after_forward=false"),
          "fsdp-offload": ("strategy.name=fsdp", "strategy.cpu_offload=true"),
          "fsdp-bf16reduce": ("strategy.name=fsdp", "strategy.reduce_dtype=bf16"),
          "hsdp-localsgd4": ("strategy.name=fsdp", "strategy.replicate_degree=2", "strategy.sync_every=4"),
          "fsdp-tp2": ("strategy.name=fsdp", "strategy.tp_degree=2"),
          "fsdp-cp2": ("strategy.name=fsdp", "strategy.cp_degree=2"),  # parallel.cp_method's, allgather by default
          "fsdp-cp2-ulysses": ("strategy.name=fsdp", "strategy.cp_degree=2", "parallel.cp_method=ulysses"),
          "fsdp-cp2-ring": ("strategy.name=fsdp", "strategy.cp_degree=2", "parallel.cp_method=ring"),
          # HSDP's 2 replica groups, each FSDP over its ranks with tp (cp) inside: 4 ranks or more
          "hsdp-tp2": ("strategy.name=fsdp", "strategy.replicate_degree=2", "strategy.tp_degree=2"),
          "hsdp-cp2": ("strategy.name=fsdp", "strategy.replicate_degree=2", "strategy.cp_degree=2"),
          "fsdp-ep2": ("strategy.name=fsdp", "strategy.ep_degree=2")})


class FsdpRules:
    """What fsdp is before any process group: its checks, data layout and memory rules (toolkit plan)."""

    def info(self, recipe: Recipe) -> StrategyInfo:
        return INFO

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        options = options_of(FsdpOptions, recipe)
        replicate = options.replicate_degree
        if replicate < 1:
            raise RecipeError("strategy.replicate_degree must be >= 1")
        check_reduce_dtype(options.reduce_dtype)
        if world_size % replicate:
            raise RecipeError(f"strategy.replicate_degree {replicate} does not divide world size {world_size}")
        check_local_sgd(recipe, options)
        tp = options.tp_degree
        cp = options.cp_degree
        if cp is not None and cp < 1:
            raise RecipeError(f"strategy.cp_degree must be >= 1, got {cp}; leave it unset for FSDP alone")
        if cp is not None and cp > 1:
            if options.sequence_parallel or options.loss_parallel:  # not tested together yet
                raise RecipeError("strategy.cp_degree (context parallel) is tested with dp_shard, tp_degree and "
                                  "replicate_degree, not with strategy.sequence_parallel or strategy.loss_parallel "
                                  "yet; choose one")
            if replicate > 1 and (tp or 1) > 1:
                raise RecipeError("strategy.cp_degree with both strategy.replicate_degree and tp_degree is not tested "
                                  "yet; drop one of them")
            if replicate > 1 and local_sgd_of(recipe).on:
                raise RecipeError("strategy.cp_degree with local SGD over HSDP's replica groups is not tested yet; "
                                  "drop strategy.sync_every or strategy.cp_degree")
            if replicate > 1:  # cp alone: context.check_recipe's line
                check_divides(world_size, ("cp_degree", cp), ("replicate_degree", replicate))
            context.check_recipe(recipe, cp=cp, tp=tp or 1, world_size=world_size)
        ep = options.ep_degree
        if ep is not None and ep < 1:
            raise RecipeError(f"strategy.ep_degree must be >= 1, got {ep}; leave it unset for FSDP alone")
        if ep is not None and ep > 1:
            if replicate > 1 or (tp or 1) > 1 or (cp or 1) > 1:  # not tested together yet
                raise RecipeError("strategy.ep_degree (expert parallel) is tested with dp_shard alone, not with "
                                  "strategy.replicate_degree, tp_degree or cp_degree yet; choose one")
            expert.check_recipe(recipe, ep=ep, world_size=world_size,
                                key="parallel.ep" if recipe.parallel.ep else "strategy.ep_degree")
        if tp is not None and tp < 1:  # 0 would silently mean fsdp alone, a negative one a negative mesh
            raise RecipeError(f"strategy.tp_degree must be >= 1, got {tp}; leave it unset for FSDP alone")
        if tp is not None and tp > 1:
            if replicate > 1 and local_sgd_of(recipe).on:
                raise RecipeError("strategy.tp_degree with local SGD over HSDP's replica groups is not tested yet; "
                                  "drop strategy.sync_every or strategy.tp_degree")
            check_divides(world_size, ("tp_degree", tp), ("replicate_degree", replicate))
            tensor_parallel.check_recipe(recipe, degree=tp)
            refuse_untested(recipe, layout="strategy.tp_degree", drop="strategy.tp_degree",
                            lora_why="peft wraps the linear layers the tensor-parallel plan splits",
                            compile_why="torch.compile fails on DTensor-split blocks with a RecursionError",
                            selective_tested=True)
        elif options.sequence_parallel or options.loss_parallel:
            key = "sequence_parallel" if options.sequence_parallel else "loss_parallel"
            raise RecipeError(f"strategy.{key} needs tensor parallelism: set strategy.tp_degree (2 or more)")
        if recipe.precision == "fp16" and recipe.optim.implementation == "fused":
            raise RecipeError("optim.implementation fused cannot run under fsdp in fp16 (torch's ShardedGradScaler "
                              "hands the fused AdamW kernel a found-inf tensor of the wrong shape); use auto or loop")

    def data_layout(self, recipe: Recipe, *, world_size: int, rank: int) -> DataLayout:
        options = options_of(FsdpOptions, recipe)
        group = (options.tp_degree or 1) * (options.cp_degree or 1)  # a TP or CP group (neighbours) reads one shard
        return every_rank_a_shard(world_size=world_size // group, rank=rank // group)

    def predict_state_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[StateBytes]:
        # parameters stay in their load dtype (MixedPrecisionPolicy casts a block's copy for compute only);
        # gradients are reduced into that dtype; AdamW state alike. CPU offload moves the bytes, not their count.
        # Each rank's optimizer moments are made like its unpadded shard (dim0_held): where a dim 0 does not divide,
        # the last shards' moments are smaller than their padded parameter and gradient storage.
        options, dtype = options_of(FsdpOptions, recipe), DTYPES[recipe.model.load_dtype]
        tp, ep = options.tp_degree or 1, options.ep_degree or 1
        shard = world_size // (tp * options.replicate_degree)  # FSDP's dim-0 parts of each (tp-split) weight
        shapes = tensor_parallel.local_shapes(model, tp, loss_parallel=options.loss_parallel) if tp > 1 else None
        if tp > 1:
            local = dim0_shard_of(cast(dict, shapes), shard)
        elif ep > 1:  # each rank's experts, FSDP-sharded over the ranks holding the same ones
            local = expert.local_numel(model, ep=ep, world_size=world_size)
        else:
            local = dim0_shard(shard)

        def held(rank: int) -> LocalNumel:
            if ep > 1:
                return expert.local_numel(model, ep=ep, world_size=world_size, rank=rank)
            return dim0_held(shard, shard_index(rank, tp=tp, shard=shard), shapes)
        return outer_state([adam_state(model.named_parameters(), dtype=dtype, local=local, moments=held(rank))
                            for rank in range(world_size)], local_sgd_of(recipe))  # HSDP's DiLoCo: its shards

    def predict_load_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           resuming: bool = False) -> list[int]:
        whole = whole_model_bytes(model, recipe)
        if not recipe.model.low_memory_loading:
            return [whole] * world_size
        if resuming:  # each rank reads its shards of the checkpoint into the empty model (load_sharded)
            return [0] * world_size
        rank0 = ModelSource(recipe=recipe, tokenizer=None).weight_files(model) is None
        return [whole if rank0 else 0] + [0] * (world_size - 1)  # see load_sharded

    def predict_step_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                           device_type: str) -> list[int]:
        # the recipe's AdamW; fused (what auto resolves to) makes no copy, the per-tensor loop's temporaries
        # (about 2 x the largest parameter) are not counted
        return [0] * world_size

    def predict_gathered_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int) -> list[int]:
        # FSDP2 computes with one unit (block) gathered while it gathers the next (its implicit prefetch), and
        # keeps the root's parameters (those in no block: the embedding, final norm, an untied head) gathered from
        # forward to backward: it does not reshard the root after forward (measured: +119 MiB, a 30522 x 1024 fp32
        # embedding, for the whole step). reshard_after_forward false keeps every unit gathered until its
        # backward: the whole model
        # Expert parallel: the experts are units of their own inside the blocks; a rank gathers only its 1/ep of
        # them, from the ranks holding the same ones (none where efsdp is 1: each holds its experts whole).
        options, compute = options_of(FsdpOptions, recipe), element_bytes(DTYPES[recipe.precision])
        ep = options.ep_degree or 1
        experts, expert_sizes = expert.expert_units(model) if ep > 1 else (set(), [])
        blocks = transformer_blocks(model, options.blocks)
        units = [sum(p.numel() for p in block.parameters() if id(p) not in experts) for block in blocks]
        everything = sum(p.numel() for p in model.parameters()) - sum(expert_sizes)  # a tied weight once
        tp = options.tp_degree or 1  # a block's split layers hold 1/tp of it on each rank
        gathered_experts = max(expert_sizes, default=0) // ep if world_size > ep else 0
        if tp > 1 and options.loss_parallel:  # the root's head (and a tied embedding) hold 1/tp of the vocabulary
            head = cast(Any, model).get_output_embeddings().weight.numel()
            everything -= head - head // tp
        if not options.reshard_after_forward:
            held = everything - sum(units) + sum(units) // tp + len(blocks) * gathered_experts
        else:
            held = everything - sum(units) + 2 * max(units, default=0) // tp + 2 * gathered_experts
        return [held * compute] * world_size

    def predict_collectives(self, model: nn.Module, recipe: Recipe, *, world_size: int, rank: int,
                            shapes: list[tuple[int, int]]) -> list[Collective]:
        # FSDP over dp_shard (× cp: one dimension), after tp's and cp's own (dims/comm.py)
        options = options_of(FsdpOptions, recipe)
        tp, cp, ep, replicate = (options.tp_degree or 1, options.cp_degree or 1, options.ep_degree or 1,
                                 options.replicate_degree)

        stored = DTYPES[recipe.model.load_dtype]
        compute = stored if recipe.precision == "fp32" else DTYPES[recipe.precision]  # MixedPrecisionPolicy
        reduce = FsdpWrap(precision=recipe.precision, reduce_dtype=options.reduce_dtype).mp_policy.reduce_dtype \
            or stored  # what MixedPrecisionPolicy reduces in (None: the parameters' own dtype)
        shapes_tp = tensor_parallel.local_shapes(model, tp, loss_parallel=options.loss_parallel) if tp > 1 else None
        units = comm.fsdp_units(model, transformer_blocks(model, options.blocks))
        gathers = len(shapes) * (2 if options.reshard_after_forward else 1)
        if ep > 1:  # the experts modules are FSDP units of their own over efsdp, the blocks shard what is left
            return expert_parallel_collectives(model, units, recipe, world_size=world_size, ep=ep, shapes=shapes,
                                               compute=compute, reduce=reduce, gathers=gathers)
        recompute = recipe.train.recompute != "none"  # selective: refused with cp, ep
        shard = world_size // (tp * replicate)
        local_sgd = local_sgd_of(recipe)  # the replica groups' all-reduce replaced by their syncs
        # a cp rank's blocks see its part of each sequence (dims/context.py)
        local = [(rows, context.local_length(length, cp=cp)) for rows, length in shapes] if cp > 1 else shapes
        sp_norms = comm.sequence_parallel_norms(model, tp=tp, reduce_dtype=reduce) \
            if tp > 1 and options.sequence_parallel else []
        # the gradient norm: every gradient a DTensor sharded over FSDP's ranks, the split ones over tp too
        norms = norm_comm.norm_collectives(norm_comm.by_layout(
            model, shard=shard, tp=tp, loss_parallel=options.loss_parallel, sequence_parallel=options.sequence_parallel,
            shard_dim="dp_shard_cp" if cp > 1 else "dp_shard"), dtype=stored)
        return [*comm.tp_collectives(model, tp=tp, shapes=local, activation_dtype=compute,
                                     sequence_parallel=options.sequence_parallel, recompute=recompute, shard=shard,
                                     loss_parallel=options.loss_parallel, stream_dtype=compute,
                                     shard_index=shard_index(rank, tp=tp, shard=shard)),
                *norms,
                *sp_norms,
                *comm.CP_COLLECTIVES[recipe.parallel.cp_method](
                    model, cp=cp, tp=tp, shapes=shapes, activation_dtype=compute, recompute=recompute),
                *comm.fsdp_collectives(units, shard=shard, replicate=1 if local_sgd.on else replicate,
                                       compute_dtype=compute, reduce_dtype=reduce, gathers_per_unit=gathers,
                                       local_shape=(lambda name, p: shapes_tp[name]) if shapes_tp else None,
                                       shard_group="dp_shard_cp" if cp > 1 else "dp_shard"),
                *(hsdp_local_sgd_collectives(model, recipe, shard=shard, replicate=replicate, rank=rank)
                  if local_sgd.on else []),
                *(comm.fp16_scaler_collectives(world_size=world_size, dtensors=True)
                  if recipe.precision == "fp16" else [])]

    def predict_activation_bytes(self, model: nn.Module, recipe: Recipe, *, world_size: int,
                                 how: dict[str, Any]) -> list[int]:
        options = options_of(FsdpOptions, recipe)
        cp, tp = options.cp_degree or 1, options.tp_degree or 1
        if cp > 1:
            return context.activation_bytes(model, recipe, world_size=world_size, how=how, cp=cp, tp=tp)
        return whole_stack_activations(model, recipe, world_size=world_size, how=how, tp_degree=tp)


class FsdpStrategy(TrainsOneModule):
    info = INFO

    def forward_backward(self, micro_batches: list[dict], *, loss_sum: LossSum, share: Share) -> torch.Tensor:
        if self.cp is not None:  # each rank its share of every sequence (strategies/dims/context.py)
            total = context.each_micro_batch(self, micro_batches, loss_sum=loss_sum, share=share,
                                             device=self.env.device, group=self.cp)
        else:
            total = each_micro_batch(self, micro_batches, loss_sum=loss_sum, share=share, device=self.env.device)
        if self.partial:  # after FSDP's reduce-scatter over dp (the sums commute): Qwen3's q_norm, k_norm, ...
            tensor_parallel.sum_partial_gradients(self.partial, self.mesh.get_group("tp"), device=self.env.device)
        return tensor_parallel.first_of_group(total, tp_rank=self.env.rank % self.tp_degree)

    def forward_only(self, micro_batches: list[dict], *, loss_sum: LossSum) -> tuple[torch.Tensor, int]:
        if self.cp is not None:
            total, count = context.forward_once(self, micro_batches, loss_sum=loss_sum, device=self.env.device,
                                                group=self.cp)
        else:
            total, count = forward_once(self, micro_batches, loss_sum=loss_sum, device=self.env.device)
        return (total, count) if self.env.rank % self.tp_degree == 0 else (torch.zeros_like(total), 0)


    def build_model(self, source: ModelSource, *, env: DistEnv) -> nn.Module:
        # low-memory loading: shard the empty model, then each rank loads its shards (setup)
        return source.empty() if source.recipe.model.low_memory_loading else source.whole()

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        options, env = options_of(FsdpOptions, args.recipe), args.env
        self.env, self.precision = env, args.recipe.precision
        ensure_process_group(env, strategy=self.info.name)  # the device mesh needs one, even for one rank
        self.tp_degree, self.sequence_parallel = options.tp_degree or 1, options.sequence_parallel
        self.loss_parallel = options.loss_parallel
        # one mesh in the layout's order: dp_replicate, dp_shard (its groups' ranks the furthest apart), cp, tp
        self.mesh = world_mesh(env, degrees(args.recipe, world_size=env.world_size), keep=("dp_shard",))
        self.cp: context.Group | None = None
        if (options.cp_degree or 1) > 1:  # the model attends through context parallel's attention
            self.cp = context.Group(group=self.mesh.get_group("cp"), size=self.mesh["cp"].size(),
                                    rank=self.mesh["cp"].get_local_rank())
            self.cp_method = args.recipe.parallel.cp_method
            context.use_on(model, method=self.cp_method)
        self.ep_degree = options.ep_degree or 1
        experts = expert.expert_mesh(env, self.ep_degree) if self.ep_degree > 1 else None
        local = local_sgd_of(args.recipe)  # local SGD over HSDP's replica groups: each group an FSDP of its own
        wrap = FsdpWrap(precision=self.precision, reshard_after_forward=options.reshard_after_forward,
                        cpu_offload=options.cpu_offload, reduce_dtype=options.reduce_dtype, replicas_apart=local.on)
        self.mp_policy = wrap.mp_policy
        empty = any(p.is_meta for p in model.parameters())  # build_model left it empty: shard first, then load
        if not options.cpu_offload and not empty:
            model.to(env.device)
        # tp (when the mesh has it), then FSDP over dp_shard (× cp), or HSDP over (dp_replicate, dp_shard)
        parallelize(model, mesh=self.mesh, env=env, units=transformer_blocks(model, options.blocks),
                    data_parallel=wrap, sequence_parallel=options.sequence_parallel,
                    loss_parallel=options.loss_parallel, expert_mesh=experts)
        self.loading = "every rank built the whole model, then kept its shards"
        if empty:  # offloaded shards live on the CPU
            assert args.source is not None  # build_model left the model empty: the source fills it
            materialize(model, device=torch.device("cpu") if options.cpu_offload else env.device)
            self.loading = load_sharded(model, args.source, env=env)
        self._model = model
        self.partial = tensor_parallel.partial_gradient_params(model) if self.tp_degree > 1 else []
        # MoE experts the tp plan leaves whole on each tp rank (the layout and the replica check say so)
        self.whole_experts = self.tp_degree > 1 and tensor_parallel.whole_experts(model)
        # ShardedGradScaler's found-inf tensor has a shape torch's fused AdamW kernel rejects (torch 2.13)
        optimizer = args.build_optimizer(model, fused_ok=self.precision != "fp16")
        # fp16: ShardedGradScaler all-reduces found-inf, so every rank (each seeing only its gradient
        # shards) skips the same steps. Autocast stays off: MixedPrecisionPolicy casts inside each unit.
        self.amp = Amp(self.precision, env.device, scaler_class=ShardedGradScaler)
        self.optim = TorchOptim(optimizer, args.build_scheduler(optimizer), amp=self.amp,
                                names=lambda: first_names(self._model),
                                clip=(tensor_parallel.clip_global_norm  # DTensors on several meshes
                                      if self.tp_degree > 1 or self.ep_degree > 1 else clip_sharded))
        # local SGD over HSDP's replica groups: each rank's shards averaged with the same shards of the other
        # groups every sync_every steps; the drift is the whole replica's, its shards' sums added up
        self.local = LocalSgd(model, local, optimizer=optimizer, total_steps=args.total_steps,
                              group=self.mesh.get_group("dp_replicate"),
                              across=self.mesh.get_group("dp_shard") if self.mesh["dp_shard"].size() > 1 else None,
                              local=lambda tensor: cast(DTensor, tensor).to_local()) if local.on else None
        self.state = TorchState(self._model, self.optim, env=args.env, gathered=True,
                                replicas=self._replicas, gradient_abs_max=self._gradient_abs_max,
                                audit=self._precision_audit, communication=self.local)

    @property
    def model(self) -> nn.Module:
        return self._model

    def report(self) -> StrategyReport:
        return StrategyReport(layout=self._layout(), fallback=self._fallback(), measurements=self._measurements())

    def forward_context(self) -> ContextManager:
        return no_context()  # MixedPrecisionPolicy casts parameters inside each shard unit

    def accumulate(self, *, sync: bool) -> ContextManager:
        # no reduce-scatter on non-final micro-batches: unsharded grads accumulate locally
        cast(FSDPModule, self._model).set_requires_gradient_sync(sync)
        return no_context()

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        result = super().step(max_grad_norm=max_grad_norm)
        drift = self.local.after_step() if self.local is not None else None
        return dataclasses.replace(result, drift_before_sync=drift) if drift is not None else result

    def discard_step(self) -> StepResult:
        result = super().discard_step()
        drift = self.local.after_step() if self.local is not None else None  # a dropped step counts (replicated.py)
        return dataclasses.replace(result, drift_before_sync=drift) if drift is not None else result

    def _replicas(self) -> list[Replicas]:
        out: list[Replicas] = []
        if self.tp_degree > 1:  # the ranks of a TP group hold the same shards of what TP does not split
            named = [(n, cast(DTensor, p).to_local()) for n, p in self._model.named_parameters()
                     if "tp" not in (cast(DTensor, p).device_mesh.mesh_dim_names or ())]
            what = "norm and embedding"
            if self.loss_parallel:  # the head split over tp; the input embedding with it where tied
                what = "norm" if head_tied_to_embedding(self._model) else "norm and input embedding"
            if self.whole_experts:
                what = what.replace(" and ", ", ") + " and MoE expert"
            if named:
                out.append(Replicas(named=named, group=self.mesh.get_group("tp"),
                                    description=f"the {self.tp_degree} ranks of each TP group hold the same {what} "
                                                "shards"))
        if "dp_replicate" not in (self.mesh.mesh_dim_names or ()):
            return out  # every rank holds a different shard (or only its TP group's copies)
        # HSDP: the ranks at one position of the shard (and tp) dimensions hold the same shards, one per replica group
        named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in self._model.named_parameters()]
        size, local = self.mesh["dp_replicate"].size(), self.local
        return [*out, Replicas(named=named, group=self.mesh.get_group("dp_replicate"),
                               description=f"{size} replica groups hold identical shards"
                               + (f" after each sync (local SGD every {local.config.every} steps)" if local else ""),
                               synced=(lambda: local.synced) if local is not None else None)]

    def _gradient_abs_max(self) -> dict[str, float] | None:
        return sharded_abs_max(self._model, self.env, scale=self.amp.scaler.get_scale() if self.amp.scaler else 1.0)

    def _measurements(self) -> dict:
        return {}

    def _layout(self) -> str:
        shape = " × ".join(f"{n} {name}" for n, name in zip(self.mesh.shape, self.mesh.mesh_dim_names or ()))
        layout = f"every block and the root sharded over a mesh of {shape}"
        if self.tp_degree > 1:
            layout += " (attention heads and MLP columns split over tp"
            layout += ", MoE experts whole on each tp rank" if self.whole_experts else ""
            layout += ", the head (and a tied embedding) over the vocabulary" if self.loss_parallel else ""
            layout += ", norms on sequence shards)" if self.sequence_parallel else ")"
        if self.ep_degree > 1:
            layout += (f" (each MoE layer's experts split over {self.ep_degree} ranks, tokens sent to them by "
                       f"all-to-all; the ranks holding the same experts shard them)")
        if self.cp is not None:
            layout += f" (each sequence split over the {self.cp.size} ranks of cp, attention by {self.cp_method})"
        if self.local is not None:
            layout += f" ({self.local.config.describe()} over the replica groups)"
        return f"{layout}; weights: {self.loading}"

    def _fallback(self) -> str | None:
        return None  # runs as itself on any machine

    def close(self) -> None:
        # their groups, for destroy_process_group
        del self._model, self.optim, self.state, self.mesh, self.partial, self.cp, self.local

    def _precision_audit(self) -> dict[str, str]:
        params = list(self._model.parameters())
        stored = first_dtype(p.to_local() if hasattr(p, "to_local") else p for p in params)
        grads = [p.grad for p in params if p.grad is not None]
        reduce = self.mp_policy.reduce_dtype or self.mp_policy.param_dtype or stored
        return {
            "forward_params": dtype_name(self.mp_policy.param_dtype or stored),
            "master_weights": dtype_name(stored) + " (sharded, = load dtype)",
            "gradients": dtype_name(first_dtype(grads)) if grads else dtype_name(stored),
            "grad_reduction": f"reduce-scatter mean ({dtype_name(reduce)})" + (
                f" within each replica group, none across them: {self.local.config.describe()}"
                if self.local is not None else "") + (
                f" within each replica group, then all-reduced across the {self.mesh['dp_replicate'].size()} groups"
                if self.local is None and "dp_replicate" in (self.mesh.mesh_dim_names or ()) else "") + (
                "; " + tensor_parallel.activation_reduction(
                    sequence_parallel=self.sequence_parallel, dtype=dtype_name(self.mp_policy.param_dtype or stored),
                    over=" over tp") if self.tp_degree > 1 else ""),
            **self.optim.audit(before_state=stored, scaler="ShardedGradScaler"),
        }


def clip_sharded(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over DTensor gradient shards; the norm comes back replicated (a collective)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def check_divides(world_size: int, *degrees: tuple[str, int]) -> None:
    """The product of the strategy options' degrees (those above 1; the first always) divides the world, or one line
    naming them: 'strategy.tp_degree 2 × replicate_degree 2 does not divide world size 2; use ... a multiple of 4'."""
    given = [degrees[0], *(d for d in degrees[1:] if d[1] > 1)]
    product = math.prod(value for _, value in given)
    if world_size % product:
        named = " × ".join(f"{key} {value}" for key, value in given)
        raise RecipeError(f"strategy.{named} does not divide world size {world_size}; use a world size that is a "
                          f"multiple of {product}")


def check_local_sgd(recipe: Recipe, options: FsdpOptions) -> None:
    """Local SGD averages whole replicas: HSDP's replica groups (each shards a whole model), never the shards of one."""
    local = local_sgd_of(recipe)
    local.check(compression="none", precision=recipe.precision)
    if not local.on:
        return
    key = "parallel.dp_replicate" if recipe.parallel.given else "strategy.replicate_degree"
    if options.replicate_degree < 2:
        raise RecipeError(f"strategy.sync_every {local.every} averages replicas, and fsdp without {key} holds none "
                          f"(every rank a different shard of one model); set {key} to 2 or more (HSDP: local SGD "
                          "over its replica groups), or use strategy ddp")
    if options.cpu_offload:
        raise RecipeError("strategy.sync_every over HSDP is not checked with strategy.cpu_offload yet; drop one of "
                          "them")


def expert_parallel_collectives(model: nn.Module, units: list, recipe: Recipe, *, world_size: int, ep: int,
                                shapes: list[tuple[int, int]], compute, reduce, gathers: int) -> list[Collective]:
    """FSDP over the world for the dense units (each block without its experts, the root), over efsdp for each
    experts module (its 1/ep of the experts on dim 0), and the token all-to-alls (comm.ep_collectives)."""
    from toolkit.observe.routing import DISPATCH, STACKED, plan_of

    plan = plan_of(model)
    modules = dict(model.named_modules())
    expert_units = [list(modules[name].named_parameters(prefix=name)) for name, style in plan.items()
                    if style == DISPATCH]
    inside = {id(p) for unit in expert_units for _, p in unit}
    dense = [[(n, p) for n, p in unit if id(p) not in inside] for unit in units]
    efsdp = world_size // ep

    def held(name: str, param: nn.Parameter) -> tuple[int, ...]:  # an experts weight: this rank's experts
        return (param.shape[0] // ep, *param.shape[1:]) if plan.get(name) == STACKED else tuple(param.shape)

    stored = DTYPES[recipe.model.load_dtype]
    # the gradient norm: the dense gradients sharded over the world, the experts' over efsdp and ep (norm_comm)
    stacked = expert.expert_units(model)[0]  # the experts weights; the routers are dense
    expert_count = sum(1 for p in model.parameters() if p.requires_grad and id(p) in stacked)
    dense_count = sum(1 for p in model.parameters() if p.requires_grad) - expert_count
    norms = norm_comm.norm_collectives({"dense": (dense_count, (("dp_shard", world_size),)),
                                        "experts": (expert_count, (("efsdp", efsdp), ("ep", ep)))}, dtype=stored)
    experts = [dataclasses.replace(c, group="efsdp") for c in comm.fsdp_collectives(
        expert_units, shard=efsdp, replicate=1, compute_dtype=compute, reduce_dtype=reduce,
        gathers_per_unit=gathers, local_shape=held)]
    return [*comm.fsdp_collectives(dense, shard=world_size, replicate=1, compute_dtype=compute, reduce_dtype=reduce,
                                   gathers_per_unit=gathers),
            *experts,
            *comm.ep_collectives(model, ep=ep, shapes=shapes, activation_dtype=compute,
                                 recompute=recipe.train.recompute != "none"),
            *norms]


def hsdp_local_sgd_collectives(model: nn.Module, recipe: Recipe, *, shard: int, replicate: int,
                               rank: int) -> list[Collective]:
    """At a sync (the step counted): `rank`'s own shards (unpadded: what to_local holds) averaged over the replica
    groups with the drift's norms; the drift's sums added up over the replica's shards."""
    local = local_sgd_of(recipe)
    held = dim0_held(shard, rank % shard)  # mesh (dp_replicate, dp_shard): the place within its replica group
    numel = sum(held(name, p) for name, p in model.named_parameters() if p.requires_grad)
    out = local_sgd_collectives(numel * element_bytes(DTYPES[recipe.model.load_dtype]), local, group_size=replicate)
    if shard > 1:
        out.append(Collective(op="allreduce_", payload_bytes=16, calls=1, group="dp_shard", group_size=shard,
                              phase="step", what="the drift's two float64 sums, over the replica's shards",
                              every=local.every))
    return out


RULES = FsdpRules()


def build(recipe: Recipe) -> FsdpStrategy:
    return FsdpStrategy()


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    options = options_of(FsdpOptions, recipe)
    replicate, tp, cp = options.replicate_degree, options.tp_degree or 1, options.cp_degree or 1
    return Degrees(dp_replicate=replicate, dp_shard=world_size // (replicate * tp * cp), cp=cp, tp=tp,
                   ep=options.ep_degree or 1)


def shard_index(rank: int, *, tp: int, shard: int) -> int:
    """Which of FSDP's `shard` dim-0 parts a rank holds. Mesh (dp_shard, tp): the tp ranks of a shard are
    neighbours; HSDP's (dp_replicate, dp_shard): a rank's shard is its place within its replica group."""
    return rank // tp % shard
