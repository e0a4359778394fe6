"""LoRA through peft: adapters injected into the transformers model in place (`get_peft_model` adapts the model
object itself, which every strategy then wraps as usual; parameter names gain `base_layer` / `lora_A.default`),
the base frozen. Export writes the adapter with peft's own `save_pretrained` and, when asked, the merged model
(`merge_and_unload`), both from the gathered full weights on rank 0."""

from __future__ import annotations

import warnings

from torch import nn

from toolkit.config.recipe import LoraOptions
from toolkit.errors import RecipeError

TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}


def lora_config(options: LoraOptions, *, task: str):
    from peft import LoraConfig

    return LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
                      target_modules=list(options.target_modules) if options.target_modules else None,
                      task_type=TASK_TYPES[task])


def adapted(model: nn.Module, options: LoraOptions, *, task: str):
    """peft's `get_peft_model`, without the FutureWarning it raises itself by reading transformers'
    deprecated `is_gradient_checkpointing` (peft's call, not the recipe's: nothing for a user to change)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora_config(options, task=task))


def _linear_layers(model: nn.Module) -> dict[str, int]:
    """The layers LoRA adapts, by name: the width (the smaller of in and out features) of each nn.Linear and
    transformers' Conv1D (GPT-2's attention and MLP, weights stored in × out)."""
    from transformers.pytorch_utils import Conv1D

    return {name: min(module.weight.shape) for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, Conv1D))}


def apply_lora(model: nn.Module, options: LoraOptions, *, task: str) -> nn.Module:
    """Adapters on `model`'s target layers, in place; everything else frozen (a classification head stays
    trainable: peft's SEQ_CLS keeps it in modules_to_save). Returns the same model object."""
    linear = _linear_layers(model)
    widths = list(linear.values())
    if widths and options.r > max(widths):  # peft would allocate r × (in + out) per layer all the same
        raise RecipeError(f"model.lora.r {options.r} is above the width of every layer of the model (at most "
                          f"{max(widths)}): a larger rank adds parameters, not capacity; 8 or 16 are usual")
    check_tied_output(model, options)
    try:
        peft_model = adapted(model, options, task=task)
    except ValueError as exc:  # peft: target modules that match no layer of the model
        layers = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise RecipeError(f"model.lora.target_modules: {exc.args[0].split('.')[0]}; this model's linear layers "
                          f"are named {', '.join(layers)}") from None
    inner = peft_model.base_model.model
    assert inner is model  # peft adapts the model in place
    return inner


def check_tied_output(model: nn.Module, options: LoraOptions) -> None:
    """An output layer whose weight is the input embedding's (tie_word_embeddings) cannot take an adapter: merged,
    its delta would change the embedding too, which the trained model never had (and the adapter's export fails
    on the shared weight). Refused in one line, before any step."""
    get_output, get_input = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    output = get_output() if callable(get_output) else None
    embedding = get_input() if callable(get_input) else None
    if output is None or embedding is None or getattr(output, "weight", None) is not embedding.weight:
        return
    name = next((n for n, m in model.named_modules() if m is output), None)
    if name is None:  # not a module of the model (no name to match a target against)
        return
    target = next((t for t in options.target_modules or () if name == t or name.endswith(f".{t}")), None)
    if target is not None:
        layer = target if name == target else f"{target} ({name})"
        raise RecipeError(f"model.lora.target_modules: {layer} shares its weight with the input embedding "
                          "(tie_word_embeddings): its adapter, merged, would change the embedding too; leave "
                          f"{target} out, or untie them (tie_word_embeddings false in the model's config)")


def merged_model(model: nn.Module, options: LoraOptions, *, task: str, load) -> nn.Module:
    """`model` with the adapters `options` describe, filled by `load(model)` (a checkpoint's weights, under the
    adapted names: base_layer, lora_A.default), then merged into plain layers (peft's merge_and_unload): what
    `toolkit convert` writes for a LoRA run, loadable with from_pretrained alone."""
    peft_model = adapted(model, options, task=task)
    load(peft_model.base_model.model)
    return peft_model.merge_and_unload()
