"""What activation checkpointing runs again, in backward, of a block's forward: read from the model itself.

transformers checkpoints each block (each GradientCheckpointingLayer) with torch's non-reentrant checkpoint, whose
recompute stops early (torch.utils.checkpoint's early stop, on by default): once it has rebuilt the last tensor the
block's forward saved for backward, it leaves the block. What the forward did after that is not done again. In a
Llama block that is the MLP's output projection's exit (tensor parallel's all-reduce of its output, a
reduce-scatter under sequence parallelism) and the residual add: measured with the collective counter, 5 all-reduces
per block and micro-batch under tensor parallel, not 6. A block that normalises or drops out after that projection
(OLMo 2, Gemma 3, BERT) saves a tensor after it, and runs it again.

Which modules' outputs come after the last tensor their block saves is read from one training-mode forward of the
model on the meta device (no memory, no arithmetic), through saved-tensor hooks and forward hooks: no table of
families, and a model's own order of execution, whatever order it registers its modules in."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

_SEEN: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], set[str]]] = weakref.WeakKeyDictionary()


def forward_runs(model: nn.Module, names: Iterable[str], *, recompute: bool) -> dict[str, int]:
    """How often each module of `names` runs its forward per micro-batch of training: twice where activation
    checkpointing (`recompute`) runs it again in backward, once where it does not (outside a checkpointed block, or
    after the last tensor its block saves)."""
    names = tuple(names)
    if not recompute:
        return dict.fromkeys(names, 1)
    known = _SEEN.setdefault(model, {})
    if names not in known:
        known[names] = _recomputed(model, names)
    return {name: 2 if name in known[names] else 1 for name in names}


def _recomputed(model: nn.Module, names: tuple[str, ...]) -> set[str]:
    """Those of `names` inside a checkpointed block with a tensor saved for backward after their output."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # here: a plan without tp imports none

    from toolkit.model.blocks import layer_stack

    modules = dict(model.named_modules())
    # what transformers checkpoints: its per-layer blocks, or (a model of the older form, which checkpoints each
    # layer of its stack through a flag) the layer stack
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)] or \
        layer_stack(model, guess=True)
    block_of = {id(m): block for block in blocks for m in block.modules()}
    saved = 0  # tensors saved for backward so far in the forward
    at_output: dict[str, int] = {}  # a module's count at its (last) output
    at_end: dict[int, int] = {}  # a block's count at its end
    hooks = [modules[name].register_forward_hook(lambda *_, name=name: at_output.__setitem__(name, saved))
             for name in names]
    hooks += [block.register_forward_hook(lambda block, *_: at_end.__setitem__(id(block), saved)) for block in blocks]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    training = {m: m.training for m in model.modules()}
    device = next(model.parameters()).device
    try:
        model.train()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            _forward(model, device)
    except Exception:  # noqa: BLE001 - a forward the meta device cannot run (one that reads values, or needs
        # other inputs): every layer of a block counted as run again, at most what the recompute issues
        return {name for name in names if id(modules[name]) in block_of}
    finally:
        for hook in hooks:
            hook.remove()
        for module, mode in training.items():
            module.training = mode
    again = set()
    for name in names:
        block = block_of.get(id(modules[name]))
        if block is not None and name in at_output and at_output[name] < at_end.get(id(block), 0):
            again.add(name)
    return again


def _forward(model: nn.Module, device: torch.device) -> None:
    """One 8-token sample through `model`: a whole model from its ids; a pipeline stage (toolkit.model.stages.Stage)
    from what it receives, ids on the first stage, hidden states on the others."""
    from toolkit.model.stages import Stage

    ids = torch.zeros(1, 8, dtype=torch.long, device=device)
    if not isinstance(model, Stage):
        model(input_ids=ids)
        return
    hidden = ids if model.first else torch.zeros(1, 8, model.config.hidden_size, device=device, requires_grad=True)
    # no mask, and the model's own cache setting: without either transformers reads values (a mask's, or the
    # positions' to find packed samples), which the meta device has none of; as the whole model is traced above
    options, model.options = model.options, {}
    try:
        model(hidden, None)
    finally:
        model.options = options
