"""The recipe's `strategy:` section (StrategyConfig), and each strategy's own options dataclass: the typed subset of
its keys that strategy reads.

A strategy module declares one (`@strategy_options class FsdpOptions: reshard_after_forward: bool ...`) and reads
its options through it (`options_of(FsdpOptions, recipe)`), never the whole section. The recipe parses one
`strategy:` section (StrategyConfig, below), which holds each key once: its type, its default
and what it trades (docs/recipe-keys.md is generated from it), so an options dataclass holds fields without
defaults, each of StrategyConfig's type: `strategy_options` checks that as the class is made. Its field names are
the strategy's StrategyInfo.options, which the registry reads to refuse, in one line, an option set for a
strategy that ignores it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from toolkit.config.typed import PATH

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    name: str = "single"  # see `toolkit strategies`
    # ddp
    find_unused_parameters: bool = False  # ddp: needed when some parameters get no gradient
    bucket_cap_mb: float = 25.0  # ddp: gradient bucket size; bigger buckets, fewer all-reduces
    gradient_compression: str = "none"  # ddp, and hybrid's pipeline stages' ddp replicas (one hook per stage):
    #   none | fp16 | bf16 (each bucket cast to 16 bits for its all-reduce: half the bytes, ~3 significant digits
    #   for bf16) | powersgd (each gradient matrix sent as a rank-powersgd_rank factor pair, the error kept and
    #   added back next step): changes the maths on purpose; compare judges it "differs by design" within a loss
    #   budget
    powersgd_rank: int = 4  # ddp, hybrid with gradient_compression=powersgd: the factors' rank; (n + m)·r numbers
    #   per n×m matrix instead of n·m; a matrix for which that saves less than half is sent whole
    powersgd_start_step: int = 10  # ddp, hybrid with gradient_compression=powersgd: optimizer steps with plain
    #   all-reduce before compression starts (at least 2: DDP fixes its buckets after the first); torch advises
    #   ~10 % of the run
    sync_every: int = 1  # ddp, hybrid's pipeline stages' ddp replicas, fsdp's HSDP replica groups (replicate_degree
    #   >= 2): > 1 = local SGD: the replicas step alone on their own gradients (none is all-reduced across them)
    #   and average their parameters every sync_every steps and at the last: 1/sync_every of the bytes, the
    #   replicas drifting apart in between (the replica check reports by how much); changes the maths
    outer_optimizer: str = "average"  # ddp, hybrid, fsdp with sync_every > 1: average (local SGD) | nesterov
    #   (DiLoCo: the average's move since the last sync taken as an outer gradient, SGD with Nesterov momentum)
    outer_lr: float | None = None  # ddp, hybrid, fsdp with outer_optimizer=nesterov: the outer step's rate (default
    #   0.7, DiLoCo's)
    outer_momentum: float = 0.9  # ddp, hybrid, fsdp with outer_optimizer=nesterov: the outer step's momentum
    # fsdp
    reshard_after_forward: bool = True  # fsdp: True frees gathered params after forward (ZeRO-3-like, less memory, one more all-gather)
    cpu_offload: bool = False  # fsdp: keep sharded params/grads/optimizer on CPU (much less device memory, slower)
    replicate_degree: int = 1  # fsdp: >1 = HSDP, replicate over this many groups, shard within each (hf_native:
    #   transformers' dp_replicate_size)
    reduce_dtype: str | None = None  # fsdp, zero: the dtype gradients are reduced in: fp32 | bf16 (half the bytes,
    #   the sum kept to ~3 significant digits: changes the maths on purpose; compare judges it "differs by design").
    #   Unset: fsdp fp32, zero DeepSpeed's default (the compute dtype: bf16 under precision bf16)
    blocks: tuple[str, ...] | None = None  # fsdp: class names to shard one by one; default: model._no_split_modules
    # tp, fsdp
    tp_degree: int | None = None  # fsdp: >1 = tensor parallel inside groups of this many ranks, FSDP across the
    #   groups (a 2-D mesh dp × tp; HSDP across them with replicate_degree); tp: every rank (leave unset). Less
    #   memory per rank than fsdp alone for big layers, but an activation all-reduce per attention and MLP block:
    #   keep a group inside one node (hf_native: transformers' tp_size; pipeline: each stage over this many ranks,
    #   world / tp_degree stages; hybrid with data_parallel fsdp: each stage over this many ranks, their slices
    #   FSDP-sharded over the stage's replicas)
    cp_degree: int | None = None  # fsdp: > 1 = context parallel, each sequence split over groups of this many
    #   neighbouring ranks, FSDP over all of them (torchtitan's dp_shard × cp; with replicate_degree, over those of
    #   each replica group); parallel.cp_method says how
    ep_degree: int | None = None  # fsdp: > 1 = expert parallel, each MoE layer's experts split over groups of this
    #   many neighbouring ranks (tokens reach them by all-to-all), FSDP-sharded over the ranks holding the same ones
    #   (hf_native: transformers' ep_size)
    sequence_parallel: bool = False  # tp, fsdp with tp_degree, pipeline/hybrid with tp_degree (each stage): norms and
    #   residuals on sequence shards between the split layers (Llama-style decoders): less activation memory, the
    #   blocks' bytes moved as before (two gathers a micro-batch more: the final norm's output and the embedding
    #   output's gradient; pipeline stages send and receive 1/tp of the sequence, gathering nothing between them)
    loss_parallel: bool = False  # tp, fsdp with tp_degree, pipeline/hybrid with tp_degree (the last stage's head, a
    #   first stage's tied embedding): a causal LM's output layer (and a tied embedding) split over the vocabulary,
    #   the loss reduced across the ranks (torchtitan's loss_parallel): a rank holds 1/N of the logits and of those
    #   weights, for three [tokens] all-reduces in the loss, one of the head's input gradient (a reduce-scatter
    #   under sequence_parallel) and, where tied, one of the embedding's output
    # zero
    stage: int | None = None  # zero: 0 = plain DP, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters (default 2)
    offload_optimizer: bool = False  # zero: optimizer state and step on CPU (DeepSpeed CPU Adam)
    offload_param: bool = False  # zero: stage 3 only, parameters on CPU between uses
    # zero: an existing DeepSpeed JSON used as it is; "auto" values come from this recipe
    ds_config: str | None = field(default=None, metadata=PATH)
    # model_parallel, pipeline, hybrid
    devices: tuple[str, ...] | None = None  # model_parallel/hybrid: the devices one process splits its model over
    #   (e.g. [cuda:0, cuda:1]; `cpu` may repeat: same code path and boundaries). hybrid: local rank r uses
    #   the next len(devices) GPUs (cuda:r·n + i)
    split: tuple[int, ...] | None = None  # block index where each later device / stage starts; default: devices
    #   (model_parallel) balanced by parameter count (embeddings count with the first part, the final norm and head
    #   with the last); pipeline stages balanced by forward + backward FLOPs (the head's on the last stage)
    schedule: str = "1f1b"  # pipeline: gpipe (all forwards, then all backwards: most activation memory) |
    #   1f1b (one forward, one backward: at most `stages` micro-batches in flight) | interleaved-1f1b
    #   (stages_per_rank virtual stages per rank: a smaller bubble, more point-to-point traffic) |
    #   interleaved-zb (zero bubble, ZB1P: each backward split into its input gradient, on the critical path, and
    #   its weight gradient, which fills the bubble; 1 or more stages per rank) | zbv (zero bubble, V-shaped: rank
    #   r holds stages r and 2p-1-r, so rank 0 holds the first and the last) | dualpipev (DeepSeek's DualPipe,
    #   V-shaped, a forward overlapped with a backward; at least 2p micro-batches)
    split_head: bool = False  # pipeline/hybrid: the output layer's rows of the vocabulary split over the stage of the
    #   last block and the stages after it (those hold rows only), so that each stage costs about the same FLOPs
    #   where the head outweighs a stage's share (a small model with a large vocabulary); each token's log-sum-exp
    #   and next-token logit pass from stage to stage with the final norm's output (causal LMs; not with tp_degree)
    split_by: str = "flops"  # pipeline/hybrid stages: flops (balance forward + backward FLOPs counted from the
    #   model's shapes) | time (each rank times one block and rows of the head at the micro-batch's shape at setup;
    #   the blocks' FLOPs are weighted by how much slower a block runs per FLOP than the head, as its norms,
    #   softmax and activations are memory-bound: the layout line gives the ratio)
    block_time_ratio: float | None = None  # split_by time: this ratio instead of a measured one (the same split
    #   every run, and toolkit plan predicts it; a run's layout line gives the ratio it measured)
    stages_per_rank: int = 1  # pipeline: 2 or more for interleaved-1f1b; 1 or more for interleaved-zb; exactly
    #   2 for zbv and dualpipev
    pipeline_degree: int | None = None  # hybrid: pipeline stages; the other ranks are data-parallel replicas
    #   (world = pipeline_degree × replicas); unset: a model split inside each process (devices) × ddp.
    #   pipeline: every rank is a stage
    data_parallel: str = "ddp"  # hybrid: ddp (full stage replicas, all-reduce) | fsdp (each stage sharded over
    #   its replicas)
    # the name and the options are checked by the strategy registry (toolkit.strategies.validate_strategy)


class _Recipe(Protocol):  # toolkit.config.recipe.Recipe, which holds this section
    @property
    def strategy(self) -> StrategyConfig: ...


_SECTION = {f.name: f for f in dataclasses.fields(StrategyConfig)}


def strategy_options(cls: type[T]) -> type[T]:
    """Make `cls` a frozen keyword-only dataclass of strategy keys; each field must be a StrategyConfig key of the
    same type, without a default of its own (StrategyConfig's is the one default)."""
    made = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    for f in dataclasses.fields(made):  # type: ignore[arg-type]
        declared = _SECTION.get(f.name)
        assert declared is not None and f.name != "name", f"{cls.__name__}.{f.name}: not a strategy.<option> key"
        assert _spelled(f.type) == _spelled(declared.type), (
            f"{cls.__name__}.{f.name}: {_spelled(f.type)}, but the recipe's is {_spelled(declared.type)}")
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (
            f"{cls.__name__}.{f.name}: the default lives in StrategyConfig only")
    return made


def _spelled(annotation: object) -> str:
    """An annotation as source spells it: a string under `from __future__ import annotations`, a type without."""
    if isinstance(annotation, str):
        return annotation
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


@strategy_options
class NoOptions:
    """A strategy that reads no strategy.<option> key (single, dp)."""


def option_names(options: type) -> tuple[str, ...]:
    """The strategy.<option> keys an options dataclass holds, in its order."""
    return tuple(f.name for f in dataclasses.fields(options))


def options_of(options: type[T], recipe: _Recipe) -> T:
    """The recipe's values of the keys `options` holds."""
    return options(**{name: getattr(recipe.strategy, name) for name in option_names(options)})
