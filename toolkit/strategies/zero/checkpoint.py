"""What a ZeRO rank contributes to a checkpoint: its pieces of DeepSpeed's flat fp32 partitions (masters and
Adam moments), located by DeepSpeed's own per-parameter mappings, the ones its `safe_get_full_*` accessors
read. Written as chunks of the shared layout's full tensors by toolkit/checkpoint/fragments.py.

Stages 1-2 (and DeepSpeed's bf16 optimizer): `param._hp_mapping` says which slice of the flattened parameter
this rank's partition holds (None: another rank holds all of it). Stage 3: `grad_position` gives each
parameter's slice in the rank's flat sub-group partition; rank r holds elements [r·n, r·n + n) of the
flattened parameter (n = partition_numel; the last rank's padding is left out). Stage 0 keeps no
partitions: rank 0 gives the parameters and their Adam state whole, in fp32 from torch's optimizer, in bf16/fp16
from DeepSpeed's FP16 optimizers, which keep the fp32 masters and Adam state apart from the 16-bit parameters
(stage0_masters). On resume, every rank reads the full tensors and keeps its partition of them
(load_optimizer_state).
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.checkpoint.fragments import Fragments, Piece
from toolkit.checkpoint.state import Read

MOMENTS = ("exp_avg", "exp_avg_sq")


def readable(optimizer) -> bool:
    """False when ZeRO-3 swaps optimizer partitions to NVMe: they are not in memory to be listed."""
    return not getattr(optimizer, "swap_optimizer", False)


def stage0_masters(optimizer, inner) -> dict[int, dict[str, torch.Tensor]]:
    """Stage 0 in bf16/fp16: id(16-bit parameter) -> its fp32 master ("model") and Adam moments, views into what
    DeepSpeed's FP16 optimizers step (a resume fills them in place): a master per parameter (FP16_UnfusedOptimizer,
    the recipe's AdamW as DeepSpeed's client optimizer) or one flat master per group, the parameters' slices in
    order (FP16_Optimizer, DeepSpeed's FusedAdam). Their Adam state is keyed by the masters, never by the
    parameter: read as torch's own, a checkpoint held neither moments nor masters (and a resume zeroed the
    moments). Empty for every other optimizer."""
    views: dict[int, dict[str, torch.Tensor]] = {}
    if type(optimizer).__name__ not in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        return views
    flats = getattr(optimizer, "fp32_groups_flat", None)
    for group, params in enumerate(optimizer.fp16_groups):
        offset = 0
        for index, param in enumerate(params):
            if flats is not None:
                master, start = flats[group], offset
                offset += param.numel()
            else:
                master, start = optimizer.fp32_groups[group][index], 0
            state = inner.state.get(master, {})
            views[id(param)] = {key: tensor.view(-1).narrow(0, start, param.numel()).view(param.shape)
                                for key, tensor in (("model", master), *((m, state[m]) for m in MOMENTS if m in state))}
    return views


def fragments(module: nn.Module, *, optimizer, inner, stage: int, is_main: bool, step: float | None) -> Fragments:
    pieces: list[Piece] = []
    shapes: dict[str, tuple[int, ...]] = {}  # every key a piece may belong to
    whole: dict[str, torch.Tensor] = {}
    masters = stage0_masters(optimizer, inner) if stage == 0 else {}
    for name, param in module.named_parameters():  # a tied weight once, under its first name
        shape = tuple(param.ds_shape if stage == 3 else param.shape)  # type: ignore[attr-defined]  # ZeRO-3 adds it
        keys = {"model": f"model.{name}", **{m: f"optim.state.{name}.{m}" for m in MOMENTS}}
        if hasattr(param, "ds_id"):
            found = _stage3_pieces(param, optimizer=optimizer, inner=inner)
        elif hasattr(param, "_hp_mapping"):
            found = _mapped_pieces(param)
        else:  # no partitions (stage 0): the fp32 master (or parameter) and its Adam state, whole on rank 0
            found = None
            if is_main:
                held = masters.get(id(param)) or {"model": param.detach(), **inner.state.get(param, {})}
                whole[keys["model"]] = held["model"].detach().to(torch.float32)
                for moment, value in held.items():
                    if moment in MOMENTS:
                        whole[keys[moment]] = value.to(torch.float32)
        if found is not None:
            shapes.update({key: shape for key in keys.values()})
            pieces += [Piece(keys[kind], start, tensor) for kind, start, tensor in found]
        if step is not None and is_main and param.requires_grad:
            whole[f"optim.state.{name}.step"] = torch.tensor(float(step))
    if is_main:
        persistent = set(module.state_dict().keys())  # non-persistent buffers are not saved
        whole.update({f"model.{n}": b.detach() for n, b in module.named_buffers() if n in persistent})
    return Fragments(pieces=pieces, shapes=shapes, whole=whole)


def _mapped_pieces(param) -> list[tuple[str, int, torch.Tensor]]:
    mapping = param._hp_mapping
    if mapping is None:  # this rank's partition holds none of it
        return []
    start = mapping.lp_fragment_address.start
    found = [("model", start, mapping.hp_fragment)]
    for moment in MOMENTS:
        if mapping.optim_fragment and moment in mapping.optim_fragment:
            found.append((moment, start, mapping.optim_fragment[moment]))
    return found


def _stage3_pieces(param, *, optimizer, inner) -> list[tuple[str, int, torch.Tensor]]:
    rank = optimizer._get_param_partition_rank(param)
    if not param.requires_grad:  # frozen: no master, its (compute-dtype) partition is the weight
        flat, offset, numel = param.ds_tensor, 0, param.partition_numel()
        states: dict = {}
    else:
        group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
        flat = optimizer.fp32_partitioned_groups_flat[group]
        states = inner.state.get(flat, {})
    start = rank * numel
    real = min(numel, max(0, param.ds_numel - start))  # the last ranks' padding is not the parameter's
    if real == 0:
        return []
    found = [("model", start, flat.narrow(0, offset, real))]
    found += [(m, start, states[m].narrow(0, offset, real)) for m in MOMENTS if m in states]
    return found


def load_optimizer_state(module: nn.Module, *, optimizer, inner, stage: int, device: torch.device,
                         read: Read) -> float:
    """Each rank reads its own pieces of the checkpoint's fp32 masters and Adam moments, as DCP chunks, straight
    into DeepSpeed's flat partitions: the views `fragments` lists, which DeepSpeed's `safe_set_full_*` accessors
    write. No rank holds a full tensor (reading every full tensor on every rank cost each rank 12 bytes per
    parameter: 84 GB for 7B). Parameters outside any partition (stage 0 in fp32) read their full Adam state,
    as a ddp rank does. NVMe-swapped partitions go through the accessors, which swap them in. Returns the
    optimizer step they were saved at."""
    params = list(module.named_parameters())
    _create_state(optimizer, inner)
    if not readable(optimizer):
        return _load_through_accessors(params, optimizer=optimizer, inner=inner, stage=stage, device=device,
                                       read=read)
    frozen = {f"model.{name}" for name, param in params if not param.requires_grad}  # weights, loaded before setup
    listed = fragments(module, optimizer=optimizer, inner=inner, stage=stage, is_main=False, step=None)
    pieces = Fragments(pieces=[p for p in listed.pieces if p.key not in frozen], shapes=listed.shapes, whole={})
    optim: dict[str, torch.Tensor] = {}
    masters = stage0_masters(optimizer, inner) if stage == 0 else {}
    model: dict[str, torch.Tensor] = {}  # stage 0 in bf16/fp16: the fp32 masters (the weights loaded were rounded)
    for name, param in params:
        if not (hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")):  # whole on every rank
            state = masters.get(id(param)) or inner.state.get(param, {})  # (a frozen weight has none: no entry)
            optim.update({f"state.{name}.{key}": state[key] for key in MOMENTS if key in state})
            if "model" in state:
                model[name] = state["model"]
        if param.requires_grad:
            optim[f"state.{name}.step"] = torch.zeros(())
    read({"optim": optim, **({"model": model} if model else {})}, pieces=pieces)
    return _set_step(inner, float(optim[next(k for k in optim if k.endswith(".step"))]))


def _create_state(optimizer, inner) -> None:
    """The flat partitions' Adam state, created the way torch does it (a zero-gradient, zero-lr step); ZeRO-3
    lists its partitions in the optimizer's groups only while it steps. Then each parameter is pointed at its
    fragments of that state (link_optimizer_state)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    expose = getattr(optimizer, "_set_fp32_optimizer_param_groups", None)
    if expose is not None:
        expose()
    # with an offloaded optimizer DeepSpeed preallocates the partitions' gradients, and torch's helper
    # takes any gradient to mean the state exists: hide them for the zero-gradient step, then put them back
    held = [(p, p.grad) for group in inner.param_groups for p in group["params"]]
    try:
        for p, _ in held:
            p.grad = None
        _init_optim_state(inner)
    finally:
        for p, grad in held:
            p.grad = grad
        if expose is not None:
            optimizer._clear_fp32_optimizer_param_groups()
    link_optimizer_state(optimizer)


def _load_through_accessors(params, *, optimizer, inner, stage: int, device: torch.device, read: Read) -> float:
    """Every rank reads the full tensors and keeps its partition of them (DeepSpeed's `safe_set_full_*`). Frozen
    parameters (LoRA's base weights) have no master and no Adam state, and the save wrote no moments for them
    (every such resume was refused): their weights were loaded before setup."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    params = [(name, param) for name, param in params if param.requires_grad]
    model, optim = {}, {}
    for name, param in params:
        shape = param.ds_shape if stage == 3 else param.shape  # type: ignore[attr-defined]  # ZeRO-3 adds it
        model[name] = torch.zeros(shape, dtype=torch.float32)  # the fp32 master (bf16/fp16 weights round)
        for key in MOMENTS:
            optim[f"state.{name}.{key}"] = torch.zeros(shape, dtype=torch.float32)
        optim[f"state.{name}.step"] = torch.zeros(())
    read({"model": model, "optim": optim})
    for name, param in params:
        partitioned = hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")  # None: another rank's part
        if partitioned:
            safe_set_full_fp32_param(param, model[name].to(device))
        for key in MOMENTS:
            value = optim[f"state.{name}.{key}"].to(device)
            if partitioned:
                safe_set_full_optimizer_state(param, value, key)
            else:  # no DeepSpeed optimizer wrapper (stage 0, fp32): torch's own state per parameter
                inner.state[param][key].copy_(value)
    return _set_step(inner, float(optim[f"state.{params[0][0]}.step"]))


def _set_step(inner, step: float) -> float:
    for state in inner.state.values():
        if "step" in state:
            state["step"] = torch.tensor(step) if torch.is_tensor(state["step"]) else type(state["step"])(step)
    return step


def link_optimizer_state(optimizer) -> None:
    """ZeRO-1/2 (and DeepSpeed's bf16 optimizer) point each parameter at its fragment of the Adam state
    once, right after the first parameter group's first step: a second group's state does not exist yet
    then, so its parameters stay unlinked (DeepSpeed 0.19.8, two groups: decay and no decay). Link again
    now that every group's state exists."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
