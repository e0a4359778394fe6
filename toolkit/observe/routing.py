"""A mixture-of-experts model's experts: how many, where the model's expert-parallel plan puts them, and how many
tokens each one was routed per step (the load a run reports beside its loss).

transformers' MoE models (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GraniteMoE, ...) declare an `ep_plan` naming each
layer's experts module (`ep_dispatch_experts`) and its stacked weights (`grouped_gemm`); the experts module is called
as `experts(hidden_states, top_k_index, top_k_weights)` with the router's choices as global expert ids, under every
layout (expert parallel dispatches the tokens inside that call), so its input is where the routing is counted.
"""

from __future__ import annotations

import contextlib
import re
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from torch import nn

from toolkit.process.dist import DistEnv, all_reduce_sum

DISPATCH = "ep_dispatch_experts"  # the plan's style for a module whose forward the tokens reach by all-to-all
STACKED = "grouped_gemm"  # the plan's style for an experts weight stacked over the experts on dim 0


def num_experts(config) -> int:
    """The experts per MoE layer a transformers config declares (0: a dense model)."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def plan_of(model: nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan, its `*` expanded to the layers it has: module or parameter name -> style."""
    plan = dict(getattr(model, "ep_plan", None) or {})
    names = [name for name, _ in model.named_modules()] + [name for name, _ in model.named_parameters()]
    expanded: dict[str, str] = {}
    for pattern, style in plan.items():
        match = re.compile(re.escape(pattern).replace(r"\*", r"\d+")).fullmatch
        expanded.update({name: style for name in names if match(name)})
    return expanded


# the tokens (1) and padding (0) of a forward that passes the model no attention mask: context parallel's share of
# each sequence, whose attention reads the mask another way (strategies/dims/context.py)
_TOKENS: ContextVar[torch.Tensor | None] = ContextVar("routing_tokens", default=None)


@contextlib.contextmanager
def counted_tokens(mask: torch.Tensor) -> Iterator[None]:
    """Inside, a forward without an attention mask counts the tokens `mask` marks ([batch, length])."""
    token = _TOKENS.set(mask)
    try:
        yield
    finally:
        _TOKENS.reset(token)


class RoutingCounter:
    """Per MoE layer, how many (token, slot) pairs chose each expert during one step's forwards: a forward pre-hook
    on every experts module reads its top_k_index. Padding is left out (the model's attention mask, read by a hook
    on the model, marks it): the experts compute padding positions too, but how many there are depends on how a
    layout cuts the batch into micro-batches, and the counts are meant to compare layouts. A recompute under
    activation checkpointing runs inside backward and is not counted again. `take` sums the counts over the ranks
    (collective)."""

    def __init__(self, model: nn.Module, modules: dict[int, nn.Module], *, layers: int, experts: int,
                 copies: int) -> None:
        self.counts = torch.zeros(layers, experts, dtype=torch.float64)
        self.experts, self.copies = experts, copies
        self.totals = [[0] * experts for _ in range(layers)]  # over the run's steps so far
        self.spreads: list[float] = []
        self.mask: torch.Tensor | None = None  # the running forward's attention mask
        for layer, module in modules.items():  # for the process's life: the run's model is counted to its end
            module.register_forward_pre_hook(self._hook(layer), with_kwargs=True)
        model.register_forward_pre_hook(self._keep_mask, with_kwargs=True)

    @classmethod
    def among(cls, model: nn.Module, *, copies: int = 1) -> RoutingCounter | None:
        """A counter on `model`'s experts modules, or None for a dense model. `copies`: how many ranks route the
        same tokens through a layer (a tensor-parallel group's), each counted once."""
        config: Any = getattr(model, "config", None)
        experts = num_experts(config) if config is not None else 0
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        modules = {}
        for name, style in plan_of(model).items():
            index = re.search(r"\.(\d+)\.", f".{name}.")
            if style == DISPATCH and index is not None:
                modules[int(index.group(1))] = model.get_submodule(name)
        if not experts or not modules or not layers:
            return None
        return cls(model, modules, layers=layers, experts=experts, copies=copies)

    def _keep_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = _TOKENS.get()
        self.mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _hook(self, layer: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if torch._C._current_graph_task_id() != -1:  # inside backward: activation checkpointing's recompute
                return
            chosen = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if chosen is not None:
                local = chosen.to_local() if hasattr(chosen, "to_local") else chosen
                rows = local.reshape(-1, local.shape[-1])
                if self.mask is not None and self.mask.numel() == rows.shape[0]:  # one row per position
                    rows = rows[self.mask.reshape(-1).to(rows.device).bool()]
                if self.counts.device != rows.device:  # counted where the routing is: no device sync per layer
                    self.counts = self.counts.to(rows.device)
                self.counts[layer] += torch.bincount(rows.reshape(-1), minlength=self.experts).double()
        return count

    def reset(self) -> None:
        self.counts.zero_()

    def take(self, env: DistEnv) -> list[list[int]]:
        """Collective: the step's counts over every rank, per layer and expert, then reset."""
        total = all_reduce_sum(self.counts.clone(), env).cpu() / self.copies
        self.reset()
        counts = [[int(round(v)) for v in row] for row in total.tolist()]
        self.totals = [[a + b for a, b in zip(old, new)] for old, new in zip(self.totals, counts)]
        self.spreads.append(spread(counts))
        return counts

    def summary(self) -> dict[str, Any]:
        """run.json's `experts`: the tokens each expert of each layer was routed over the run's steps, and the
        load-balance spread (spread()) per step: its mean and largest."""
        return {"layers": len(self.totals), "experts": self.experts, "tokens_per_expert": self.totals,
                "spread_mean": sum(self.spreads) / len(self.spreads) if self.spreads else None,
                "spread_max": max(self.spreads, default=None), "steps": len(self.spreads)}


def busiest_share(row: list[int]) -> float:
    """One layer's busiest expert's tokens over an even share (1.0: balanced, or no tokens; the number of experts:
    one expert took everything)."""
    return max(row) / (sum(row) / len(row)) if sum(row) else 1.0


def spread(counts: list[list[int]]) -> float:
    """The load-balance spread of one step: busiest_share of its worst MoE layer."""
    return max(map(busiest_share, counts), default=1.0)
