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
from typing import Any, cast

import torch
from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.memory.activations import fake_grouped_mm, give_pad_token


@dataclass(frozen=True)
class ParamOrder:
    """Indices into the model's parameters(): `forward` grouped by the module whose forward first uses them (a
    group per module, in the order those modules run; parameters no forward uses last, one group); `backward`
    the trainable ones in the order backward finishes their gradients (those it leaves without one last)."""
    forward: tuple[tuple[int, ...], ...]
    backward: tuple[int, ...]


def param_order(model: nn.Module, recipe: Recipe) -> ParamOrder:
    """The model's ParamOrder, traced once per model config, task and trainable set in this process."""
    key = (type(model).__name__, cast(Any, model).config.to_json_string(use_diff=False), recipe.model.task,
           tuple(p.requires_grad for p in model.parameters()))
    if key not in _TRACED:
        try:
            _TRACED[key] = _traced(model)
        except Exception:  # an op fake tensors cannot run: the calls as registered, an estimate (not a failed plan)
            _TRACED[key] = _registered(model)
    return _TRACED[key]


def _registered(model: nn.Module) -> ParamOrder:
    """The parameters in the order the model registers them, grouped by module; backward the reverse."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    seen: set[int] = set()
    groups = [own for own in (_first_met(module, index, seen) for module in model.modules()) if own]
    params = list(model.parameters())
    backward = tuple(i for group in reversed(groups) for i in reversed(group) if params[i].requires_grad)
    return ParamOrder(forward=tuple(groups), backward=backward)


_TRACED: dict[tuple, ParamOrder] = {}


def _first_met(module: nn.Module, index: dict[int, int], seen: set[int]) -> tuple[int, ...]:
    """The indices of `module`'s own parameters not in `seen`, now added to it."""
    own = tuple(i for i in (index[id(p)] for p in module.parameters(recurse=False)) if i not in seen)
    seen.update(own)
    return own


def _traced(model: nn.Module) -> ParamOrder:
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
    unused = tuple(i for i in range(len(params)) if i not in seen)
    finished = set(backward)
    left = [i for i, p in enumerate(params) if p.requires_grad and i not in finished]
    return ParamOrder(forward=(*forward, *((unused,) if unused else ())), backward=(*backward, *left))
