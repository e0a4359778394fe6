"""ZeRO-3's low-memory loading. The model is built inside DeepSpeed's zero.Init through transformers' own
DeepSpeed integration (an HfDeepSpeedConfig alive while from_pretrained / from_config runs): each parameter is
partitioned over the ranks as it is created, from_pretrained fills the partitions one module at a time (rank 0's
values, gathered and partitioned again), and weights the files do not hold (a new head, a model from a config)
are initialised on rank 0 module by module. No rank holds the whole model. On resume the checkpoint's weights
are read the same way: one module's tensors at a time, gathered, filled, partitioned again. A model from a
config is the exception: rank 0 builds it whole, seeded as every other strategy builds it, and hands it over.

DeepSpeed casts a 16-bit run's parameters when they are created here, where a whole model is cast by
deepspeed.initialize: its fp32 masters start from the same rounded values either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from toolkit.checkpoint.loading import ModelSource
from toolkit.checkpoint.state import model_tensors, read_model_tensors
from toolkit.checkpoint.verify import check_model_fits, read_metadata
from toolkit.model.build import keep_used_renamings, resolve_path
from toolkit.model.tied import first_names
from toolkit.process.dist import DistEnv


def build_partitioned(source: ModelSource, *, config: dict, env: DistEnv) -> nn.Module:
    """Collective: the recipe's model (and its toggles) with every parameter a ZeRO-3 partition."""
    import deepspeed
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    deepspeed.init_distributed()  # DeepSpeed's view of the process group (its config reads the world size)
    live = HfDeepSpeedConfig(config)  # transformers holds it weakly: alive while the model is built, no longer
    try:
        model = source.pretrained()
    finally:
        unset_hf_deepspeed_config()
        del live
    if source.recipe.model.path is not None:
        keep_used_renamings(model, resolve_path(source.recipe.model.path))
    checkpoint = source.checkpoint
    if checkpoint is not None:
        metadata = read_metadata(checkpoint)  # its files checked once, not at every module
        check_model_fits(checkpoint, metadata, full_shapes(model), whole=True)  # no tensor the model lacks
        fill(model, lambda shapes: read_model_tensors(checkpoint, shapes, metadata))  # every rank reads
        fill_buffers(model, checkpoint, metadata)
    elif source.recipe.model.path is None:
        # a model from a config: zero.Init draws its random weights in another order than one whole build,
        # so rank 0 builds it as every other strategy does (seeded) and hands it over one module at a time
        whole = source.pretrained().state_dict() if env.is_main else {}
        fill(model, lambda shapes: {name: whole[name] for name in shapes} if env.is_main else None)
        del whole
    return model


def full_shapes(model: nn.Module) -> dict[str, Any]:
    """The model's checkpointed tensors (a tied weight once) -> their whole shapes (a partition's `ds_shape`)."""
    params = dict(model.named_parameters())
    return {name: getattr(params.get(name), "ds_shape", tensor.shape) for name, tensor in model_tensors(model).items()}


def fill(model: nn.Module, values: Callable[[dict[str, Any]], dict[str, torch.Tensor] | None]) -> None:
    """Collective: one module's parameters at a time gathered whole, filled from `values` (their names and
    shapes -> full tensors; None on a rank that only receives), and partitioned again from rank 0's."""
    import deepspeed

    names = first_names(model)  # a tied weight is filled once, under its first name
    done: set[int] = set()
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in done]
        if not params:
            continue
        done.update(id(p) for p in params)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            full = values({names[id(p)]: p.shape for p in params})  # gathered: the full shapes
            if full is not None:
                for param in params:
                    param.data.copy_(full[names[id(param)]])


def fill_buffers(model: nn.Module, path: Path, metadata: Metadata) -> None:
    """Collective: a checkpoint's persistent buffers (not partitioned) into every rank's model."""
    saved = set(model.state_dict())
    buffers = {n: b for n, b in model.named_buffers() if n in saved}
    if buffers:
        full = read_model_tensors(path, {n: b.shape for n, b in buffers.items()}, metadata)
        with torch.no_grad():
            for name, buffer in buffers.items():
                buffer.copy_(full[name])
