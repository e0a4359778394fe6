"""Activation memory of one micro-batch, traced rather than guessed: `toolkit plan`'s activation term.

The recipe's model runs forward, the loop's loss and backward on fake tensors (torch's FakeTensorMode: shapes
and dtypes, no memory, no arithmetic) under a dispatch mode that follows every storage's life (`LiveBytes`).
What it finds is what the model's own code keeps for backward, in the dtypes the strategy computes in:
  - autocast strategies (single, dp, ddp, tp, pipeline): parameters in their load dtype, the forward under
    autocast; a 16-bit run keeps a 16-bit copy of every matmul weight and, with fp32 weights, an fp32 residual
    stream (normalisation layers save fp32 tensors)
  - strategies that cast their parameters (FSDP2's MixedPrecisionPolicy, DeepSpeed's 16-bit weights): every
    block in the 16-bit dtype, no autocast
and the head: the loss's fp32 log-softmax and, in its backward, two more fp32 tensors of tokens × vocab.
The parameters exist before the trace and are not counted; gradients are dropped as they arrive (the planner
counts them with the model states). Two traces, of the model cut to its first block and to its first two, give
the bytes outside the layer stack and the bytes each block adds; the whole stack is extrapolated from them, so
a trace costs two blocks whatever the model's depth, and it is cached. The traces run the CPU's kernels: on a
GPU, attention's kernels keep the same tensors (flash attention: output and log-sum-exp).
A pipeline stage (`traced_stage`) is traced the same way, and also gives what its forward keeps until its
backward: a pipeline holds that for every micro-batch it has in flight (toolkit/strategies/pipeline/memory.py).

Checked against the measured peaks of an H100 (benchmarks/gpu_throughput.py; see docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.utils import logging as transformers_logging

from toolkit.atomic import cache_dir, write_text_whole
from toolkit.config.recipe import Recipe
from toolkit.cost.flops import counted_op
from toolkit.errors import RecipeError
from toolkit.model.blocks import enable_activation_checkpointing, layer_stack
from toolkit.model.build import set_dropout

TRACE_VERSION = 8  # raise when what a trace measures changes: cached traces of older versions are not read


@dataclasses.dataclass(frozen=True)
class Traced:
    """One micro-batch through a model or a pipeline stage: the bytes alive at the peak of its forward, loss and
    backward, and those alive between its forward (with the loss) and its backward, which a pipeline keeps for
    every micro-batch it has in flight."""

    peak: int
    held: int
    ops: int = 0  # the ops it dispatches that no FLOP rate times (cost/flops.py counted_op): their host time

    def extend(self, other: Traced, times: int) -> Traced:
        """`self` (traced with one block) plus `times` more blocks, each adding what `other` (two) adds."""
        return Traced(peak=self.peak + times * max(other.peak - self.peak, 0),
                      held=self.held + times * max(other.held - self.held, 0),
                      ops=self.ops + times * max(other.ops - self.ops, 0))


@dataclasses.dataclass(frozen=True)
class OpCount:
    """The ops one micro-batch's forward, loss and backward dispatch beside its matmuls and attention kernels."""
    total: int  # the whole model's
    per_block: int  # what each block of the layer stack adds (0: a model the trace could not cut into blocks)


def traced_activations(model: nn.Module, recipe: Recipe, *, params_dtype: torch.dtype,
                       autocast_dtype: torch.dtype | None, checkpointing: bool | str, tp_degree: int = 1) -> int:
    """Bytes of one micro-batch's activations at their peak (forward + loss + backward). `model`: the recipe's
    model on the meta device. Its parameters are cast to `params_dtype`, the forward runs under autocast to
    `autocast_dtype` (None: no autocast), with or without activation checkpointing (`checkpointing`: False,
    True or "full", or "selective"; a model that cannot checkpoint is traced without). `tp_degree` > 1: as one
    tensor-parallel rank of that many computes it, its split layers 1/N wide (tp_rank.local_model), and its
    1/N of the vocabulary's logits under strategy.loss_parallel, 1/N of the tokens between its split layers under
    strategy.sequence_parallel. A trace is kept in the user's cache: the same
    model, batch and dtypes are traced once."""
    how = _how(model, params_dtype=params_dtype, autocast_dtype=autocast_dtype, checkpointing=checkpointing)
    vocab = tp_degree > 1 and recipe.strategy.loss_parallel
    sequence = tp_degree > 1 and recipe.strategy.sequence_parallel

    return _whole(model, recipe, how, tp_degree=tp_degree, vocab=vocab, sequence=sequence)["bytes"]


def traced_ops(model: nn.Module, recipe: Recipe, *, params_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
               checkpointing: bool | str) -> OpCount:
    """The ops one micro-batch dispatches beside its matmuls and attention (a checkpointed block's forward twice),
    from the same cached trace as `traced_activations`: the host's share of a step where each op costs it a fixed
    time (a CPU; cost/step_time.py)."""
    how = _how(model, params_dtype=params_dtype, autocast_dtype=autocast_dtype, checkpointing=checkpointing)
    found = _whole(model, recipe, how, tp_degree=1, vocab=False, sequence=False)
    return OpCount(total=found["ops"], per_block=found["block_ops"])


def _whole(model: nn.Module, recipe: Recipe, how: dict[str, Any], *, tp_degree: int, vocab: bool,
           sequence: bool) -> dict:
    """The whole model's trace: {"bytes": its peak, "ops": its ops, "block_ops": one block's}, cached."""
    def trace() -> dict:
        from toolkit.memory.tp_rank import local_model

        local = local_model(model, tp_degree, loss_parallel=vocab, sequence_parallel=sequence) \
            if tp_degree > 1 else model
        whole, block_ops = _stack(local, recipe, **how)
        return {"bytes": whole.peak, "ops": whole.ops, "block_ops": block_ops}

    key = ["tp", tp_degree, *(["vocab"] if vocab else []), *(["sequence"] if sequence else [])] \
        if tp_degree > 1 else []
    return _cached(model, recipe, how, key, ("bytes", "ops", "block_ops"), trace)


def traced_stage(model: nn.Module, recipe: Recipe, *, blocks: int, first: bool, last: bool,
                 params_dtype: torch.dtype, autocast_dtype: torch.dtype | None, checkpointing: bool | str,
                 tp_degree: int = 1, sequence_parallel: bool = False, loss_parallel: bool = False,
                 head_rows: tuple[int, int] | None = None) -> Traced:
    """One micro-batch through a pipeline stage of `blocks` blocks (toolkit.model.stages.Stage: the
    embeddings when `first`, the head and the loss when `last`; under strategy.split_head, `head_rows` of the
    head, the stage receiving the final norm's output and the row stats where it holds no block), traced like
    `traced_activations`. A stage's
    input (the activations it receives) and, unless last, the gradient of its output are the pipeline's
    receive buffers, made before the trace and not counted. Traced with one block and two, extrapolated.
    `tp_degree` > 1: as one tensor-parallel rank of the stage computes it (its split layers 1/N wide; under
    `sequence_parallel` its norms on 1/N of the tokens, its input and output the rank's share of them; under
    `loss_parallel` the last stage's head, and a first stage's tied embedding, 1/N of the vocabulary)."""
    how = _how(model, params_dtype=params_dtype, autocast_dtype=autocast_dtype, checkpointing=checkpointing)

    def trace() -> dict:
        from toolkit.memory.tp_rank import local_model

        local = local_model(model, tp_degree, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel) \
            if tp_degree > 1 else model
        stack = layer_stack(local, guess=True)
        return dataclasses.asdict(_over_blocks(local, recipe, stack, blocks,
                                               stage=(first, last, head_rows, True), **how))

    fields = tuple(f.name for f in dataclasses.fields(Traced))
    key = ["stage", blocks, first, last, *(["tp", tp_degree] if tp_degree > 1 else []),
           *(["sp"] if tp_degree > 1 and sequence_parallel else []),
           *(["lossp"] if tp_degree > 1 and loss_parallel else []), *(["rows", *head_rows] if head_rows else [])]
    return Traced(**_cached(model, recipe, how, key, fields, trace))


def _how(model: nn.Module, *, params_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
         checkpointing: bool | str) -> dict[str, Any]:
    """How a trace computes (a model that cannot checkpoint is traced without)."""
    if checkpointing in ("none", "full"):  # the spellings earlier traces were cached under
        checkpointing = checkpointing == "full"
    if not getattr(model, "supports_gradient_checkpointing", False):
        checkpointing = False
    return {"params_dtype": params_dtype, "autocast_dtype": autocast_dtype, "checkpointing": checkpointing}


def _cached(model: nn.Module, recipe: Recipe, how: dict[str, Any], what: list, keys: tuple[str, ...],
            trace: Callable[[], dict]) -> dict:
    """`trace()`'s numbers, or the ones it gave before for the same model, batch, dtypes and `what` (a cached
    file that does not hold the same numbers is traced anew); an op fake tensors cannot run becomes a RecipeError
    of one line (no prediction, not a crash)."""
    key = _cache_key(model, recipe, **how, what=what)
    path: Path | None = None
    try:  # no home to find (an arbitrary container user) is no cache, not a failed run
        path = cache_dir("activations") / f"{key}.json"
        cached = {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError):
        cached = {}
    if cached and set(cached) == set(keys):
        return cached
    try:
        found = trace()
    except RecipeError:
        raise
    except Exception as exc:  # data-dependent shapes, a sequence too long to index
        raise RecipeError(f"the activation trace of {type(model).__name__} failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if path is None:
        return found
    try:  # a cache that cannot be written (a read-only home) only costs the next plan a trace
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_whole(path, json.dumps(found))
    except (OSError, RuntimeError):
        pass
    return found


def _stack(model: nn.Module, recipe: Recipe, **how) -> tuple[Traced, int]:
    """Traced with one block and with two, extrapolated to the whole stack, and the ops one block adds; a model
    without a block list that sits in a ModuleList is traced whole (no block's ops told apart). One stack: an
    encoder-decoder's second stack is not extrapolated."""
    try:
        stack = layer_stack(model, guess=True)
        cut_blocks(model, stack, 0)  # a RecipeError if the blocks sit in no ModuleList
    except RecipeError:
        return _traced(copy.deepcopy(model), recipe, **how), 0
    one = _traced(cut_blocks(model, stack, 1), recipe, **how)
    if len(stack) <= 1:
        return one, 0
    two = _traced(cut_blocks(model, stack, 2), recipe, **how)
    return one.extend(two, len(stack) - 1), max(two.ops - one.ops, 0)


def _over_blocks(model: nn.Module, recipe: Recipe, stack: list[nn.Module], blocks: int, **how) -> Traced:
    """`model` with `blocks` blocks of its `stack`: traced with one and with two, each further block adding
    what the second added."""
    stage = how.get("stage")
    if blocks == 0 and stage is not None and stage[2] is not None:  # split_head: a stage of the head's rows alone,
        # cut from a model of one block that it leaves out (a model needs blocks to be cut at)
        return _traced(cut_blocks(model, stack, 1), recipe, **{**how, "stage": (*stage[:3], False)})
    one = _traced(cut_blocks(model, stack, min(blocks, 1)), recipe, **how)
    if blocks <= 1:
        return one
    return one.extend(_traced(cut_blocks(model, stack, 2), recipe, **how), blocks - 1)


def _cache_key(model: nn.Module, recipe: Recipe, *, params_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
               checkpointing: bool | str, what: list) -> str:
    """Everything a trace depends on: the model (config, adapters), the micro-batch, the dtypes, the versions,
    and `what` is traced (a pipeline stage: its blocks, first, last)."""
    import transformers

    lora = dataclasses.asdict(recipe.model.lora) if recipe.model.lora is not None else None
    parts = [TRACE_VERSION, torch.__version__, transformers.__version__, type(model).__name__,
             cast(Any, model).config.to_json_string(use_diff=False), lora, recipe.model.dropout, recipe.model.task,
             recipe.batch.micro_batch_size, recipe.data.max_length, recipe.data.packing, str(params_dtype),
             str(autocast_dtype), checkpointing, *what, *(["tiled"] if recipe.train.tiled_loss else [])]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cut_blocks(model: nn.Module, blocks: list[nn.Module], keep: int) -> nn.Module:
    """A copy of the meta `model` whose layer stack holds its first `keep` blocks."""
    first = id(blocks[0])
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and any(id(child) == first for child in module):
            held = list(module)
            module._modules = {str(i): held[i] for i in range(min(keep, len(held)))}
            try:
                return copy.deepcopy(model)
            finally:
                module._modules = {str(i): child for i, child in enumerate(held)}
    raise RecipeError(f"{type(model).__name__}: its blocks sit in no ModuleList; the activation trace cannot cut it")


StageTrace = tuple[bool, bool, "tuple[int, int] | None", bool]  # first, last, head rows, holds its blocks


def _traced(model: nn.Module, recipe: Recipe, *, params_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
            checkpointing: bool | str, stage: StageTrace | None = None) -> Traced:
    """`model` (a meta copy it may change) traced whole, or as a pipeline stage: `stage` = (first, last, the
    head's rows it computes under split_head or None, whether it holds the model's blocks or none of them)."""
    model.to(params_dtype)  # on the meta device: the dtype only
    if recipe.model.dropout is not None:
        set_dropout(model, recipe.model.dropout)
    give_pad_token(model)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its notes on a cache during checkpointing: not the user's
    # an op fake tensors cannot run is logged with its traceback by torch before it raises; the caller gets
    # the error as one line (a sequence too long to index, say), the user no traceback
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        return _run_fake(model, recipe, params_dtype=params_dtype, autocast_dtype=autocast_dtype,
                         checkpointing=checkpointing, stage=stage)
    finally:
        transformers_logging.set_verbosity(verbosity)
        fake_log.setLevel(level)
        # warnings silenced here were still marked shown: the run's own first one must reach the user
        getattr(getattr(logging.Logger, "warning_once", None), "cache_clear", lambda: None)()


def give_pad_token(model: nn.Module) -> None:
    """A pad token id where the model's config has none: a run sets the tokenizer's; classification heads need
    one to find each sequence's last token."""
    config = cast(Any, model).config
    if getattr(config, "pad_token_id", 0) is None:
        config.pad_token_id = 0


def fake_grouped_mm() -> contextlib.AbstractContextManager:
    """A mixture-of-experts model's grouped matmul on fake tensors: torch's fake kernel of _grouped_mm accepts
    bf16 only (its CPU kernel any dtype), so the trace takes transformers' own fallback, which registers a fake
    kernel for every dtype and saves the same tensors for backward (the input and the weight)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(moe, "_can_use_grouped_mm"):
        return contextlib.nullcontext()
    return _replaced(moe, "_can_use_grouped_mm", lambda *args: False)


def _run_fake(model: nn.Module, recipe: Recipe, *, params_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
              checkpointing: bool | str, stage: StageTrace | None) -> Traced:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from toolkit.data.losses import micro_batch_loss_sum, split_head_loss_sum, tiled_loss_sum
    from toolkit.memory import tp_rank

    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():  # the meta weights
        warnings.simplefilter("ignore")
        if stage is not None and stage[2] is not None:  # split_head: a tied first stage's weight stays one
            from toolkit.checkpoint.loading import to_empty_tied

            to_empty_tied(model, device="cpu")
        else:
            model.to_empty(device="cpu")
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model, "selective" if checkpointing == "selective" else "full")
        tokens = (recipe.batch.micro_batch_size, recipe.data.max_length)
        ids = torch.zeros(tokens, dtype=torch.long)
        labels = ids if recipe.model.task == "causal-lm" else torch.zeros(tokens[0], dtype=torch.long)
        # Packed samples have no padding: transformers sees an all-ones mask and attention runs causal without
        # one (a fake mask's values are unknown, so it would build one). Padded batches carry their mask.
        mask = None if recipe.data.packing else torch.ones(tokens, dtype=torch.long)
        module, inputs, grad = model, [ids], None
        grads: list[torch.Tensor] | None = None
        rows: tuple[int, int] | None = None  # a pipeline stage's rows of the head (split_head)
        positions: contextlib.AbstractContextManager = contextlib.nullcontext()
        experts = fake_grouped_mm()
        # train.tiled_loss: the output layer returns the loss sum, made tile by tile, as a run's does
        # (strategies/base.py tiled_head); a pipeline's last stage computes its whole logits (checks refuse it there)
        tiles = stage is None and recipe.train.tiled_loss and recipe.model.task == "causal-lm"
        tiled: contextlib.AbstractContextManager = contextlib.nullcontext()
        if tiles:
            head = cast(Any, model).get_output_embeddings()
            own, width = head.forward, int(getattr(head, "out_features", 0) or head.weight.shape[0])
            tiled = _replaced(head, "forward", lambda hidden: tiled_loss_sum(hidden, own, labels, vocab=width))
        if stage is not None:  # the received activations and the output's gradient: receive buffers, not counted
            from transformers import masking_utils

            from toolkit.model.stages import Stage, layer_list

            first, last, rows, holds_blocks = stage
            # A stage gives transformers its positions (0, 1, ...): without a mask, transformers reads their values
            # to find packed sequences, which fake tensors do not have, and builds a mask a real run does not
            # (it finds none). The trace tells it what it would find.
            if hasattr(masking_utils, "find_packed_sequence_indices"):
                positions = _replaced(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
            blocks = recipe.strategy.blocks
            module = Stage(model, layer_ids=list(range(len(layer_list(model, blocks)))) if holds_blocks else [],
                           first=first, last=last, blocks=blocks, head_rows=rows)
            if getattr(model, tp_rank.SEQUENCE_SHARDS, 0):  # a local_model under sequence parallelism
                module.sequence_shards = getattr(model, tp_rank.SEQUENCE_SHARDS)
                if not first:
                    setattr(module.blocks()[0], tp_rank.RECEIVED_WHOLE, tokens[1])
            # the residual stream, in the weights' dtype: a tp rank's share of the sequence under sequence
            # parallelism (rank 0's, the largest where tp does not divide it), sent and received as it is
            hidden = (tokens[0], -(-tokens[1] // module.sequence_shards), cast(Any, model).config.hidden_size)
            inputs = [ids if first else torch.zeros(hidden, dtype=params_dtype, requires_grad=True)]
            grad = None if last else torch.zeros(hidden, dtype=params_dtype)
            if rows is not None:  # each token's log-sum-exp and next-token logit, in fp32, passed on beside it
                stats = [torch.zeros(tokens, dtype=torch.float32, requires_grad=True) for _ in range(2)]
                inputs += stats if not module.layer_ids else []
                grads = None if last else [cast(torch.Tensor, grad), *(torch.zeros(tokens) for _ in stats)]
        live = LiveBytes([*module.parameters(), *module.buffers(), *inputs,
                          *(t for t in (grad, mask) if t is not None), *(grads or [])[1:]])

        def drop(param: torch.Tensor) -> None:  # gradients are model states, counted on their own
            tp_rank.copy_rows_of_whole(param)  # the strategy's own hook on a tied embedding's rows, first
            if param.grad is not None:
                live.release(param.grad)
            param.grad = None

        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(drop)
        with live, positions, experts, tiled:
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                if stage is None:
                    out = model(input_ids=ids, **({} if mask is None else {"attention_mask": mask})).logits
                elif rows is not None:
                    out = module(*inputs, attention_mask=mask, length=tokens[1], labels=labels)
                else:
                    out = module(inputs[0], attention_mask=mask, length=tokens[1])
            if grad is None:  # the whole model, or the last stage: the loss
                share = getattr(cast(Any, model).get_output_embeddings(), "vocabulary_share", False) \
                    if hasattr(model, "get_output_embeddings") else False
                with tp_rank.VocabularyShareLoss() if share else contextlib.nullcontext():
                    loss = split_head_loss_sum(out[0], out[1], labels) if rows is not None else \
                        out if tiles else \
                        micro_batch_loss_sum(out, labels, recipe.model.task)
                    if stage is None:
                        del out  # the loop lets the logits go; a pipeline keeps a stage's output until its backward
                    held = live.live
                    loss.backward()
                    del loss
            else:
                held = live.live
                torch.autograd.backward(list(out) if rows is not None else [out],
                                        grads if rows is not None else [grad])
                del out
    return Traced(peak=live.peak, held=held, ops=live.ops)


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any):
    """`owner.name` is `value` inside, what it was after."""
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages made inside it that are still alive, and their peak: every op's outputs
    are counted once per storage (views and in-place results share one) until the storage is freed or
    `release`d; views of what existed before (a weight's transpose) are not. torch's MemTracker does this and
    more, but installs gradient hooks on every parameter it sees, frozen ones too (LoRA's base weights), which
    torch refuses."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        """`existing`: tensors made before (parameters, buffers); their views are not new memory."""
        super().__init__()
        self.live = self.peak = 0
        self.ops = 0  # those outside the matmuls and attention kernels (cost/flops.py counted_op)
        self._sizes: dict[int, int] = {}
        self._existing = {t.untyped_storage()._cdata for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += counted_op(func)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def release(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`'s storage now (a fake storage can outlive the tensor a real run frees)."""
        self._free(tensor.untyped_storage()._cdata)

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes or key in self._existing:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        # not at interpreter exit (atexit False): a count nobody reads then, and work in a rank's last moments
        weakref.finalize(storage, self._free, key).atexit = False

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
