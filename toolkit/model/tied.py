"""Tied weights' names, in one place: a weight two modules share (an embedding and the head tied to it) has
several names and one tensor. Its canonical name is the first one `named_parameters()` gives; checkpoints,
optimizer state, exports and gathers all use that one, so every strategy writes and reads the same keys."""

from __future__ import annotations

from typing import Any

from torch import nn


def first_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name (a tied weight's canonical name, as named_parameters() gives it)."""
    return {id(p): n for n, p in module.named_parameters()}


def head_tied_to_embedding(model: nn.Module) -> bool:
    """Whether a model's output layer holds its input embedding's weight (one tensor, two modules)."""
    transformers_model: Any = model  # a PreTrainedModel: it names its embeddings
    head, embedding = transformers_model.get_output_embeddings(), transformers_model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of its tensor (a tied weight's names -> its canonical one)."""
    first = first_names(model)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def without_tied_aliases(module: nn.Module, state_dict: dict) -> dict:
    """Keep one name per tied parameter (the first, e.g. `model.embed_tokens.weight`, not `lm_head.weight`).

    How save_pretrained treats a tied pair depends on whether the two entries share storage, which
    differs between strategies (copies here, one gathered tensor there); dropping the aliases first
    gives every strategy the same file, and from_pretrained re-ties them from the config."""
    aliases = {name for name, first in tied_aliases(module).items() if name != first}
    return {k: v for k, v in state_dict.items() if k not in aliases}
