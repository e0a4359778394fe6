"""Transformer blocks: found by class name (shard units, split points), checkpointed, compiled, counted."""

from __future__ import annotations

import functools
from typing import Any, Callable, cast

import torch
import torch.utils.checkpoint
from torch import nn

from toolkit.config.recipe import ModelConfig
from toolkit.errors import RecipeError
from toolkit.model.build import meta_model


def enable_activation_checkpointing(model: nn.Module, recompute: str = "full") -> None:
    """Recompute each transformer block in backward, through transformers' own per-layer checkpointing,
    non-reentrant; `recompute` full (all but the block's input) or selective (selective_context: what it keeps).
    Chosen over wrapping blocks in torch's checkpoint_wrapper because it leaves module and
    parameter names as they are (checkpoints, exports, TP plans and FSDP units all go by name), and because
    it composes with every strategy: it checkpoints a block's `forward`, so hooks on the block (FSDP2's
    all-gather, which its pre-backward hook repeats before the recomputation needs the weights) stay outside
    the checkpoint; ZeRO-3 fetches through hooks on every submodule, which run again inside it (on one rank
    the block itself is its unit, hooked outside as FSDP2's: zero/order.py's block_units); pipeline
    stages keep the layers, flag included."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RecipeError(f"train.activation_checkpointing: {type(model).__name__} has no transformer block list "
                          "that transformers can checkpoint (supports_gradient_checkpointing is false); set "
                          "train.activation_checkpointing: false")
    kwargs = checkpoint_kwargs(recompute)
    # activation_checkpointing_enable: its name since transformers 5.x, where the older one is an alias that warns
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        cast(Any, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpoint_kwargs(recompute: str) -> dict[str, Any]:
    """torch.utils.checkpoint.checkpoint's arguments for a block under `recompute` (full | selective)."""
    if recompute == "selective":
        return {"use_reentrant": False, "context_fn": selective_context}
    return {"use_reentrant": False}


# torch's matmuls of a linear layer: mm (no bias, or a 3-D input it does not fold), addmm (a bias)
MATMULS = ("mm", "addmm")
# every kernel torch's scaled_dot_product_attention dispatches to (CPU, CUDA's flash, memory-efficient, cuDNN)
ATTENTION_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable")


def selective_context() -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts for one forward of one block (a fresh count each call): its
    forward keeps the output of every attention kernel and of its 1st, 3rd, 5th, ... matmul in the order they
    run; backward recomputes the rest from the block's input. torchtitan's per-op policy as its published Llama
    runs used it (attention kernels and every other mm), without its entries for a reduce-scatter's output and
    float8's max (no collective's output is kept: under tensor parallel a recompute reruns what full
    checkpointing's does); the matmuls counted with addmm as well, since transformers' linear layers with a bias
    (BERT's) run addmm where torchtitan's models run mm."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls, attention = _overloads(MATMULS), _overloads(ATTENTION_KERNELS)
    counts = {False: 0, True: 0}  # the forward's matmuls, and the recomputation's

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # torch 2.13 asks in forward only (its recomputation reads what forward stored); earlier releases ask again
        # while recomputing and read the stored output only where the answer is the forward's: the same answer
        if func in matmuls:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _overloads(names: tuple[str, ...]) -> set[Any]:
    """The default overloads of the aten ops of these names that this torch build has."""
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def compile_blocks(model: nn.Module, recompute: str = "full") -> None:
    """torch.compile each transformer block's `forward` (compiled lazily, at its first call). The forward, not
    the module: hooks on the block (FSDP2's all-gather, the strategy's own) stay outside the compiled code, and
    module and parameter names stay as they are.

    With activation checkpointing the checkpoint goes inside the compiled function, where dynamo traces it as
    a region to recompute. Left where transformers puts it, it depends on the version whether it is inside:
    transformers 5.17 checkpoints a layer's `__call__`, around the compiled forward, and on CUDA the compiled
    graph then saves other tensors on recomputation than in forward (flash attention's RNG state among them):
    torch's CheckpointError at the first backward (measured on an H100, torch 2.11).

    transformers 5.25's attention sets a module-level routing variable for the hub kernels it may call (the
    `kernels` package's use_kernelized_func) and sets it back in a `finally` as it returns: under compile, a
    mutation of state outside the checkpointed region, which dynamo does not trace (a graph break per block)
    unless told that backward's recomputation need not replay forward's side effects. Set and reset within
    the one forward, that variable ends the same either way."""
    for block in layer_stack(model, guess=True):
        forward = block.forward
        if getattr(block, "gradient_checkpointing", False):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
            setattr(block, "gradient_checkpointing", False)  # transformers' own checkpoint: off for this block
            forward = _checkpointed(block, forward, checkpoint_kwargs(recompute))
        block.forward = torch.compile(forward)  # type: ignore[method-assign]


def _checkpointed(block: nn.Module, forward: Callable, how: dict[str, Any]) -> Callable:
    """`forward` recomputed in backward while training: torch's non-reentrant checkpoint, as transformers'
    own is set up (evaluation runs the plain forward)."""
    def run(*args, **kwargs):
        if not (block.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(functools.partial(forward, **kwargs), *args, **how)
    return run


class BlockForwards:
    """Counts how often `blocks` compute, through hooks on their direct children (removed by `stop`).
    transformers checkpoints a block's `forward`, not its call, so hooks on the block itself (FSDP2's, these)
    run once; its children run again when backward recomputes it, twice per micro-batch in all."""

    paused = 0  # > 0 while blocks compute for something other than training (`uncounted`)

    @classmethod
    def among(cls, model: nn.Module, classes: set[type]) -> BlockForwards:
        """A counter of the blocks of `classes` (the whole model's, found before a strategy set it up) that
        `model` holds: a pipeline rank's stages hold a few of them, in copies of the model."""
        kinds = tuple(classes)  # isinstance: FSDP2 subclasses each block it shards
        blocks = [module for module in model.modules() if isinstance(module, kinds)]  # none for no classes
        # a pipeline stage keeps its blocks in the model's ModuleList, beside stand-ins for other stages' blocks
        return cls(_stacked(model, blocks, containers=(nn.ModuleList, nn.ModuleDict)))

    def __init__(self, blocks: list[nn.Module]):
        children = [child for block in blocks for child in block.children()]
        self.num_blocks, self.children_per_block, self.calls = len(blocks), len(children) // max(len(blocks), 1), 0
        # pre-hooks: a recomputation stops early, once it has rebuilt what backward needs (torch's
        # non-reentrant checkpoint), so the last child is entered but may not return
        self.handles = [child.register_forward_pre_hook(self._count) for child in children]

    def _count(self, module, args) -> None:
        if not BlockForwards.paused:
            self.calls += 1

    def stop(self) -> dict[str, int]:
        for handle in self.handles:
            handle.remove()
        return {"blocks": self.num_blocks, "block_forwards_first_step": self.calls // max(self.children_per_block, 1)}


def uncounted(method: Callable) -> Callable:
    """`method` with the block forwards it runs left out of every BlockForwards count."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        BlockForwards.paused += 1
        try:
            return method(*args, **kwargs)
        finally:
            BlockForwards.paused -= 1
    return run


def count_blocks(config: ModelConfig, names: tuple[str, ...] | None) -> int:
    """How many transformer blocks the recipe's model has (lets the recipe's checks refuse a split before
    training starts)."""
    return len(layer_stack(meta_model(config), names))


def transformer_blocks(model: nn.Module, class_names: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the recipe's class names, else the model's _no_split_modules."""
    names = set(class_names or getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        stack = _stack_class(model)
        example = f"this model's layer stack holds {stack}: [{stack}]" if stack else "e.g. [LlamaDecoderLayer]"
        raise RecipeError(f"no transformer blocks found (looked for {sorted(names) or 'model._no_split_modules'}); "
                          f"set strategy.blocks to the block class name ({example})")
    return blocks


def _stack_class(model: nn.Module) -> str | None:
    """The class of the largest ModuleList of one class (a model's stack of blocks), if it has one."""
    stacks = [stack for stack in model.modules() if isinstance(stack, nn.ModuleList) and len(stack) >= 1
              and len({type(block) for block in stack}) == 1]
    if not stacks:
        return None
    largest = max(stacks, key=lambda stack: sum(p.numel() for p in stack.parameters()))
    return type(largest[0]).__name__


def layer_stack(model: nn.Module, class_names: tuple[str, ...] | None = None, *,
                guess: bool = False) -> list[nn.Module]:
    """The blocks a model is split at: the transformer blocks that sit in a ModuleList (the layer stack),
    in order; _no_split_modules also names one-off modules such as BertEmbeddings, which are not split.
    `guess`: for what counts blocks rather than shards them (FLOPs, memory, compile, block forwards), a model
    that names none (DistilBERT, DeBERTa) and a recipe without strategy.blocks (single has none) take the class
    of the model's largest list of one class; sharding strategies ask for strategy.blocks instead."""
    if guess and not class_names and not getattr(model, "_no_split_modules", None):
        class_names = (_stack_class(model) or "",)
    return _stacked(model, transformer_blocks(model, class_names), containers=(nn.ModuleList,))


def _stacked(model: nn.Module, blocks: list[nn.Module], *, containers: tuple[type, ...]) -> list[nn.Module]:
    """Those of `blocks` that sit in a stack of `model` (a container of those types), or all if none does."""
    stacked = {id(child) for m in model.modules() if isinstance(m, containers) for child in m.children()}
    return [b for b in blocks if id(b) in stacked] or blocks
