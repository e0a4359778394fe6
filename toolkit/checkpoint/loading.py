"""Where a run's model and its starting weights come from, and how a strategy that shards parameters loads
them without any rank holding the whole model (low-memory loading).

`ModelSource.whole()` is the model every replicating strategy gets: built on CPU in its load dtype (pretrained
weights, or a seeded init from a config), with its LoRA adapters and activation checkpointing, and on resume
the checkpoint's weights. `ModelSource.empty()` is the same model with its parameters on the meta device (no
memory) and its buffers computed as the constructor computes them. A DTensor-sharded model (FSDP2) is
sharded while empty, then `load_sharded` fills each rank's shards, in the first way that applies:
  a checkpoint     DCP reads each rank's part of every tensor (it reshards whatever wrote it);
  safetensors      the pretrained files hold exactly the model's tensors: each rank reads only its slice of
                   each tensor (safetensors' get_slice), no communication, no full copy anywhere;
  rank 0           otherwise (a model from a config, LoRA adapters, pretrained files whose names from_pretrained
                   maps or completes with a new head): rank 0 builds the whole model as `whole()` does and
                   broadcasts it (torch's set_model_state_dict, broadcast_from_rank0), one tensor at a time.
A pipeline stage holds whole tensors of part of the model: it is cut from the empty model, materialized, and
`load_part` reads its tensors alone from the safetensors files (the other stages' are never read); where the files
cannot fill it, every rank builds the whole model and each stage keeps its part. ZeRO-3 builds its model inside
DeepSpeed's zero.Init through transformers' own integration (strategies/zero/init.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.process.dist import DistEnv


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    recipe: Recipe
    tokenizer: Any
    checkpoint: Path | None = None  # resume: its weights replace the pretrained ones

    def whole(self) -> nn.Module:
        """The model with its starting weights, whole, on CPU. Collective on resume (DCP reads the checkpoint)."""
        from toolkit.checkpoint import state

        model = self.pretrained()
        if self.checkpoint is not None:
            state.load_weights(model, self.checkpoint)
        return model

    def pretrained(self) -> nn.Module:
        """The model with its pretrained (or seeded) weights and its toggles, whatever the checkpoint holds."""
        from toolkit.model.build import build_model

        model = build_model(self.recipe.model, tokenizer=self.tokenizer, seed=self.recipe.seed)
        if self.recipe.train.init_perturbation:
            perturb_weights(model, self.recipe.train.init_perturbation, seed=self.recipe.seed)
        self._toggles(model)
        return model

    def empty(self) -> nn.Module:
        """The model and its toggles with parameters on the meta device and buffers computed on CPU."""
        from toolkit.model.build import empty_model

        model = empty_model(self.recipe.model, tokenizer=self.tokenizer)
        self._toggles(model)
        return model

    def _toggles(self, model: nn.Module) -> None:
        """LoRA, then activation checkpointing, then compile: each before any strategy wraps or shards a block."""
        from toolkit.model.lora import apply_lora
        from toolkit.model.blocks import compile_blocks, enable_activation_checkpointing

        if self.recipe.model.lora is not None:  # adapters in place, base frozen: every strategy wraps what it gets
            apply_lora(model, self.recipe.model.lora, task=self.recipe.model.task)
        if self.recipe.train.activation_checkpointing:
            enable_activation_checkpointing(model, self.recipe.train.recompute)
        if self.recipe.train.compile:
            compile_blocks(model, self.recipe.train.recompute)

    def weight_files(self, model: nn.Module) -> dict[str, Path] | None:
        """tensor name -> the safetensors file holding it, when the pretrained files hold exactly `model`'s
        tensors (a tied alias may be there too): then they are its starting weights as they are. None where
        from_pretrained would do more than read them (rename keys, initialise a new head) or there is nothing
        to read (a model from a config, LoRA adapters to initialise, a checkpoint)."""
        if self.recipe.model.path is None or self.recipe.model.lora is not None or self.checkpoint is not None \
                or self.recipe.train.init_perturbation:  # perturbed: what pretrained() makes of the files
            return None
        from toolkit.model.build import resolve_path

        folder = resolve_path(self.recipe.model.path)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
                files = {k: folder / "model.safetensors" for k in f.keys()}
        else:
            return None
        tensors, aliases = named_tensors(model)
        return files if set(tensors) <= set(files) <= set(tensors) | aliases else None


PERTURBATION_SEED = 7_919  # added to the recipe's seed: the perturbation's draws are not the init's


def perturb_weights(model: nn.Module, relative: float, *, seed: int) -> None:
    """Every floating-point parameter w becomes w·(1 + relative·N(0,1)), the same draws on every rank (seeded, in
    the order of named_parameters, a tied weight once). A ZeRO-3 partition holds no whole weight to perturb."""
    from toolkit.errors import RecipeError

    generator = torch.Generator().manual_seed(seed + PERTURBATION_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if hasattr(param, "ds_id"):
                raise RecipeError("train.init_perturbation: ZeRO-3 builds its weights partitioned, with none whole to "
                                  "perturb; run the perturbed start under another strategy (zero2, fsdp, single)")
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                # w + w·x·n, not w·(1 + x·n): 1 + 1e-7·n on fp32's grid near 1 (steps of 6e-8 below, 1.2e-7
                # above) would be a coarse and biased factor
                weight = param.float()
                param.copy_((weight + weight * (relative * noise)).to(param.dtype))


def named_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The model's state_dict entries with a tied weight once, and the names of its tied aliases."""
    from toolkit.model.tied import without_tied_aliases

    full = model.state_dict()
    kept = without_tied_aliases(model, full)
    return kept, set(full) - set(kept)


def materialize(model: nn.Module, *, device: torch.device) -> None:
    """Allocate a model sharded on the meta device (its shards, uninitialised) and put back the buffers it was
    built with (to_empty empties them too)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    to_empty_tied(model, device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def to_empty_tied(model: nn.Module, *, device: torch.device | str) -> None:
    """`model.to_empty(device)`, its tied weights tied again: to_empty gives each module its own new parameter
    (FSDP2's parameters, swapped in place, stay tied)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (owner, name), *others in (found for found in holders.values() if len(found) > 1):
        for module, other in others:
            if getattr(module, other) is not getattr(owner, name):
                setattr(module, other, getattr(owner, name))


def load_sharded(model: nn.Module, source: ModelSource, *, env: DistEnv) -> str:
    """Fill the shards of a materialized DTensor model with the run's starting weights (collective); returns
    how, in words (run.json, the start line)."""
    from toolkit.checkpoint import state

    if source.checkpoint is not None:
        state.load_weights(model, source.checkpoint)  # DCP: each rank reads its part, resharded
        return f"each rank read its shards of {source.checkpoint}"
    files = source.weight_files(model)
    if files is not None:
        tensors, _ = named_tensors(model)
        _read_slices(tensors, files)
        return "each rank read only its slices of the pretrained safetensors files"
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = source.whole().state_dict() if env.is_main else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    return "rank 0 built the whole model and broadcast it tensor by tensor"


def load_part(part: nn.Module, files: dict[str, Path], *, aliases: dict[str, str]) -> None:
    """Fill a materialized part of a model (a pipeline stage: whole tensors under the whole model's names) from
    the pretrained files `files` (ModelSource.weight_files of the whole model); `aliases`: a tied weight's names ->
    the one the files hold it under (a last stage's lm_head.weight is the file's model.embed_tokens.weight)."""
    tensors = {name: tensor for name, tensor in part.state_dict(keep_vars=True).items()
               if aliases.get(name, name) in files or name in files}
    missing = sorted(set(part.state_dict()) - set(tensors) - {n for n, _ in part.named_buffers()})
    if missing:
        raise RuntimeError(f"the pretrained files hold no tensor for {missing[:3]} of this part of the model")
    # by the name the files hold each under (a tied weight's two names: one tensor, read once)
    stored = {name if name in files else aliases[name]: target.detach() for name, target in tensors.items()}
    _read_slices(stored, {name: files[name] for name in stored})


def _read_slices(tensors: dict[str, torch.Tensor], files: dict[str, Path]) -> None:
    """Copy into each local shard the slice of its tensor that this rank holds, read from the file alone. One
    tensor per opening: safe_open maps the whole file, and the pages a read touches stay in this process's
    resident set until the file is closed (measured: 1.3 GB more peak RSS per rank, on a 1.2 GB file, when one
    opening read every tensor). The largest first: a read holds the file's pages of its tensor beside the tensors
    already filled (an empty tensor holds no page until written), so read last, a 119 MiB tied head (the 302M
    Llama's last pipeline stage) had put its whole size on top of the stage's setup peak (measured: +22 % over the
    stage's parameters, against +4 % on the first stage, which reads its embedding first)."""
    from safetensors import safe_open

    for name, target in sorted(tensors.items(), key=lambda item: -item[1].numel()):
        with safe_open(str(files[name]), framework="pt") as f, torch.no_grad():
            _read_slice(f, name, target)


def _read_slice(f, name: str, target: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        target.copy_(f.get_tensor(name))
        return
    local = target.to_local()
    if all(isinstance(p, (Shard, Replicate)) for p in target.placements):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        piece = f.get_slice(name)[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    else:  # a strided layout (FSDP over TP): torch cuts this rank's part from the whole tensor
        whole = f.get_tensor(name).to(local.dtype)
        piece = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
    local.copy_(piece.to(local.dtype))


def own_memory(model: nn.Module) -> int:
    """Where `model` keeps only part of a weight file it was loaded from, its host tensors in that file get memory
    of their own, one at a time, so the file is unmapped; returns the bytes moved.
    transformers loads safetensors by mapping the file: its weights are views into that mapping, which stays open
    while any of them lives, and every page of it that was ever read (the replica check reads them all) stays
    resident. A strategy that keeps some weights as loaded and drops the others (tensor parallel's slices, its
    sequence-parallel norms, which are DTensors whose local tensor is the loaded one; a pipeline's other stages)
    would otherwise hold the file's pages of what it dropped for the whole run (measured on a 291 MiB model at TP
    2: 172 MiB per rank, the split layers' full size). A model that keeps the whole file is left as it is:
    copying would only add a transient copy, and N ranks' unwritten pages (frozen LoRA weights) are shared."""
    # per mapping, not per file: a file mapped twice (another live model loaded from it) is kept whole by a model
    # that holds all of its own mapping
    mappings = [(start, end) for ranges in _mapped_files().values() for start, end in ranges]
    by_mapping: dict[tuple[int, int], list[torch.Tensor]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's part
        if local.device.type != "cpu" or local.is_meta or not local.numel():
            continue
        address = local.untyped_storage().data_ptr()
        mapping = next(((a, b) for a, b in mappings if a <= address < b), None)
        if mapping is not None:
            by_mapping.setdefault(mapping, []).append(local)
    moved = 0
    with torch.no_grad():
        for (start, end), kept in by_mapping.items():
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
            if sum(storages.values()) >= 0.99 * (end - start):  # all of it (a header aside)
                continue
            for local in kept:
                local.data = local.data.clone()
                moved += local.numel() * local.element_size()
    return moved


def _mapped_files() -> dict[str, list[tuple[int, int]]]:
    """This process's mappings of regular files: path -> the address range of each mapping of it (the kernel's
    lines of one mapping, consecutive in address and file offset, joined; Linux /proc; none where it cannot be
    read). Devices, shared memory and anonymous files are not weight files."""
    files: dict[str, list[tuple[int, int]]] = {}
    ends: dict[str, tuple[int, int]] = {}  # path -> where its last line ended: address, file offset
    try:
        with open("/proc/self/maps") as handle:
            for line in handle:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[4] == "0":
                    continue
                path = fields[5].strip()
                if not path.startswith("/") or path.startswith("/dev/") or path.endswith("(deleted)"):
                    continue
                start, end = (int(address, 16) for address in fields[0].split("-"))
                offset = int(fields[2], 16)
                ranges = files.setdefault(path, [])
                if ranges and ends[path] == (start, offset):  # the same mapping, its next line
                    ranges[-1] = (ranges[-1][0], end)
                else:
                    ranges.append((start, end))
                ends[path] = (end, offset + end - start)
    except OSError:
        pass
    return files


def whole_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters this process holds whole (not on the meta device, not a ZeRO-3 partition, not a DTensor
    shard: a model laid out as it loads, hf_native's)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if not param.is_meta and not hasattr(param, "ds_id") and not isinstance(param, DTensor):
            yield name, param


def whole_model_bytes(model: nn.Module, recipe: Recipe) -> int:
    """The whole model's weights in its load dtype (`model` may be on the meta device)."""
    from toolkit.model.precision import DTYPES

    return sum(p.numel() for p in model.parameters()) * DTYPES[recipe.model.load_dtype].itemsize


def num_parameters(model: nn.Module) -> int:
    """Every parameter's element count, also of an empty (meta) or ZeRO-3-partitioned model."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
