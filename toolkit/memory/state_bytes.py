"""Model-state bytes per rank predicted from a model's shapes: the arithmetic each strategy's
`predict_state_bytes` composes. The model is built on the meta device (no weights, no memory); the rules are
those of the libraries' own storage: a parameter, its gradient and AdamW's two moments (the `step` counter is a
0-dim tensor and not counted, as the run's counter does not count it).

What a run measures (runinfo: distinct storages behind the strategy's parameters, gradients after the first
backward, optimizer state after the first step) is what these predict, byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq


def largest_block_bytes(model: nn.Module, recipe) -> int:
    """What a strategy that gathers a block's parameters for its compute holds at once: one transformer
    block's full parameters in the compute dtype (0 for a model without a block list)."""
    from toolkit.model.blocks import layer_stack
    from toolkit.errors import RecipeError
    from toolkit.model.precision import DTYPES

    try:
        blocks = layer_stack(model, guess=True)
    except RecipeError:
        return 0
    return max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0) * element_bytes(DTYPES[recipe.precision])


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """One rank's model states, bytes."""

    params_bytes: int
    grads_bytes: int
    optim_bytes: int  # optimizer state, and a separate fp32 master copy where the strategy keeps one

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes

    def as_dict(self) -> dict[str, int]:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes, "optim_bytes": self.optim_bytes}

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(params_bytes=self.params_bytes + other.params_bytes,
                          grads_bytes=self.grads_bytes + other.grads_bytes,
                          optim_bytes=self.optim_bytes + other.optim_bytes)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parameters(model: nn.Module) -> list[nn.Parameter]:
    """Distinct parameters in registration order (a tied weight once), as model.parameters() yields them."""
    return list(model.parameters())


LocalNumel = Callable[[str, nn.Parameter], int]  # (name, parameter) -> elements this rank stores


def whole(name: str, param: nn.Parameter) -> int:
    return param.numel()


def dim0_shard(parts: int) -> LocalNumel:
    """FSDP2's shard: dim 0 cut in `parts` chunks of ceil(d0/parts) rows, each rank's storage padded to one
    chunk (the last rank's rows may be fewer, its storage is not)."""
    def local(name: str, param: nn.Parameter) -> int:
        if param.dim() == 0:
            return 1
        return math.ceil(param.shape[0] / parts) * math.prod(param.shape[1:])
    return local


def dim0_rows(rows: int, parts: int, index: int) -> int:
    """The rows of a dim 0 of `rows` that FSDP2's shard `index` of `parts` holds unpadded: chunks of
    ceil(rows/parts), the last ones shorter or empty."""
    chunk = math.ceil(rows / parts)
    return max(0, min(chunk, rows - index * chunk))


def dim0_held(parts: int, index: int, shapes: dict[str, tuple[int, ...]] | None = None) -> LocalNumel:
    """What FSDP2's shard `index` of `parts` holds unpadded, the shape its optimizer state is made in (AdamW's
    zeros_like of the sharded parameter: measured, the last of 4 ranks holds 7,629 of a 30,522-row embedding's
    rows in its moments, 7,631 in its padded parameter and gradient storage). `shapes`: parameters already split
    (a tensor-parallel rank's)."""
    def local(name: str, param: nn.Parameter) -> int:
        shape = shapes[name] if shapes is not None else tuple(param.shape)
        return dim0_rows(shape[0], parts, index) * math.prod(shape[1:]) if shape else 1
    return local


def dim0_shard_of(shapes: dict[str, tuple[int, ...]], parts: int) -> LocalNumel:
    """FSDP2's dim-0 shard of parameters that are already split (tensor parallel: `shapes` is one TP rank's)."""
    def local(name: str, param: nn.Parameter) -> int:
        shape = shapes[name]
        return math.ceil(shape[0] / parts) * math.prod(shape[1:]) if shape else 1
    return local


def of_shapes(shapes: dict[str, tuple[int, ...]]) -> LocalNumel:
    return lambda name, param: math.prod(shapes[name])


def adam_state(named: Iterable[tuple[str, nn.Parameter]], *, dtype: torch.dtype,
               local: LocalNumel = whole, moments: LocalNumel | None = None) -> StateBytes:
    """A parameter, its gradient and AdamW's moments per parameter, all in `dtype` (torch's AdamW keeps its
    state in the parameter's dtype); frozen parameters hold no gradient and no state. `moments`: the elements
    each moment holds where they differ from the stored parameter's (FSDP2's unpadded shard: dim0_held)."""
    size = element_bytes(dtype)
    params = grads = optim = 0
    for name, param in named:
        n = local(name, param) * size
        params += n
        if param.requires_grad:
            grads += n
            optim += ADAM_MOMENTS * (moments(name, param) * size if moments is not None else n)
    return StateBytes(params_bytes=params, grads_bytes=grads, optim_bytes=optim)


def named_distinct(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())  # named_parameters() also yields a tied weight once
