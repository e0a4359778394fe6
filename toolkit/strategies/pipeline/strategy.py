"""`pipeline`: the model cut into stages by its blocks (split by FLOPs: pipeline/split.py), one stage per rank
(or `stages_per_rank` for the interleaved and V-shaped schedules: pipeline/schedules.py), run by
`torch.distributed.pipelining` (PipelineStage + a schedule). With `pipeline_degree` below the world size
(strategy `hybrid`), the ranks form a (pp × dp) mesh and each stage's replicas are kept in step by DDP or
sharded by FSDP2 over the dp dimension.

The step's accumulation micro-batches are the schedule's micro-batches, padded to one shape per step (micro ×
the step's longest sample rounded up to 8: pipeline/batches.py); the stages and schedule of each padded length are
built at its first step (torch sizes a stage's buffers then) and the last KEPT_SHAPES kept. The loss is computed on
the last stage with the loop's normalisation (sum / the global count, no schedule rescaling: scale_grads=False).
Tied input/output embeddings live twice, on the first and the last stage: their gradients are summed over those
two ranks before clipping (on one rank under a V-shaped schedule), so both copies take the same update (the replica
check compares them over the same group). Clipping uses the norm over every stage (and shard); fp16 skips a step on
every stage alike.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import statistics
import time
from collections import OrderedDict, deque
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from toolkit.data.losses import split_head_loss_sum, vocab_parallel
from toolkit.checkpoint.loading import ModelSource, load_part, materialize
from toolkit.checkpoint.state import Read, load_part_weights
from toolkit.config.parallel import Degrees
from toolkit.config.recipe import Recipe
from toolkit.config.strategy_options import options_of
from toolkit.model import tp_plan as tensor_parallel
from toolkit.model.precision import Amp, StepResult, dtype_name
from toolkit.model.blocks import layer_stack
from toolkit.model.stages import Stage, layout_of, tied_embedding_names
from toolkit.model.tied import tied_aliases
from toolkit.observe.idle import clock_id
from toolkit.process.dist import DistEnv, gather_objects, tensors_on_main, world_mesh
from toolkit.strategies.base import (LossSum, Replicas, SetupArgs, Share, StrategyInfo, StrategyReport, StrategyState,
                                     first_dtype)
from toolkit.strategies.dims import compression
from toolkit.strategies.dims.comm import sequence_parallel_params
from toolkit.strategies.dims.parallelize import DdpWrap, FsdpWrap, parallelize
from toolkit.strategies.pipeline.batches import KEPT_SHAPES, filler, padded_length, stacked
from toolkit.strategies.dims.local_sgd import LocalSgd
from toolkit.strategies.dims.levers import compression_of, local_sgd_of
from toolkit.strategies.pipeline.layout import (Grid, count_busy_time, count_p2p_time, grid_of, head_rows_of,
                                                shared_weight_stages, split_costs, split_how, stage_of_blocks,
                                                uncount_shape_inference)
from toolkit.strategies.pipeline.schedules import SCHEDULES, V_SHAPED, forward_only, simulated_bubbles
from toolkit.strategies.pipeline.split import stage_costs
from toolkit.strategies.pipeline.timing import pin_block_time
from toolkit.strategies.pipeline.rules import INFO, OPTIONS, RULES, PipelineOptions  # noqa: F401 (the registry reads OPTIONS, RULES here)
from toolkit.strategies.optim.torch_optim import TorchOptim, live_state_tensors

STEP_WINDOWS = 256  # the steady steps whose spans run.json's idle is the median of (observe/idle.py)


class PipelineStrategy:
    def __init__(self, info: StrategyInfo = INFO, *, fallback: Callable[[Grid, int], str | None] | None = None):
        """`fallback(grid, world size)`: why a grid runs as something other than `info` names (a preset that
        runs this pipeline, such as hybrid, says when its grid leaves it no replica), or None."""
        self.info, self.fallback_of = info, fallback

    # --- setup ----------------------------------------------------------------------------------

    def build_model(self, source: ModelSource, *, env: DistEnv) -> nn.Module:
        """Empty where the pretrained files or the checkpoint a run resumes from can fill each stage on its own
        (setup reads only the rank's stages' tensors), else whole: a model from a config (its seeded init is the
        whole model's), files transformers would rename or complete."""
        if source.recipe.model.low_memory_loading:
            empty = source.empty()
            if source.checkpoint is not None or source.weight_files(empty) is not None:
                return empty
        return source.whole()

    def setup(self, model: nn.Module, args: SetupArgs) -> None:
        env, options, self.recipe = args.env, options_of(PipelineOptions, args.recipe), args.recipe
        self.env, self.grid = env, grid_of(args.recipe, env.world_size)
        self.pp_rank, self.dp_rank = self.grid.coords(env.rank)
        self.tp_rank = self.grid.tp_rank(env.rank)
        # the stages' replicas: DDP's over dp_replicate, FSDP's over dp_shard (pp outermost, tp innermost, as in the
        # one layout)
        self.dp_dim = self.grid.dp_dim
        self.mesh = world_mesh(env, Degrees(pp=self.grid.pp, tp=self.grid.tp, **{self.dp_dim: self.grid.dp}),
                               keep=("pp", self.dp_dim))
        self.partial: list[nn.Parameter] = []  # the stages' modules each tp rank computes in part (tp_plan)
        layout_of(model, options.blocks)  # a RecipeError for a model that does not show how to cut it
        self.amp = Amp(args.recipe.precision, env.device, scaler_class=self._scaler)
        # split_by time: the loop measured the ratio before it predicted the run's memory; here where it did not
        self.recipe = pin_block_time(args.recipe, env=env)
        parts, num_stages = stage_of_blocks(model, self.recipe, self.grid)
        self.parts, self.num_stages = parts, num_stages
        self.head_rows = head_rows_of(model, self.recipe, self.grid)  # split_head: each stage's rows of the head
        self.split_head = any(r is not None for r in self.head_rows)
        # per token, what the split balanced: the predicted idle's weights
        costs, head = split_costs(model, self.recipe, tp=self.grid.tp, loss_parallel=self.grid.loss_parallel)
        self.stage_flops = stage_costs(costs, head, parts, self.head_rows)
        self.stage_ids = self.grid.stage_ids(self.pp_rank, options.stages_per_rank)
        self.tied = tied_embedding_names(model)
        self.holders = shared_weight_stages(self.head_rows, tied=self.tied is not None)  # copies of a shared weight
        with torch.device("meta"):  # config, class and tied names for the export, without memory
            self.skeleton = type(model)(model.config)
        if self.amp.scaler:  # its scale tensor is made on first use; stages without the loss never scale one
            self.amp.scaler.scale(torch.zeros((), device=env.device))
        self.stage_modules: list[Stage] = []
        self.compression = compression_of(args.recipe)
        local = local_sgd_of(args.recipe)
        self.local_config = local if local.on and self.grid.dp > 1 else None
        self.hooks: list[compression.PowerSgd] = []  # PowerSGD's state, one per DDP-wrapped stage
        wrapped = []
        # build_model left the model empty where the checkpoint or the pretrained files fill each stage on its own
        filler = args.source if args.source is not None and any(p.is_meta for p in model.parameters()) else None
        checkpoint = filler.checkpoint if filler is not None else None
        files = filler.weight_files(model) if filler is not None else None
        aliases = {name: first for name, first in tied_aliases(model).items() if name != first}
        self.loading = (f"each rank read only its stages' tensors from {checkpoint}" if checkpoint else
                        "each rank read only its stages' tensors from the pretrained safetensors files" if files else
                        "every rank built the whole model, then kept its stages")
        for k, stage_id in enumerate(self.stage_ids):
            source = model if k == len(self.stage_ids) - 1 else copy.deepcopy(model)  # each stage prunes a copy
            stage = Stage(source, layer_ids=[i for i, p in enumerate(parts) if p == stage_id], first=stage_id == 0,
                          last=stage_id == num_stages - 1, autocast=self.amp.autocast, blocks=options.blocks,
                          head_rows=self.head_rows[stage_id])
            if filler is not None:
                materialize(stage, device=env.device)
                if checkpoint is not None:  # DCP: each rank calls it once per stage, as many stages on every rank
                    load_part_weights(stage, checkpoint, aliases=aliases)
                else:
                    assert files is not None  # build_model left it empty only where one of the two fills it
                    load_part(stage, files, aliases=aliases)
            else:
                stage.to(env.device)
            self.stage_modules.append(stage)
            wrapped.append(self._replicate(stage, args.recipe))
        self._model = nn.ModuleList(wrapped)
        compression.warn_if_never(self.compression, total_steps=args.total_steps, is_main=env.is_main)
        self.busy_s = self.p2p_s = 0.0  # a step's time computing (stage chunks, the loss), posting sends and receives
        self.micro_batches = args.grad_accum_steps
        # one (stages, schedule) per padded length, built at its first step (batches.padded_length): torch's stages
        # size their receive buffers at their first step and keep them
        self._schedules: OrderedDict[int, tuple[list[Any], Any]] = OrderedDict()
        self.lengths_built: list[int] = []
        self._fresh = False  # this step built its schedule (its shape inference is no steady step's)
        # ShardedGradScaler's found-inf tensor has a shape torch's fused AdamW kernel rejects (torch 2.13)
        optimizer = args.build_optimizer(self._model, fused_ok=args.recipe.precision != "fp16")
        self.optim = TorchOptim(optimizer, args.build_scheduler(optimizer), amp=self.amp, names=self._first_names,
                                clip=self._sync_and_clip)
        self.tied_group = self._tied_group()
        # local SGD: each replica of the pipeline steps alone (no stage is DDP-wrapped), the replicas' parameters
        # averaged over dp every sync_every steps
        self.local = LocalSgd(self._model, self.local_config, optimizer=optimizer, total_steps=args.total_steps,
                              group=self.mesh.get_group(self.dp_dim), across=self.mesh.get_group("pp")) \
            if self.local_config is not None else None
        self.bubbles: list[float] = []  # per steady step: the idle fraction (waiting on other stages)
        self.p2p_fractions: list[float] = []  # and the fraction spent posting sends and receives
        # per steady step (the latest STEP_WINDOWS): (start, end, work, p2p), the host's wall clock; the idle over the
        # span of the pipeline's step is taken from them at the run's end (observe/idle.py)
        self.windows: deque[tuple[float, float, float, float]] = deque(maxlen=STEP_WINDOWS)
        self._loss_sum: LossSum | None = None
        self._share: Share | None = None
        self._sums: list[torch.Tensor] = []

    def _scaler(self, device_type: str):
        # fp16: found-inf all-reduced over every rank, so all stages skip the same steps
        return ShardedGradScaler(device_type, process_group=dist.group.WORLD)

    def _replicate(self, stage: Stage, recipe: Recipe) -> nn.Module:
        """A stage's replicas over the dp dimension: FSDP2 (shards) or DDP (all-reduce); as is without any."""
        wrap: FsdpWrap | DdpWrap | None = None
        if self.grid.sharded:
            # a split backward: a unit resharded after a forward, between a micro-batch's input-gradient and its
            # weight-gradient actions, loses weight gradients (measured, torch 2.13: of 4 stages only the first,
            # whose weight action is a full backward, was exact; the last got none). Kept gathered for the step
            wrap = FsdpWrap(precision=recipe.precision,
                            reshard_after_forward=not self.grid.split_backward)
        elif self.grid.dp > 1 and self.local_config is not None:
            pass  # local SGD: no gradient is reduced; LocalSgd averages the parameters at its syncs
        elif self.grid.dp > 1 and self.grid.split_backward:
            pass  # a split backward takes weight gradients outside DDP's hooks: _average_replicas reduces them
        elif self.grid.dp > 1:
            # every parameter of a stage is used by each of its forwards: no find_unused_parameters, whose search
            # of the autograd graph each forward (and used-map all-reduce each step) bought nothing. torch's
            # schedule reduces a DDP stage's gradients once a step (PipelineStage.backward_maybe_with_nosync);
            # DDP rebuilds its buckets after the first step, as plain ddp's (checked, torch 2.13: gpipe, 1f1b,
            # interleaved-1f1b, a split head, a tied embedding, compression, MoE stages equal single)
            wrap = DdpWrap()
        module = parallelize(stage, mesh=self.mesh, env=self.env, units=list(stage.blocks()), data_parallel=wrap,
                             sequence_parallel=self.grid.sequence_parallel, loss_parallel=self.grid.loss_parallel)
        if self.grid.tp > 1:
            self.partial += tensor_parallel.partial_gradient_params(stage)
        if self.grid.sequence_parallel and not self.grid.sharded:
            # the norms on sequence shards hold partial gradients, summed with the rest once a step (where FSDP
            # shards the replicas, it all-reduces each itself before its reduce-scatter)
            self.partial += sequence_parallel_params(stage)
        if self.grid.loss_parallel:
            tensor_parallel.keep_gradients_split(stage)
        if isinstance(wrap, DdpWrap) and self.compression.on:  # checked: ddp replicas, DDP's own hooks reduce them
            hook = compression.register(module, self.compression,
                                        names={id(p): n for n, p in stage.named_parameters()})
            if hook is not None:
                self.hooks.append(hook)
        return module

    def _tied_group(self):
        """Per replica, the group of the ranks holding a copy of the shared weight (every rank creates every group:
        new_group is collective). None where one rank holds them all (V-shaped schedules: the first and the last
        stage)."""
        holders = set(self.holders)
        pp_ranks = sorted({p for p in range(self.grid.pp) for s in self.grid.stage_ids(p, len(self.stage_ids))
                           if s in holders})
        if len(pp_ranks) < 2:
            return None
        mine = None
        for dp_rank in range(self.grid.dp):
            for tp_rank in range(self.grid.tp):  # the tied copies' whole tensors, or under loss_parallel their rows
                ranks = [self.grid.rank(pp_rank, dp_rank, tp_rank) for pp_rank in pp_ranks]
                group = dist.new_group(ranks)
                if self.env.rank in ranks:
                    mine = group
        return mine

    # --- the step -------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def state(self) -> StrategyState:
        return self  # its checkpoint, export and live tensors are its engine's, read here

    def report(self) -> StrategyReport:
        return StrategyReport(layout=self._layout(), fallback=self._fallback(), measurements=self._measurements())

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn on the last stage: the loop's loss sum, returned as its share (under split_head
        from the stages' log-sum-exp and next-token logit per token, the loop's causal-LM cross-entropy sum)."""
        assert self._loss_sum is not None
        start = time.perf_counter()  # the schedule computes it outside the stage's forward: the stage's work too
        if isinstance(output, tuple):
            micro_sum = split_head_loss_sum(*output, target)
        else:
            micro_sum = self._loss_sum(output, {"labels": target})
        self.busy_s += time.perf_counter() - start
        self._sums.append(micro_sum.detach().double())
        if self._share is None:  # evaluation
            return micro_sum
        share = self._share(micro_sum)
        return self.amp.scaler.scale(share) if self.amp.scaler else share  # fp16: the scale flows back to every stage

    def _schedule(self, length: int) -> tuple[list[Any], Any]:
        """The stages and the schedule that run micro-batches padded to `length`: built at the length's first
        step on every pipeline rank alike (a pipeline's ranks read the same samples), the least recently used
        dropped beyond KEPT_SHAPES (and its buffers with it)."""
        self._fresh = length not in self._schedules
        if not self._fresh:
            self._schedules.move_to_end(length)
            return self._schedules[length]
        from torch.distributed import pipelining

        group = self.mesh.get_group("pp")
        stages = [pipelining.PipelineStage(m, stage_id, self.num_stages, self.env.device, group=group)
                  for m, stage_id in zip(self._model, self.stage_ids)]
        for pipeline_stage in stages:
            count_busy_time(pipeline_stage, self)
            uncount_shape_inference(pipeline_stage)
        kind = getattr(pipelining, SCHEDULES[self.grid.schedule])
        single = issubclass(kind, pipelining.schedules.PipelineScheduleSingle)  # one stage; the others a list
        schedule = kind(stages[0] if single else stages, n_microbatches=self.micro_batches, loss_fn=self._loss,
                        scale_grads=False)
        self._schedules[length] = (stages, schedule)
        self.lengths_built.append(length)
        if len(self._schedules) > KEPT_SHAPES:
            self._schedules.popitem(last=False)
        return stages, schedule

    def _run(self, micro_batches: list[dict], *, train: bool) -> None:
        length = padded_length([int(b["input_ids"].shape[1]) for b in micro_batches],
                               max_length=self.recipe.data.max_length)
        if self.grid.dp > 1:  # replicas read other samples: they agree on one length, so that they build their
            # stages at the same steps (a DDP-wrapped stage's shape inference runs a forward its replicas join)
            agreed = torch.tensor([length], dtype=torch.int64, device=self.env.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.mesh.get_group(self.dp_dim))
            length = int(agreed[0])
        stages, schedule = self._schedule(length)
        ids, mask, labels = stacked(micro_batches, length=length, rows=self.recipe.batch.micro_batch_size,
                                    device=self.env.device)
        first = any(s.is_first for s in stages)
        last = any(s.is_last for s in stages)
        # return_outputs=False: the loss is taken per micro-batch (loss_fn); otherwise the last stage keeps every
        # micro-batch's logits for a merged output nobody reads (measured: 240 MiB on llama-tiny's last stage,
        # held through the step and until the next one)
        call = functools.partial(schedule.step, return_outputs=False) if train else schedule.eval
        self.busy_s, self.p2p_s, start, clock = 0.0, 0.0, time.perf_counter(), time.time()
        # loss_parallel: the last stage's logits are split over the vocabulary; the loss's backward, which the
        # schedule runs inside its step, needs torch's loss_parallel too
        with contextlib.nullcontext() if train else forward_only(schedule), vocab_parallel(self.grid.loss_parallel), \
                count_p2p_time(self):
            call(*((ids,) if first else ()), target=labels if last else None, attention_mask=mask,
                 **({"labels": labels} if self.split_head else {}))  # every stage with rows of the head reads them
        if train and not self._fresh:
            wall = time.perf_counter() - start
            self.bubbles.append(max(0.0, 1.0 - (self.busy_s + self.p2p_s) / wall) if wall > 0 else 0.0)
            self.p2p_fractions.append(self.p2p_s / wall if wall > 0 else 0.0)
            self.windows.append((clock, clock + wall, self.busy_s, self.p2p_s))

    def _recorded(self, count: int) -> torch.Tensor:
        """The loss sums of the last `count` micro-batches: on its first step (and after switching between
        train and eval) the schedule first calls the loss on outputs of empty tensors to infer shapes."""
        real = self._sums[-count:]
        return torch.stack(real).sum() if real else torch.zeros((), dtype=torch.float64)

    def forward_backward(self, micro_batches: list[dict], *, loss_sum: LossSum, share: Share) -> torch.Tensor:
        self._loss_sum, self._share, self._sums = loss_sum, share, []
        self._run(micro_batches, train=True)
        for stage in self.stage_modules:  # split_head: the head's gradient buffer lives for a step (stages._Rows)
            stage._row_gradients.clear()
        if self.grid.dp > 1 and not self.grid.sharded and self.grid.split_backward and self.local is None:
            self._average_replicas()
        if self.grid.tp > 1:
            tensor_parallel.sum_partial_gradients(self.partial, self.mesh.get_group("tp"), device=self.env.device)
        # a stage's tp ranks compute the same loss: its first reports it
        return tensor_parallel.first_of_group(self._recorded(len(micro_batches)), tp_rank=self.tp_rank)

    def _average_replicas(self) -> None:
        """The mean of each stage's gradients over its replicas, one all-reduce per stage, where DDP cannot take
        them: torch's split backward computes the weight gradients with autograd.grad, outside DDP's hooks
        (measured: DDP-wrapped replicas differed after step 1). Every parameter of a stage has a gradient after a
        step (a stage's blocks all run), in the same order on every replica. Under gradient_compression fp16 or
        bf16 sent as torch's DDP hook sends a bucket: cast, divided by the replicas, summed in 16 bits."""
        group = self.mesh.get_group(self.dp_dim)
        wire = compression.WIRE_DTYPES.get(self.compression.kind)
        for stage in self.stage_modules:
            grads = [p.grad for p in stage.parameters() if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            if wire is not None:
                sent = flat.to(wire).div_(self.grid.dp)
                dist.all_reduce(sent, group=group)
                flat.copy_(sent)
            else:
                dist.all_reduce(flat, group=group)
                flat.div_(self.grid.dp)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def forward_only(self, micro_batches: list[dict], *, loss_sum: LossSum) -> tuple[torch.Tensor, int]:
        fillers = self.micro_batches - len(micro_batches)  # a short last group: micro-batches without loss
        group = micro_batches + [filler(micro_batches[0]) for _ in range(fillers)]
        self._loss_sum, self._share, self._sums = loss_sum, None, []
        self._run(group, train=False)
        if not any(s.last for s in self.stage_modules) or self.tp_rank:  # a last stage's first tp rank reports it
            return torch.zeros((), dtype=torch.float64), 0
        return self._recorded(len(group)), sum(int(b["num_items"]) for b in micro_batches)

    def step(self, *, max_grad_norm: float | None) -> StepResult:
        params = [p for p in self._model.parameters() if p.grad is not None]
        result = self.optim.step(params, max_grad_norm=max_grad_norm)
        drift = self._local_step()
        return dataclasses.replace(result, drift_before_sync=drift) if drift is not None else result

    def _local_step(self) -> float | None:
        """Local SGD's side of a step (a sync where one is due: its drift, else None). After a sync the tied
        embedding's two copies are averaged over the tied group: each was averaged over its own stage's replicas,
        whose sums can round apart in the last bit with 3 replicas or more."""
        if self.local is None:
            return None
        drift = self.local.after_step()
        if self.local.synced and self.tied_group is not None:  # two copies (split_head refuses local SGD)
            copies = [w for w in (s.tied_weight() for s in self.stage_modules) if w is not None]
            with torch.no_grad():
                for weight in copies:
                    dist.all_reduce(weight.data, group=self.tied_group)
                    weight.data.div_(2)
        return drift

    def _sync_and_clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Sum the tied embedding's two gradients, then clip every gradient by the norm over all stages
        (each tensor counted once: the tied copy on the last stage is left out of the norm), as
        clip_grad_norm_ does on one process: coefficient max_norm / (norm + 1e-6), at most 1."""
        duplicates = {id(p) for p in self._sync_tied()}
        # each element counted once: stages hold different tensors; along tp (and along dp where fsdp shards the
        # replicas) a rank counts what it holds a shard of, and what it holds whole where it is that dimension's
        # first rank (the embeddings, norms and head every tp rank holds)
        along = [("tp", self.tp_rank)] + ([(self.dp_dim, self.dp_rank)] if self.grid.sharded else [])
        local = [_local(p.grad) for p in params if p.grad is not None and id(p) not in duplicates
                 and all(_spans(p.grad, dim) or index == 0 for dim, index in along)]
        squares = torch.zeros((), dtype=torch.float32, device=self.env.device)
        if local:
            # in fp32 whatever the gradients' dtype (bf16 weights): summed over up to every rank, as planned (4 bytes)
            squares = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in local])) ** 2
        # ddp replicas hold the same whole stages: each replica's pipeline sums its own over pp
        group = None if self.grid.sharded or self.grid.tp > 1 else self.mesh.get_group("pp")
        dist.all_reduce(squares, group=group)
        total = squares.sqrt()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                _local(p.grad).mul_(coefficient)
        return total

    def _sync_tied(self) -> list[torch.Tensor]:
        """Sum the gradients of a shared weight's copies (this rank's, then over the tied group), each copy then
        holding the sum; the copies to leave out of the norm: all but the first holding stage's."""
        holders = self.holders
        if not holders:
            return []
        mine = [(stage_id, s.tied_weight()) for stage_id, s in zip(self.stage_ids, self.stage_modules)]
        copies = [(stage_id, w) for stage_id, w in mine if w is not None]
        grads = [_local(w.grad) for _, w in copies if w.grad is not None]
        if grads:  # V-shaped: this rank holds two copies (identically sharded under fsdp)
            for grad in grads[1:]:
                grads[0].add_(grad)
            if self.tied_group is not None:
                dist.all_reduce(grads[0], group=self.tied_group)
            for grad in grads[1:]:
                grad.copy_(grads[0])
        return [w for stage_id, w in copies if stage_id != holders[0]]

    def discard_step(self) -> StepResult:
        self.optim.discard_step()
        # a dropped step counts toward local SGD's syncs (replicated.ReplicatedStrategy.discard_step)
        return StepResult.dropped(drift_before_sync=self._local_step())

    def lr(self) -> float:
        return self.optim.lr()

    # --- what the run reports -------------------------------------------------------------------
    def replicas(self) -> list[Replicas]:
        """A stage's DDP replicas over dp, then the tied embedding's two copies (first and last stage: two
        optimizers update them, kept equal only by the gradient sum in _sync_tied) over the tied group. V-shaped
        schedules hold both copies on one rank, which gives both the summed gradient: no group to check them over."""
        found = []
        if self.grid.dp > 1 and not self.grid.sharded:
            named: list[tuple[str, torch.Tensor]] = [(n, p) for s in self.stage_modules
                                                     for n, p in s.named_parameters()]
            local = self.local
            how = (f"local SGD, equal after each sync (every {local.config.every} steps)" if local is not None else
                   "gradients averaged after the schedule" if self.grid.split_backward else "DDP")
            found.append(Replicas(named=named, group=self.mesh.get_group(self.dp_dim),
                                  description=f"{self.grid.dp} replicas of each stage ({how})",
                                  synced=(lambda: local.synced) if local is not None else None))
        if self.grid.tp > 1:  # what tensor parallel keeps whole (a row-wise layer's Replicate bias too): the same
            # on each of a stage's tp ranks
            whole = [(n, _local(p)) for s in self.stage_modules for n, p in s.named_parameters()
                     if not _spans(p, "tp")]  # under fsdp a rank's shard of it: the same at each tp position
            found.append(Replicas(named=whole, group=self.mesh.get_group("tp"),
                                  description=f"{self.grid.tp} tensor-parallel ranks of each stage hold its "
                                              f"{self._held_whole()} in full"))
        copies = [w for w in (s.tied_weight() for s in self.stage_modules) if w is not None]
        if self.tied is not None and self.tied_group is not None:
            first, last = self.tied  # this rank's copies are equal: compared over the group, its first
            # one name on both ranks, so that a drift names the pair alike on each; under fsdp both ranks
            # of a tied group sit at the same dp position and hold the same shard
            whose = "each pipeline's" if self.grid.dp > 1 else "the"
            where = "first stage and those with rows of the head" if self.split_head else "first and last stage"
            found.append(Replicas(named=[(f"{first} = {last} (tied)", _local(copies[0]))], group=self.tied_group,
                                  description=f"the tied {first} and {last} on {whose} {where}"))
        elif self.tied_group is not None:  # split_head: an untied head's copies
            name = self.stage_modules[0].head_path if self.stage_modules[0].head_rows is not None else "the head"
            found.append(Replicas(named=[(f"{name}.weight", _local(copies[0]))], group=self.tied_group,
                                  description="the head's copies on the stages with rows of it"))
        return found

    def gradient_abs_max(self) -> dict[str, float] | None:
        mine: dict[str, float] = {}
        for stage in self.stage_modules:
            for name, param in stage.named_parameters():
                if param.grad is not None:
                    value = float(_local(param.grad).abs().max()) if _local(param.grad).numel() else 0.0
                    mine[name] = max(mine.get(name, 0.0), value)
        merged: dict[str, float] = {}
        for ranks in gather_objects(mine, self.env):  # each rank holds other tensors (and shards of them)
            for name, value in ranks.items():
                merged[name] = max(merged.get(name, 0.0), value)
        scale = self.amp.scaler.get_scale() if self.amp.scaler else 1.0
        return {name: value / scale for name, value in merged.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: every stage's weights under the whole model's names, on rank 0 (each stage's first
        replica sends them, point to point: rank 0 holds the whole model once, the others nothing beyond their
        stages; gathering the state dicts as pickled objects to every rank held ~3.6× the model on every rank)."""
        mine: dict[str, torch.Tensor] = {}
        for stage, wrapped in zip(self.stage_modules, self._model):
            if isinstance(wrapped, FSDPModule):
                # every dp rank gathers the stage (cpu_offload=True would keep it on global rank 0 only)
                options = StateDictOptions(full_state_dict=True)  # collective over dp
                state = cast(dict[str, torch.Tensor], get_model_state_dict(wrapped, options=options))
            else:  # tensor-parallel stages: the split weights gathered over the stage's tp ranks (a collective
                # each, in one order on every rank), kept by the first tp rank alone, one tensor at a time
                state = {}
                for k, v in stage.state_dict().items():
                    whole = v.full_tensor() if isinstance(v, DTensor) else v
                    if self.tp_rank == 0:
                        state[k] = whole
            if self.dp_rank == 0 and self.tp_rank == 0:
                mine.update({k: v.detach() for k, v in state.items()})
        return tensors_on_main(mine, self.env)  # a tied weight: the first stage's copy (rank 0's)

    def export_module(self) -> nn.Module:
        return self.skeleton

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return live_state_tensors(self._model, self.optim, communication=self._communication())

    def precision_audit(self) -> dict[str, str]:
        params = list(self._model.parameters())
        stored = first_dtype(_local(p) for p in params)
        grads = [p.grad for p in params if p.grad is not None]
        compute_dtype = dtype_name(stored) if self.amp.precision == "fp32" else self.amp.precision
        compute = compute_dtype if self.amp.precision == "fp32" else f"{compute_dtype} (autocast)"
        reduce = ("reduce-scatter mean" if self.grid.sharded else f"all-reduce mean over {self.grid.dp} replicas") \
            if self.grid.dp > 1 else "none: one replica per stage"
        if self.local is not None:
            reduce = f"none: {self.local.config.describe()}"
        return {
            "forward_params": compute,
            "master_weights": dtype_name(stored),
            "gradients": dtype_name(first_dtype(grads)) if grads else dtype_name(stored),
            "grad_reduction": f"{reduce} ({dtype_name(first_dtype(grads) or stored)}"
                              f"{', ' + self.compression.describe() if self.compression.on else ''})"
                              if self.grid.dp > 1 and self.local is None else reduce,
            **self.optim.audit(before_state=stored, scaler="ShardedGradScaler over all stages"),
            # fsdp replicas compute on their MixedPrecisionPolicy's cast: the stream is in the compute dtype too
            # (collectives.predict's `flowing`), autocast's keeps the weights' dtype
            **({"tensor_parallel": tensor_parallel.activation_reduction(
                sequence_parallel=self.grid.sequence_parallel,
                stream=compute_dtype if self.grid.sharded else dtype_name(stored),
                dtype=compute_dtype)} if self.grid.tp > 1 else {}),
        }

    def _held_whole(self) -> str:
        """What every tp rank of a stage holds whole besides the norms (loss_parallel splits the head, and a tied
        embedding with it)."""
        if not self.grid.loss_parallel:
            return "embeddings, norms and head"
        return "norms" if self.tied is not None else "input embedding and norms"

    def _layout(self) -> str:
        options = options_of(PipelineOptions, self.recipe)
        replicas = f" × {self.grid.dp} replicas ({self.grid.dp_kind})" if self.grid.dp > 1 else ""
        if self.grid.tp > 1:
            split = "the head and its tied embedding" if self.tied is not None else "the head"
            whole = f"{self._held_whole()} whole" + (f", {split} split over the vocabulary (loss_parallel)"
                                                     if self.grid.loss_parallel else "")
            replicas += (f" × {self.grid.tp} tensor-parallel ranks each (attention heads and MLP columns split; "
                         f"{whole}{'; norms computed on sequence shards' if self.grid.sequence_parallel else ''})")
        return (f"{self.num_stages} stages over {self.grid.pp} ranks{replicas}, schedule {options.schedule} with "
                f"{self.micro_batches} micro-batches; "
                f"{self.grid.stages_by_rank(self.parts, options.stages_per_rank, self.head_rows)}"
                f"; {split_how(self.recipe)}; weights: {self.loading}")

    def _fallback(self) -> str | None:
        return self.fallback_of(self.grid, self.env.world_size) if self.fallback_of is not None else None

    def checkpoint_tensors(self) -> dict[str, dict[str, Any]]:
        model: dict[str, Any] = {}
        for stage in self.stage_modules:  # the stages keep the model's own names
            model.update(stage.state_dict())
        if self.tied is not None:
            model.pop(self.tied[1], None)  # the head's copy of the tied embedding: the first stage saves it
        return {"model": model, "optim": self.optim.checkpoint_tensors()}

    def load_optimizer_state(self, read: Read) -> None:
        self.optim.load_state(read)
        # a rank's copies of a shared weight (V-shaped: the tied embedding's two; split_head: one per stage with
        # rows) go by one name, read into the first in the optimizer's order (state.optimizer_tensors): the others
        # take its state, as they take its updates
        copies = {id(w) for w in (s.tied_weight() for s in self.stage_modules) if w is not None}
        optimizer = self.optim.optimizer
        order = [p for group in optimizer.param_groups for p in group["params"] if id(p) in copies]
        with torch.no_grad():
            for other in order[1:]:
                for key, value in optimizer.state[order[0]].items():
                    if torch.is_tensor(value):
                        optimizer.state[other][key].copy_(value)
                    else:
                        optimizer.state[other][key] = value

    def _first_names(self) -> dict[int, str]:
        """Each parameter's name in the whole model; the last stage's copy of a tied embedding goes by the
        input embedding's name (its gradient, so its Adam state, equals the first stage's)."""
        names = {id(p): n for stage in self.stage_modules for n, p in stage.named_parameters()}
        if self.tied is not None:
            for stage in self.stage_modules:
                weight = stage.tied_weight()
                if weight is not None:
                    names[id(weight)] = self.tied[0]
        return names

    def checkpoint_extra(self) -> dict[str, Any]:
        return self.optim.checkpoint_extra()

    def _communication(self) -> compression.HookStates | LocalSgd | None:
        """What this rank's replicas keep across steps: PowerSGD's state of each stage (its error and Q factors),
        or local SGD's (this rank's own parameters and optimizer state between syncs)."""
        if self.local is not None:
            return self.local
        return compression.HookStates(self.hooks) if self.hooks else None

    def communication_state(self) -> bytes | None:
        kept = self._communication()
        return kept.state_bytes() if kept is not None else None

    def load_communication_state(self, read: Callable[[], bytes | None]) -> None:
        kept = self._communication()
        blob = read() if kept is not None else None
        if kept is not None and blob is not None:  # a checkpoint of a run without it starts it afresh
            kept.load_bytes(blob)

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        self.optim.load_checkpoint_extra(extra)

    def _measurements(self) -> dict[str, Any]:
        steady = self.bubbles  # steps that built their length's stages (shape inference) are left out
        # the median: one step run otherwise (step 3 counts collectives in a dispatch mode) does not move it
        return {"stages": self.stage_ids,
                # the lengths micro-batches were padded to, each the first time it was built (training and
                # evaluation alike): how often the stages' buffers were made anew
                "padded_lengths_built": self.lengths_built,
                "bubble_measured": statistics.median(steady) if steady else None,
                "p2p_measured": statistics.median(self.p2p_fractions) if self.p2p_fractions else None,
                # the above over the rank's own schedule call; at the run's end over the span of the pipeline's step
                # (observe/idle.py: the ranks that step together, on one host's clock)
                "step_windows": list(self.windows), "span_group": self.grid.coords(self.env.rank)[1],
                "host": clock_id(),
                "bubble_theory": simulated_bubbles(self.grid.schedule, pp=self.grid.pp,
                                                   stages_per_rank=len(self.stage_ids),
                                                   micro_batches=self.micro_batches)[self.pp_rank],
                # the same order with each stage's actions as long as its FLOPs: the idle this split leaves
                "bubble_predicted": simulated_bubbles(self.grid.schedule, pp=self.grid.pp,
                                                      stages_per_rank=len(self.stage_ids),
                                                      micro_batches=self.micro_batches,
                                                      stage_costs=self.stage_flops)[self.pp_rank]}

    def close(self) -> None:
        del self._schedules, self._model, self.stage_modules, self.optim
        del self.mesh, self.tied_group, self.partial


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _spans(tensor: torch.Tensor, dim: str) -> bool:
    """A DTensor sharded along the mesh dimension `dim` (tp: a split weight; dp_shard: an FSDP shard): the ranks
    along it hold different parts. FSDP2 over a tp-split dim 0 places a _StridedShard, which is no Shard (and whose
    is_shard() is False, torch 2.13)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return dim in names and isinstance(tensor.placements[names.index(dim)], (Shard, _StridedShard))


def build(recipe: Recipe) -> PipelineStrategy:
    return PipelineStrategy()


def degrees(recipe: Recipe, *, world_size: int) -> Degrees:
    grid = grid_of(recipe, world_size)  # the one reading of the stages and their tp ranks
    return Degrees(pp=grid.pp, tp=grid.tp)
