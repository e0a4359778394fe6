"""A transformers model cut into pipeline stages by hand (not traced: rotary embeddings, mask building
and caches do not survive tracing). Each stage keeps the model's own modules under their own names
(`model.layers.2…`), so its parameters save and load under the whole model's names.

Two families, the ones the toolkit's tasks use:
  decoder    a causal LM laid out as model.{embed_tokens, layers, norm, rotary_emb} + lm_head whose own
             forward is exactly that (STAGED_DECODERS: Llama, Mistral, Qwen2/3, Gemma, OLMo): every stage
             rebuilds positions, rotary cos/sin and the causal mask from the padding mask it is given
  encoder    a BERT-style classifier: bert.{embeddings, encoder.layer, pooler} + dropout + classifier;
             every stage rebuilds the bidirectional mask
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from toolkit.errors import RecipeError

FAMILIES = ("decoder", "encoder")
# causal LMs (config.model_type) whose own forward is what Stage._decoder runs: embeddings, each block with the
# causal mask and one rotary cos/sin, the norm, the head (tests/test_stages.py checks each against the model's own
# logits). Others laid out alike compute more, which a stage would drop without a word: Cohere scales its logits,
# Granite its embeddings and logits, Gemma 2/3 soft-cap the logits, Gemma 3 and OLMo 3 keep a rotary table per
# layer type
STAGED_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "olmo2")


def family_of(model: Any) -> str:
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            and hasattr(model, "lm_head"):
        if model.config.model_type not in STAGED_DECODERS:
            raise RecipeError(f"pipeline: no stage layout for {type(model).__name__}: stages run embeddings, blocks, "
                              f"norm and head, which only these decoders' own forward is checked to be "
                              f"({', '.join(STAGED_DECODERS)}; others scale or cap what they compute, and a stage "
                              f"would train another model); fsdp, zero or ddp run it whole")
        return "decoder"
    bert = getattr(model, "bert", None)
    if bert is not None and hasattr(bert, "encoder") and hasattr(model, "classifier"):
        return "encoder"
    raise RecipeError(f"pipeline: no stage layout for {type(model).__name__}; supported: the causal LMs "
                      f"{', '.join(STAGED_DECODERS)} and BERT-style classifiers (bert.encoder.layer + classifier)")


def sliding_window(config: Any) -> int | None:
    """The window of sliding-window attention where some layer uses it (Mistral's sliding_window; Qwen2/3's
    sliding_attention layers), else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def check_window(config: Any, *, max_length: int) -> None:
    """Stages build the plain causal mask, which a window at least as long as every sample equals (a token sees
    the window's keys up to itself); a shorter window would be another model's attention."""
    window = sliding_window(config)
    if window is not None and window < max_length:
        raise RecipeError(f"pipeline: the model's sliding-window attention (sliding_window {window}) is not built by "
                          f"pipeline stages, and data.max_length {max_length} is longer, so stages would attend "
                          f"past the window; set data.max_length <= {window}, or run fsdp, zero or ddp")


def layer_list(model: Any) -> nn.ModuleList:
    """The model's stack of transformer blocks."""
    return model.model.layers if family_of(model) == "decoder" else model.bert.encoder.layer


class Stage(nn.Module):
    """One stage: blocks `layer_ids` of `model`, plus the embeddings (first) and the head (last)."""

    # the transformers model's own children, adopted under their own names (typed loosely: any family)
    model: Any
    lm_head: Any
    bert: Any
    dropout: Any
    classifier: Any

    def __init__(self, model: Any, *, layer_ids: list[int], first: bool, last: bool,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext):
        super().__init__()
        self.family, self.first, self.last, self.autocast = family_of(model), first, last, autocast
        self.config = model.config
        layers = layer_list(model)
        kept = nn.ModuleDict({str(i): layers[i] for i in layer_ids})  # keys = the original indices: same names
        if self.family == "decoder":
            base = model.model
            base.layers = kept
            if not first:
                base.embed_tokens = None
            if not last:
                base.norm = None
            self.model = base
            self.lm_head = model.lm_head if last else None
        else:
            bert = model.bert
            bert.encoder.layer = kept
            if not first:
                bert.embeddings = None
            if not last:
                bert.pooler = None
            self.bert = bert
            self.dropout = model.dropout if last else None
            self.classifier = model.classifier if last else None

    def blocks(self) -> list[nn.Module]:
        layers = self.model.layers if self.family == "decoder" else self.bert.encoder.layer
        return list(layers.values())

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of a tied input/output embedding: the input one (first) or the head (last)."""
        if self.first and self.family == "decoder":
            return self.model.embed_tokens.weight
        if self.last and self.family == "decoder":
            return self.lm_head.weight
        return None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            if self.family == "decoder":
                return self._decoder(x, attention_mask)
            return self._encoder(x, attention_mask)

    def _decoder(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        base = self.model
        hidden = base.embed_tokens(x) if self.first else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # an explicit mask on every stage: eager attention without one is not causal
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  position_ids=position_ids, **{_cache_arg(): None})
        cos_sin = base.rotary_emb(hidden, position_ids=position_ids)
        for layer in base.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=cos_sin, position_ids=position_ids)
        if self.last:
            return self.lm_head(base.norm(hidden))
        return hidden

    def _encoder(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        bert = self.bert
        hidden = bert.embeddings(input_ids=x) if self.first else x
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        for layer in bert.encoder.layer.values():
            hidden = layer(hidden, mask)
        if self.last:
            return self.classifier(self.dropout(bert.pooler(hidden)))
        return hidden


@functools.cache
def _cache_arg() -> str:
    """What create_causal_mask calls its (here absent) KV cache: `cache` in transformers 5.x, `past_key_values`
    before (5.x still takes that name, with a FutureWarning on every call). Read at the first stage forward, not
    at import: a process that builds no pipeline does not import transformers' masking code for it."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def tied_embedding_names(model: Any) -> tuple[str, str] | None:
    """(input embedding, output head) parameter names when the two are one tied weight."""
    if family_of(model) != "decoder" or model.lm_head.weight is not model.model.embed_tokens.weight:
        return None
    return "model.embed_tokens.weight", "lm_head.weight"
