"""The order DeepSpeed meets a model's parameters in a step, which sets how many collective calls its buckets make:
the forward's first use of each parameter (ZeRO-3's prefetch queue, traced in the first step and replayed after)
and the order backward finishes their gradients (the gradient buckets of stages 2 and 3). Read from one forward
and backward of the planned (meta) model on fake tensors: no memory, a fraction of a second for a small model.
Neither is the parameters' registration order: a Llama block registers its norms after its attention and MLP but
runs the first before them, and its MLP's gradients finish down, up, gate."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.memory.activations import cut_blocks, fake_grouped_mm, give_pad_token
from toolkit.strategies.zero.memory import kept_gathered_limit


@dataclass(frozen=True)
class ParamOrder:
    """Indices into the model's parameters(): `forward` grouped by the module whose forward first uses them (a
    group per module, in the order those modules run; parameters no forward uses last, one group); `backward`
    the trainable ones in the order backward finishes their gradients (those it leaves without one last)."""
    forward: tuple[tuple[int, ...], ...]
    backward: tuple[int, ...]
    finished: int  # how many of `backward`, from its start, backward finished (the rest: none traced)


def block_units(model: nn.Module, config: dict, *, world_size: int) -> tuple[list[nn.Module], str]:
    """(the blocks ZeRO-3 gathers as one unit each, how it gathers for the layout line): DeepSpeed's leaf modules,
    set by engine.gather_blocks_whole before deepspeed.initialize, read by the plan's rules (collectives.py: the
    order their gradients reach the buckets). No blocks: DeepSpeed's own units, each module that holds
    parameters; the text says why, "" at 2+ ranks.

    DeepSpeed's own unit pays a Python forward hook, a backward hook, wrappers around its outputs and a fetch and
    release per module, which made a 1B Llama's step at world size 1 3.0x single's on an H200
    (docs/benchmarks.md). Blocks as units measured on this CPU (llama-tiny at 12 blocks, micro 2, accum 4, fp32,
    `toolkit compare --nproc 1`): tokens/s 0.28x single's -> 0.49x, losses bit-equal.

    Only where the step holds what it held before. DeepSpeed releases a unit after its forward unless the trace
    meets its parameters again within stage3_max_reuse_distance elements, and when it releases a leaf it counts
    the later modules' parameters recursively, the whole model at the root's backward entry: a block stays
    gathered when the forward after it is within that distance, not half of it as memory.kept_gathered_numel
    counts. So blocks are units only where the plan keeps the whole model gathered either way (all its
    parameters within half the reuse distance and the live limit: DeepSpeed's defaults, models up to 500M).
    DeepSpeed's units stay where: the model is larger; a ds_config sets stage3_module_granularity_threshold; the
    parameters are offloaded to NVMe (a block's tensors at once outnumber its swap buffers, 5 by default); any
    parameter is frozen (LoRA: DeepSpeed 0.19 released a frozen base weight inside a leaf after the forward and
    did not gather it again for the backward, "size of tensor a (0) must match"); no blocks are found; 2+ ranks:
    there blocks measured 1,078 -> 841 ms a step too, but they change the calls of the gathers that
    collectives.py predicts call for call (every module of DeepSpeed's trace prefetches, those without
    parameters too, which order.py's trace does not hook): not done there yet. Not modelled: the leaves DeepSpeed
    makes itself (zero_optimization.leaf_module, whose defaults include the Mixtral, Qwen2-MoE and Qwen3-MoE sparse
    MoE blocks, and stage3_module_granularity_threshold > 0); the plan orders their gradients as backward finishes
    them."""
    from toolkit.errors import RecipeError
    from toolkit.model.blocks import layer_stack

    if world_size > 1:
        return [], ""
    zero = config.get("zero_optimization", {})
    threshold = zero.get("stage3_module_granularity_threshold")
    if threshold is not None:
        return [], ("module by module (the ds_config's stage3_module_granularity_threshold 0)" if not threshold
                    else f"as the ds_config's stage3_module_granularity_threshold {threshold} sets")
    if zero.get("offload_param", {}).get("device") == "nvme":
        return [], "module by module (parameters offloaded to NVMe)"
    if not all(p.requires_grad for p in model.parameters()):
        return [], "module by module (frozen parameters)"
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # zero.Init left partitions
    kept = kept_gathered_limit(zero)
    if numel > kept:
        return [], (f"module by module ({numel:,} parameters, above the {kept:,} the step keeps gathered: blocks as "
                    "units would keep more)")
    try:
        blocks = list(layer_stack(model, guess=True))
    except RecipeError:
        return [], "module by module (no transformer blocks named)"
    return blocks, f"a block's parameters at once ({len(blocks)} {type(blocks[0]).__name__})"


def leaf_backward(model: nn.Module, order: ParamOrder, blocks: list[nn.Module],
                  groups: list[list[nn.Parameter]]) -> list[int]:
    """The order gradients reach ZeRO-3's buckets where `blocks` are leaf modules (DeepSpeed 0.19's
    create_reduce_and_remove_grad_hooks): a parameter outside them as backward finishes it (`order.backward`); a
    block's, all at once when its backward ends (its full backward hook, which fires after its first op's
    gradients), in the order of the optimizer's parameter groups (`groups`: decayed matrices, then the norms, each
    in registration order), where backward finishes the last of them. A block parameter backward never reaches
    is reduced with its block (DeepSpeed fills its gradient with zeros); a block none of whose gradients backward
    finishes, at the end."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    rank = {index[id(p)]: n for n, p in enumerate(p for group in groups for p in group)}
    block_of = {index[id(p)]: b for b, block in enumerate(blocks) for p in block.parameters()}
    own = [sorted({index[id(p)] for p in block.parameters() if index[id(p)] in rank}, key=lambda i: rank[i])
           for block in blocks]
    finished = order.backward[:order.finished]
    last = {block_of[i]: at for at, i in enumerate(finished) if i in block_of}
    out: list[int] = []
    for at, i in enumerate(finished):
        if i not in block_of:
            out.append(i)
        elif last[block_of[i]] == at:
            out += own[block_of[i]]
    out += [i for i in order.backward[order.finished:] if i not in block_of]
    return out + [i for b, params in enumerate(own) if b not in last for i in params]


TRACED_BLOCKS = 2  # the blocks of a stack that are traced: the first two, their one order repeated for the rest


def param_order(model: nn.Module, recipe: Recipe) -> ParamOrder:
    """The model's ParamOrder, traced once per model config, task and trainable set in this process: from its
    first two blocks where every block of its stack holds the same parameters (repeated_order), else whole."""
    key = (type(model).__name__, cast(Any, model).config.to_json_string(use_diff=False), recipe.model.task,
           tuple(p.requires_grad for p in model.parameters()))
    if key not in _TRACED:
        try:
            _TRACED[key] = repeated_order(model, recipe.strategy.blocks) or whole_order(model)
        except Exception:  # an op fake tensors cannot run: the calls as registered, an estimate (not a failed plan)
            _TRACED[key] = _registered(model)
    return _TRACED[key]


def repeated_order(model: nn.Module, blocks: tuple[str, ...] | None = None) -> ParamOrder | None:
    """The ParamOrder of a model whose stack repeats one block, from a trace of its first two blocks alone (the
    others cut from a copy, as the activation trace cuts it): their order, which must be one, renamed for each block
    of the stack. A trace costs time per op (llama3-8b's 32 blocks: 2 s; 405B's 126 would take 8), two blocks a
    fraction of it. None where the stack's blocks differ (their parameters' names, shapes or trainability), the two
    traced blocks do not run as one pattern (a module outside the stack used between them), or the cut model does
    not run: trace it whole."""
    stack = _stack(model, blocks)
    if stack is None or len(stack[1]) <= TRACED_BLOCKS:
        return None
    prefix, layers = stack
    try:
        short = cut_blocks(model, list(layers), TRACED_BLOCKS)  # a copy holding the first blocks alone
        names = [name for name, _ in short.named_parameters()]
        traced = _trace(short)
    except Exception:
        return None
    full = {name: i for i, (name, _) in enumerate(model.named_parameters())}

    def block_of(index: int) -> int | None:
        name = names[index]
        return int(name[len(prefix):].split(".", 1)[0]) if name.startswith(prefix) else None

    def renamed(index: int, block: int) -> int:
        if block_of(index) is None:
            return full[names[index]]
        return full[f"{prefix}{block}.{names[index][len(prefix):].split('.', 1)[1]}"]

    def group_block(group: tuple[int, ...]) -> int | None:
        found = {block_of(i) for i in group}
        if len(found) != 1:
            raise _Irregular
        return found.pop()

    try:
        forward = _repeat(traced[0], group_block, lambda g, b: tuple(renamed(i, b) for i in g), len(layers))
        backward = _repeat(traced[1], block_of, renamed, len(layers))
    except _Irregular:
        return None
    return _completed(model, forward, backward)


class _Irregular(Exception):
    """The traced blocks do not run as one repeated pattern."""


def _repeat(units: list, block_of: Callable[[Any], int | None], renamed: Callable[[Any, int], Any],
            count: int) -> list:
    """`units` (a trace of the first two blocks and what is around them) with the blocks' run repeated for `count`
    blocks, every unit `renamed` into the whole model (a unit outside the stack with any block: its own name): each
    block's units must run together, the two alike, and nothing between them; the trace's parameters no unit names
    (unused, unfinished) are left out, for the caller to add."""
    runs: list[tuple[int | None, list]] = []
    for unit in units:
        block = block_of(unit)  # 0, 1 or None: the traced copy holds two blocks
        if runs and runs[-1][0] == block:
            runs[-1][1].append(unit)
        else:
            runs.append((block, [unit]))
    at = [i for i, (block, _) in enumerate(runs) if block is not None]
    if len(at) != 2 or at[1] != at[0] + 1:  # each block one run, the two side by side
        raise _Irregular
    (first, one), (_, other) = runs[at[0]], runs[at[1]]
    if [renamed(u, 0) for u in one] != [renamed(u, 0) for u in other]:
        raise _Irregular
    blocks = range(count) if first == 0 else range(count - 1, -1, -1)  # forward goes up the stack, backward down
    before = [renamed(u, 0) for _, run in runs[:at[0]] for u in run]
    after = [renamed(u, 0) for _, run in runs[at[1] + 1:] for u in run]
    return [*before, *(renamed(u, b) for b in blocks for u in one), *after]


def _stack(model: nn.Module, blocks: tuple[str, ...] | None) -> tuple[str, nn.ModuleList] | None:
    """The model's stack of blocks (its qualified name with a dot, the ModuleList) where each of its blocks holds
    parameters of the same names, shapes and trainability; None otherwise."""
    from toolkit.errors import RecipeError
    from toolkit.model.blocks import layer_stack

    try:
        found = layer_stack(model, blocks, guess=True)
    except RecipeError:
        return None
    ids = [id(block) for block in found]
    stack = next(((name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and m
                  and [id(b) for b in m] == ids), None)
    if stack is None or not stack[0]:
        return None
    shapes = {tuple((n, tuple(p.shape), p.requires_grad) for n, p in block.named_parameters()) for block in found}
    return (f"{stack[0]}.", stack[1]) if len(shapes) == 1 else None


def _registered(model: nn.Module) -> ParamOrder:
    """The parameters in the order the model registers them, grouped by module; backward the reverse."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    seen: set[int] = set()
    groups = [own for own in (_first_met(module, index, seen) for module in model.modules()) if own]
    params = list(model.parameters())
    backward = tuple(i for group in reversed(groups) for i in reversed(group) if params[i].requires_grad)
    return ParamOrder(forward=tuple(groups), backward=backward, finished=len(backward))


_TRACED: dict[tuple, ParamOrder] = {}


def _first_met(module: nn.Module, index: dict[int, int], seen: set[int]) -> tuple[int, ...]:
    """The indices of `module`'s own parameters not in `seen`, now added to it."""
    own = tuple(i for i in (index[id(p)] for p in module.parameters(recurse=False)) if i not in seen)
    seen.update(own)
    return own


def whole_order(model: nn.Module) -> ParamOrder:
    """The ParamOrder from one forward and backward of the whole model."""
    return _completed(model, *_trace(model))


def _completed(model: nn.Module, forward: list[tuple[int, ...]], backward: list[int]) -> ParamOrder:
    """A trace's order with the parameters the forward never used as a last group, and the trainable ones whose
    gradient backward never finished last."""
    params = list(model.parameters())
    seen = {i for group in forward for i in group}
    unused = tuple(i for i in range(len(params)) if i not in seen)
    finished = set(backward)
    left = [i for i, p in enumerate(params) if p.requires_grad and i not in finished]
    return ParamOrder(forward=(*forward, *((unused,) if unused else ())), backward=(*backward, *left),
                      finished=len(backward))


def _trace(model: nn.Module) -> tuple[list[tuple[int, ...]], list[int]]:
    """One forward and backward of a copy of `model` on fake tensors: the groups of parameter indices in the
    order modules first use them, and the trainable ones in the order backward finishes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    copied = copy.deepcopy(model)
    give_pad_token(copied)
    forward: list[tuple[int, ...]] = []
    backward: list[int] = []
    index: dict[int, int] = {}

    seen: set[int] = set()

    def used(module: nn.Module, *args: Any) -> None:
        first = _first_met(module, index, seen)
        if first:
            forward.append(first)

    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings(), fake_grouped_mm():
        warnings.simplefilter("ignore")
        copied.to_empty(device="cpu")  # the meta weights, as fake tensors
        tie = getattr(copied, "tie_weights", None)
        if callable(tie):
            tie()  # to_empty gives a tied head a weight of its own
        params = list(copied.parameters())
        assert len(params) == len(list(model.parameters())), "the traced copy holds other parameters"
        index.update((id(p), i) for i, p in enumerate(params))
        for module in copied.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(used)
        for param in params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p: backward.append(index[id(p)]))
        copied.train()
        ids = torch.zeros((1, 8), dtype=torch.long)
        copied(input_ids=ids, attention_mask=torch.ones((1, 8), dtype=torch.long)).logits.float().sum().backward()
    return forward, backward
