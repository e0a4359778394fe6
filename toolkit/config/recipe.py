"""Recipes: typed, frozen dataclasses, loaded from YAML with `--set a.b=c` overrides by toolkit/config/files.py.

Every key is declared here; an unknown key or a value of the wrong type is a
RecipeError naming the key and the fix, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from toolkit.config.strategy_options import StrategyConfig
from toolkit.config.typed import PATH
from toolkit.errors import RecipeError


PRECISIONS = ("fp32", "bf16", "fp16")
TASKS = ("sequence-classification", "causal-lm")
SCHEDULES = ("cosine", "linear", "constant")
TRACKERS = ("tensorboard", "mlflow")
CHECKPOINTING = ("full", "selective")  # train.activation_checkpointing's names beside true and false
CHECKPOINTING_WORDS = "false, true (the same as full) or selective"


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """LoRA adapters through peft: only they train (and hold gradients and optimizer state); the base is frozen."""

    r: int = 8  # adapter rank: r × (in + out) trainable parameters per adapted layer
    alpha: int = 16  # the adapter's output is scaled by alpha / r
    dropout: float = 0.0  # on the adapter's input; 0.0 for runs compared across strategies
    target_modules: tuple[str, ...] | None = None  # layer names to adapt (e.g. [q_proj, v_proj]); null: peft's default
    merge_on_export: bool = False  # true: output_dir/model-merged: W + (alpha/r)·B·A as a plain model

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise RecipeError(f"model.lora.r must be a positive rank, got {self.r}; 8 or 16 are usual")
        if self.alpha <= 0:
            raise RecipeError(f"model.lora.alpha must be > 0, got {self.alpha}; 2 × r is usual")
        _require(0.0 <= self.dropout < 1.0, "model.lora.dropout", self.dropout, "in [0, 1)")
        if self.target_modules is not None and not self.target_modules:  # peft would adapt its default layers
            raise RecipeError("model.lora.target_modules is empty: name the layers to adapt (e.g. [q_proj, v_proj]), "
                              "or leave it out for peft's default for this model")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # a local HF folder, or pkg://<package>/<subdir> for a model a package ships
    path: str | None = field(default=None, metadata=PATH)
    config: dict | None = None  # a from-scratch model: transformers config fields incl. model_type
    tokenizer: str | None = field(default=None, metadata=PATH)  # tokenizer folder (pkg:// allowed); default: `path`
    task: str = "sequence-classification"  # sequence-classification | causal-lm
    num_labels: int = 2  # classification head size (sequence-classification only)
    load_dtype: str = "fp32"  # dtype the weights are loaded in; FSDP computes from these, ZeRO keeps fp32 masters
    # override every dropout probability for this run (its export and checkpoints keep the model's own rates);
    # 0.0 for runs compared across strategies
    dropout: float | None = None
    lora: LoraOptions | None = None  # LoRA adapters (peft): far fewer trainable parameters, same forward shape
    # strategies that shard parameters (fsdp, zero stage 3) build the model empty and load only each rank's
    # part of the weights: no rank holds the whole model (fsdp: rank 0 does for a model from a config or with
    # LoRA, and broadcasts it). false: every rank builds the whole model first, as replicating strategies do
    low_memory_loading: bool = True

    def __post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise RecipeError("model: give exactly one of model.path (a local HF folder) or model.config (a from-scratch config)")
        if self.config is not None and "model_type" not in self.config:
            raise RecipeError("model.config needs a model_type (e.g. llama, bert)")
        if self.config is not None and self.tokenizer is None:
            raise RecipeError("model.config needs model.tokenizer: a folder with a tokenizer (pkg:// allowed)")
        _choice("model.task", self.task, TASKS)
        _choice("model.load_dtype", self.load_dtype, ("fp32", "bf16", "fp16"))
        # transformers builds an id2label entry per class: 2**31 of them exhaust any host's memory
        _require(0 < self.num_labels <= 2**20, "model.num_labels", self.num_labels, "1..2**20 (one head row per class)")
        if self.dropout is not None:
            _require(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "in [0, 1), or null to keep the model's")


DATA_FORMATS = ("text", "chat", "prompt-response")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    # a json/jsonl/csv/tsv/parquet/txt file (also .gz, .bz2, .xz, .zst), a folder of such shards, or a folder written
    # by datasets' save_to_disk (a DatasetDict: its train split; for eval its validation, eval or test split)
    train: str = field(metadata=PATH)
    # held-out data, the same kinds; eval loss (+ accuracy / perplexity) every eval_every
    eval: str | None = field(default=None, metadata=PATH)
    # text: train on text_column (classification: with label_column). Instruction tuning (causal-lm), the loss on
    # the response tokens only: chat (messages_column: lists of {role, content}, rendered by the tokenizer's chat
    # template) | prompt-response (prompt_column, response_column)
    format: str = "text"
    text_column: str = "text"
    label_column: str | None = "label"  # sequence-classification: class ids, or names (mapped in sorted order)
    messages_column: str = "messages"  # format chat
    prompt_column: str = "prompt"  # format prompt-response
    response_column: str = "response"  # format prompt-response
    # format chat: a Jinja template (its text, or the path of a .jinja file) for a tokenizer that has none (or to
    # replace it)
    chat_template: str | None = None
    max_length: int = 128  # tokens per sample; longer ones are cut (the run says how many tokens that dropped)
    # causal-lm: documents tokenized whole, their stream cut into full max_length blocks (no padding, no cut)
    packing: bool = False
    num_workers: int = 0  # DataLoader workers per rank
    pin_memory: bool = False  # pinned host memory: faster host-to-GPU copies, costs page-locked RAM

    def __post_init__(self) -> None:
        _positive("data.max_length", self.max_length)
        # far beyond any model's context; past 64 bits the tokenizer cannot even take the number
        _require(self.max_length < 2**31, "data.max_length", self.max_length, "below 2**31 tokens")
        _choice("data.format", self.format, DATA_FORMATS)
        if self.num_workers < 0:
            raise RecipeError("data.num_workers must be >= 0")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 5.0e-5
    weight_decay: float = 0.01  # not applied to biases and norm weights
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    # linear warm-up: step k of w (0-based) at (k+1)/(w+1) of lr, so no step is wasted at lr 0 (transformers'
    # get_*_schedule_with_warmup: k/w, its first step at 0); after it the schedules are transformers' own
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | linear | constant, after warm-up, down to min_lr_ratio × lr
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0  # clip the global grad norm; null disables clipping
    # AdamW's step: fused (one kernel, fastest) | foreach (batched, fast on GPU) | loop (per tensor) |
    # auto: the fastest every parameter of the run supports. Arms of a compare should run the same one:
    # each is a different order of float operations (results agree to rounding, not bit for bit)
    implementation: str = "auto"

    def __post_init__(self) -> None:
        _choice("optim.schedule", self.schedule, SCHEDULES)
        _choice("optim.implementation", self.implementation, ("auto", "fused", "foreach", "loop"))
        _require(0 < self.lr < math.inf, "optim.lr", self.lr, "a finite number > 0, e.g. 1e-4")
        _require(0 <= self.weight_decay < math.inf, "optim.weight_decay", self.weight_decay, "a finite number >= 0")
        _require(0 <= self.eps < math.inf, "optim.eps", self.eps, "a finite number >= 0, e.g. 1e-8")
        _require(all(0 <= beta < 1 for beta in self.betas), "optim.betas", list(self.betas),
                 "two numbers in [0, 1), e.g. [0.9, 0.999]")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        if self.max_grad_norm is not None:
            _require(0 <= self.max_grad_norm < math.inf, "optim.max_grad_norm", self.max_grad_norm,
                     "a finite number >= 0 (0 or null: no clipping)")
        if self.warmup_steps < 0:
            raise RecipeError("optim.warmup_steps must be >= 0")


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    micro_batch_size: int = 8  # samples per rank per forward/backward
    # micro-batches per optimizer step; null (the default): derived from global_batch_size, 1 without it
    grad_accum_steps: int | None = None
    global_batch_size: int | None = None  # samples per optimizer step over all ranks; checked against the others

    def __post_init__(self) -> None:
        _positive("batch.micro_batch_size", self.micro_batch_size)
        if self.grad_accum_steps is not None:
            _positive("batch.grad_accum_steps", self.grad_accum_steps)
        if self.global_batch_size is not None:
            _positive("batch.global_batch_size", self.global_batch_size)


DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
CP_METHODS = ("allgather", "ulysses", "ring")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The run's parallel degrees on one device mesh (toolkit/config/parallel.py). Set, they choose the layout
    on their own, with no strategy.name: world = dp_replicate × dp_shard × cp × tp × pp."""

    dp_replicate: int | None = None  # full replicas, gradients all-reduced (DDP); with dp_shard: HSDP's replica
    #   groups (the all-reduce crosses groups, the sharding traffic stays inside one: a group per node)
    dp_shard: int | None = None  # FSDP2: parameters, gradients and optimizer state sharded 1/N within a replica;
    #   unset: the ranks the other degrees leave (as torchtitan's -1)
    tp: int | None = None  # tensor parallel: attention heads and MLP columns split (an activation all-reduce per
    #   block: keep a group inside one node); strategy.sequence_parallel for the norms
    pp: int | None = None  # pipeline stages, a contiguous run of blocks each (strategy.schedule, strategy.split,
    #   strategy.stages_per_rank)
    cp: int | None = None  # context parallel: each sequence split over this many ranks (2 mirrored chunks each),
    #   keys and values gathered for attention: 1/cp of the activations per rank, an all-gather per attention
    #   block; causal LMs (strategy.cp_degree)
    cp_method: str = "allgather"  # allgather (Llama 3's: K and V all-gathered, any cp) | ulysses (DeepSpeed's:
    #   all-to-alls trade the sequence split for a head split; cp must divide the KV heads; moves 1/cp of q, k, v
    #   and the output per rank) | ring (torch's ring attention: K and V passed rank to rank, two blocks held at a
    #   time; causal attention, no sliding window shorter than the sequence, no dropout; flash kernels: CPU, or CUDA
    #   in bf16/fp16)
    ep: int | None = None  # expert parallel: each MoE layer's experts split over this many neighbouring ranks,
    #   tokens sent to their experts and back by all-to-all; borrows its ranks from dp_shard (not a factor of the
    #   world): the ranks holding the same experts FSDP-shard them (strategy.ep_degree)

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if value is not None:
                _require(value >= 1, f"parallel.{name}", value, "at least 1 (or unset)")
        _choice("parallel.cp_method", self.cp_method, CP_METHODS)

    @property
    def given(self) -> bool:
        """Whether any degree is set: then the degrees choose the layout."""
        return any(getattr(self, name) is not None for name in DEGREES)


EVAL_EVERY_DEFAULT = 50


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int | None = 100  # optimizer steps; null: use epochs
    epochs: float | None = None  # passes over the train set (rounded down to whole steps, at least one)
    log_every: int = 1  # progress-bar/log-line cadence; metrics.jsonl always gets every step
    # eval loss every N steps and at the end (run.json final_eval, the done line); null: only at the end
    eval_every: int | None = EVAL_EVERY_DEFAULT
    consistency_check_every: int | None = None  # compare replica checksums every N steps; null: only at start
    progress: bool = True  # progress bar on rank 0
    # per parameter, the largest |gradient| over the run relative to the global gradient norm, into run.json;
    # compare records it on its reference arm to tell weights only rounding noise moved (one pass over the
    # gradients per step, left out of the step time; ZeRO-3 gathers every gradient for it)
    record_gradient_scale: bool = False
    # a non-finite loss or gradient norm (fp16 loss scaling handles its own): stop (one line naming the step;
    # no checkpoint holds it) | skip (drop that step's gradients, no update; the schedule goes on)
    on_nonfinite: str = "stop"
    # on_nonfinite skip: stop as on_nonfinite stop (exit 4) at the Nth skipped step in a row; null: never.
    # A skipped step changes no weight, so N different batches in a row all non-finite mean the weights
    # themselves overflow and every later step would be skipped too. 10: a bad batch or two in a row (the
    # spikes skip is for) stays far below it, and a run that cannot recover loses 10 steps, not the rest
    max_consecutive_skips: int | None = 10
    # true (or full): each transformer block keeps only its input in forward and recomputes the rest in backward
    # (activations ~1/layers of their size, about one more forward of compute) | selective: each block also keeps
    # its attention's output and every other matmul's (the 1st, 3rd, ... in the order they run), the rest
    # recomputed (torchtitan's per-op policy: about half the activations for a third of the recompute) | false.
    # Same losses either way
    activation_checkpointing: bool | str = field(default=False, metadata={"expected": CHECKPOINTING_WORDS})
    # true (causal LMs): the loss computed from the last hidden states in tiles of tokens whose logits hold at most
    # 2^25 elements (1,099 tokens of a 30,522-token vocabulary), each tile's logits made again in backward: the
    # micro-batch's [tokens × vocab] logits, their fp32 copy and gradient never exist whole (for long sequences,
    # most of the memory), for one more head matmul per tile; the same loss
    tiled_loss: bool = False
    # true: torch.compile each transformer block's forward (names and the strategy's hooks unchanged): the first
    # steps pay the compile time (metrics.jsonl compile_s, left out of step_time_s), later steps fuse kernels
    compile: bool = False
    # experiment trackers fed every metrics.jsonl record, from rank 0 (toolkit/observe/tracking.py): tensorboard (event
    # files in <tracking_dir>/tensorboard/<run>) | mlflow (a run in $MLFLOW_TRACKING_URI, else in the SQLite store
    # <tracking_dir>/mlflow.db); <run> is output_dir's folder name (more of its path if another run's events hold
    # it). One name or a list
    report_to: tuple[str, ...] = ()
    # the folder both trackers write into; null: output_dir. One folder for many runs overlays their curves
    # (`toolkit compare` points every arm at its experiment folder)
    tracking_dir: str | None = field(default=None, metadata=PATH)
    # [first, last]: record optimizer steps first..last with torch.profiler (CPU and CUDA kernels) into
    # output_dir/profile: a trace per rank (chrome://tracing, Perfetto) and rank 0's table of the costliest ops
    # (toolkit/observe/profiling.py). Those steps run slower: metrics.jsonl marks them, throughput leaves them out
    profile_steps: tuple[int, int] | None = None
    # on CPU, how a rank allocates (toolkit/process/host_memory.py): fast (freed memory reused, no page faults; the resident
    # set keeps its high-water mark, under fsdp up to 3.6× the plan) | predictable (tensors get pages of their own,
    # given back when freed: the peak `toolkit plan` predicts, the default MiniLM job 0.6× as fast) | auto (fast
    # where 4× the plan's peak fits the rank's share of host memory). No effect on GPU
    host_memory: str = "auto"
    # x > 0: every starting weight w becomes w·(1 + x·N(0,1)) (seeded from `seed`), a run from a start that
    # differs by rounding alone (1e-7: about fp32's unit roundoff). `toolkit compare` runs its reference so once:
    # what that moves is what rounding alone moves, the verdict's bound (toolkit/compare/verdict.py). 0: as loaded
    init_perturbation: float = 0.0

    @property
    def recompute(self) -> str:
        """train.activation_checkpointing as one name: none | full | selective."""
        if isinstance(self.activation_checkpointing, str):
            return self.activation_checkpointing
        return "full" if self.activation_checkpointing else "none"

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, str):
            if self.activation_checkpointing not in CHECKPOINTING:
                raise RecipeError(f"train.activation_checkpointing: unknown value {self.activation_checkpointing!r}; "
                                  f"choose {CHECKPOINTING_WORDS}")
            if self.activation_checkpointing == "full":  # the same as true: one spelling in the saved recipe
                object.__setattr__(self, "activation_checkpointing", True)
        _choice("train.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        _choice("train.host_memory", self.host_memory, ("auto", "fast", "predictable"))
        _require(0.0 <= self.init_perturbation <= 1e-3, "train.init_perturbation", self.init_perturbation,
                 "in [0, 1e-3]: a relative change of the starting weights the size of rounding, e.g. 1e-7")
        if self.profile_steps is not None:
            first, last = self.profile_steps
            _require(1 <= first <= last, "train.profile_steps", list(self.profile_steps),
                     "[first, last] optimizer steps with 1 <= first <= last, e.g. [5, 6]")
            if self.max_steps is not None:  # with epochs: once the data is read (toolkit.train.loop.prepare)
                check_profile_window(self.profile_steps, last_step=self.max_steps)
        for name in self.report_to:
            _choice("train.report_to", name, TRACKERS)
        if len(set(self.report_to)) != len(self.report_to):
            raise RecipeError(f"train.report_to names a tracker twice: {list(self.report_to)}")
        if self.tracking_dir and not self.report_to:  # set, it says the user expects curves there: none are written
            raise RecipeError("train.tracking_dir applies only when train.report_to names a tracker; remove it or "
                              f"set train.report_to (one or more of {', '.join(TRACKERS)})")
        if (self.max_steps is None) == (self.epochs is None):
            raise RecipeError("train: give exactly one of max_steps or epochs")
        if self.epochs is not None:
            _require(0 < self.epochs < math.inf, "train.epochs", self.epochs,
                     "a finite number of passes over the train set > 0, e.g. 1 or 0.5")
        if self.max_steps is not None:
            _positive("train.max_steps", self.max_steps)
        _positive("train.log_every", self.log_every)
        for key, every in (("train.eval_every", self.eval_every),
                           ("train.consistency_check_every", self.consistency_check_every),
                           ("train.max_consecutive_skips", self.max_consecutive_skips)):
            if every is not None:
                _positive(key, every)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Training checkpoints under output_dir/checkpoints (see toolkit/checkpoint): model, optimizer, schedule,
    loss scale, data position and RNG, readable by every strategy at any world size."""

    every_steps: int | None = None  # a checkpoint every N optimizer steps; null: by every_minutes and the final one
    # a checkpoint once this many minutes of training passed since the last one (or the run's start), so that a hard
    # crash (a lost node, the OOM killer) loses at most that much of a long run; the ranks agree after each step (in
    # the all-reduce that agrees on stop signals). null: only every_steps, a stop signal and the final one write
    every_minutes: float | None = 30.0
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete
    # a checkpoint after the last step (what a later --resume with more steps or `toolkit convert` reads); null:
    # where this run trained 10 minutes or more, or continues a checkpoint. A quick run is cheaper to run again than
    # its checkpoint is to keep (the default MiniLM: ~270 MB of fp32 weights and AdamW state beside its 90 MB export)
    final: bool | None = None
    # true: dcp.async_save, training goes on while the files are written (the next save waits for it)
    async_save: bool = field(default=False, metadata={"key": "async"})
    # each file's size and SHA-256 in digests.json, compared before a resume or convert reads it (bytes changed
    # after the save are found); false: rank 0 hashes nothing at each commit (~1.5 GB/s a thread, up to 4), for
    # checkpoints so large that the wait matters, and only missing or short files are found
    digests: bool = True

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            _positive("checkpoint.every_steps", self.every_steps)
        if self.every_minutes is not None:
            _positive("checkpoint.every_minutes", self.every_minutes)
        _positive("checkpoint.keep_last", self.keep_last)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (autocast + loss scaling)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # degrees instead of a strategy.name
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0  # fixes init of new weights and the sample order of every step
    output_dir: str = field(default="runs/default", metadata=PATH)

    def __post_init__(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        # the sampler seeds a generator with seed × 1_000_003 + epoch, which must fit in 64 bits
        _require(0 <= self.seed < 2**32, "seed", self.seed, "in 0..2**32-1")
        if self.model.task == "sequence-classification" and not self.data.label_column:
            raise RecipeError("data.label_column is required for task sequence-classification")
        if self.model.task == "sequence-classification" and self.data.format != "text":
            raise RecipeError(f"data.format {self.data.format} is for instruction tuning a causal-lm; a "
                              "sequence-classification task reads data.format text")
        _check_readers(self)


# options only some tasks, data formats or schedules read: (the key that decides, the values that read them, the
# options). Set away from its default under another value, an option would be ignored without a word
READERS = (
    ("model.task", ("causal-lm",), ("data.packing",)),
    ("model.task", ("sequence-classification",), ("model.num_labels", "data.label_column")),
    ("data.format", ("text",), ("data.text_column",)),
    ("data.format", ("chat",), ("data.messages_column", "data.chat_template")),
    ("data.format", ("prompt-response",), ("data.prompt_column", "data.response_column")),
    ("optim.schedule", ("cosine", "linear"), ("optim.min_lr_ratio",)),
    ("train.on_nonfinite", ("skip",), ("train.max_consecutive_skips",)),
)


def _check_readers(recipe: Recipe) -> None:
    """An option set away from its default where the task, data format or schedule ignores it is a mistake, not
    a no-op (as a strategy option is for another strategy: toolkit.strategies._check_options). Its default may be
    spelled out, or null given (data.label_column: null under causal-lm, as llama-tiny.yaml says it)."""
    for decider, readers, options in READERS:
        value = _key_value(recipe, decider)
        if value in readers:
            continue
        for option in options:
            section, name = option.split(".")
            default = next(f.default for f in dataclasses.fields(getattr(recipe, section)) if f.name == name)
            assert default is not dataclasses.MISSING, option  # READERS options have plain defaults
            if _key_value(recipe, option) not in (default, None):
                raise RecipeError(f"{option} applies to {decider} {'/'.join(readers)} only, but {decider} is "
                                  f"{value}; remove it or set {decider}={readers[0]}")


def _key_value(recipe: Recipe, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """The batch arithmetic of one run: global = world × micro × accum."""

    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int


class BatchMismatch(RecipeError):
    """batch.grad_accum_steps and global_batch_size that disagree: `total` is the global batch the accumulation
    makes, `per_step` the samples of one micro-batch on every rank, `wanted` the global batch the recipe asks for
    (whoever supplied the accumulation words the fix: an accelerate config file's gradient_accumulation_steps)."""

    def __init__(self, message: str, *, total: int, per_step: int, wanted: int):
        super().__init__(message)
        self.total, self.per_step, self.wanted = total, per_step, wanted


def plan_batch(batch: BatchConfig, *, world_size: int) -> BatchPlan:
    micro = batch.micro_batch_size
    accum = batch.grad_accum_steps
    if accum is None and batch.global_batch_size is None:
        accum = 1
    if accum is None:
        assert batch.global_batch_size is not None
        per_step = world_size * micro
        if batch.global_batch_size % per_step:
            raise RecipeError(
                f"batch: global_batch_size {batch.global_batch_size} is not a multiple of "
                f"{world_size} ranks × micro {micro} = {per_step}; change micro_batch_size or global_batch_size")
        accum = batch.global_batch_size // per_step
    total = world_size * micro * accum
    if batch.global_batch_size is not None and batch.global_batch_size != total:
        raise BatchMismatch(
            f"batch: {world_size} ranks × micro {micro} × accum {accum} = {total}, but global_batch_size is "
            f"{batch.global_batch_size}; set batch.grad_accum_steps=null to derive it, or make global_batch_size "
            f"{total}",
            total=total, per_step=world_size * micro, wanted=batch.global_batch_size)
    return BatchPlan(world_size=world_size, micro_batch_size=micro, grad_accum_steps=accum, global_batch_size=total)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise RecipeError(f"{key}: unknown value {value!r}; choose one of {', '.join(choices)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:  # nan too
        raise RecipeError(f"{key} must be > 0, got {value}")


def check_profile_window(window: tuple[int, int] | None, *, last_step: int) -> None:
    """A train.profile_steps window that starts past the run's last step records nothing: one line."""
    if window is not None and window[0] > last_step:
        raise RecipeError(f"train.profile_steps: {list(window)} starts after the run's last step {last_step}; "
                          f"profile steps within 1..{last_step}")


def _require(ok: bool, key: str, value: Any, wanted: str) -> None:
    """A value out of its range is a RecipeError. Bounds are written so that nan fails them (every comparison
    with nan is false): a nan learning rate is refused here, not found as a non-finite loss later."""
    if not ok:
        raise RecipeError(f"{key}: got {value}; it must be {wanted}")
