"""The gradient norm's collectives, where gradients are DTensors (fsdp, tp, their compositions): what the global
clip (the loop's max_grad_norm, computed every step) moves, found by the collective counter once it saw inside
DTensor's ops (measured at 2 and 4 ranks: tp, tp + sequence parallel, fsdp, HSDP, fsdp × tp, cp, ep).

torch's get_total_norm takes one norm per gradient. A gradient sharded over a mesh dimension gives a partial norm
there; the norms of one group (gradients of one mesh and placements: the toolkit's clip_global_norm, or fsdp's
single group) are stacked and made whole by one all-reduce of the stacked vector per sharded mesh dimension of
more than one rank. A gradient that is a partial sum (a sequence-parallel norm's under tp alone, computed on the
rank's tokens) is all-reduced whole twice: for its norm and again in the optimizer's step, both inside DTensor's
ops; the gradient itself stays partial.
"""

from __future__ import annotations

from torch import nn

from toolkit.cost.collectives import Collective
from toolkit.memory.state_bytes import element_bytes
from toolkit.model import tp_plan
from toolkit.strategies.dims.comm import sequence_parallel_params

Dims = tuple[tuple[str, int], ...]  # the mesh dimensions a group of gradients is sharded over: names and sizes


def norm_collectives(groups: dict[str, tuple[int, Dims]], *, dtype) -> list[Collective]:
    """`groups`: a group's name -> (how many gradients it holds, the mesh dimensions it is sharded over: their
    names and sizes); `dtype`: the gradients' (their norms keep it)."""
    return [Collective(op="all_reduce", payload_bytes=count * element_bytes(dtype), calls=1, group=dim,
                       group_size=size, phase="step", what=f"the gradient norm's partial norms ({name})")
            for name, (count, dims) in groups.items() for dim, size in dims if size > 1]


def partial_gradient_norms(params: list[nn.Parameter], *, tp: int, dtype) -> list[Collective]:
    """Gradients that are partial sums over `tp` (sequence-parallel norms under tp alone): each all-reduced whole for
    its norm and again in the optimizer's step."""
    numel = sum(p.numel() for p in params)
    return [Collective(op="all_reduce", payload_bytes=2 * numel * element_bytes(dtype), calls=2 * len(params),
                       group="tp", group_size=tp, phase="step",
                       what="partial gradients, for the norm and the step")] if numel and tp > 1 else []


def by_layout(model: nn.Module, *, shard: int, tp: int = 1, loss_parallel: bool = False,
              sequence_parallel: bool = False, shard_dim: str = "dp_shard") -> dict[str, tuple[int, Dims]]:
    """Groups of a model whose trainable gradients FSDP shards over `shard` ranks (1: none) and tensor parallel
    splits over `tp`: the split layers' weights by their split dimension (a column-wise bias with its weight), under
    `loss_parallel` the output layer (and a tied embedding) with the column-wise ones; what tensor parallel keeps
    whole but holds as DTensors of its mesh (a row-wise bias, sequence-parallel norms), whose FSDP shards are 2-D
    DTensors, a group apart from the rest, FSDP's 1-D ones (clip_global_norm groups them by mesh and placements)."""
    styles = tp_plan.resolve(model) if tp > 1 else {}
    vocab = set(tp_plan.vocab_modules(model, degree=tp)) if tp > 1 and loss_parallel else set()
    sp_norms = {id(p) for p in sequence_parallel_params(model)} if tp > 1 and sequence_parallel else set()
    groups: dict[str, tuple[int, Dims]] = {}
    whole: Dims = ((shard_dim, shard),)
    split: Dims = ((shard_dim, shard), ("tp", tp))
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module, _, kind = name.rpartition(".")
        style = styles.get(module)
        sizes: Dims
        if style in tp_plan.COLUMN_WISE or module in vocab:
            key, sizes = "split on dim 0 over tp", split
        elif style in tp_plan.ROW_WISE and kind == "weight":
            key, sizes = "split on dim 1 over tp", split
        elif style in tp_plan.ROW_WISE or id(param) in sp_norms:
            key, sizes = "whole over tp, on its mesh", whole
        else:
            key, sizes = "whole over tp" if tp > 1 else "every gradient", whole
        groups[key] = (groups.get(key, (0, sizes))[0] + 1, sizes)
    return groups
