"""A model's transformers config, checked before any model is built: what transformers' config classes accept
but no run should (sizes below 1, a key the class lacks, a model type without the task's head, key/value heads
that do not divide the heads), and their own refusals, each as one line naming the recipe key."""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Callable, Iterator, TypeGuard

from toolkit.config.recipe import ModelConfig
from toolkit.errors import RecipeError


def auto_class(config: ModelConfig):
    import transformers

    return (transformers.AutoModelForCausalLM if config.task == "causal-lm"
            else transformers.AutoModelForSequenceClassification)


# sizes a transformer config holds that must be at least 1 (names across the model families transformers has);
# at 0 or below a config class divides by zero or a model builds tensors of negative size
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head",
               "n_positions", "d_model", "d_ff", "d_kv", "num_layers", "num_heads", "ffn_dim")


def check_sizes(fields: dict, config: ModelConfig) -> None:
    """Sizes of 1 or more, a rotary base above 0, and dropout probabilities within [0, 1]: a config class takes
    attention_dropout 2, and the run stopped in its first forward with torch's traceback, its output folder
    written; rope_theta -1, at its first step's non-finite loss."""
    for name in SIZE_FIELDS:
        value = fields.get(name)
        if _number(value) and value < 1:
            raise RecipeError(f"{config_key(config)}: {name} is {value}; a size must be 1 or more")
    rope = fields.get("rope_parameters")
    theta = fields.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
    if _number(theta) and not theta > 0:
        raise RecipeError(f"{config_key(config)}: rope_theta is {theta}; the rotary embedding's base must be above 0 "
                          f"(a base of 0 or below gives NaN positions: the run stops at its first step)")
    for name, value in fields.items():
        if _is_dropout(name) and _number(value) and not 0 <= value <= 1:
            raise RecipeError(f"{config_key(config)}: {name} is {value}; a dropout probability must be in [0, 1]")


def _number(value) -> TypeGuard[int | float]:
    """An int or float a config holds (a bool is neither here: use_cache, tie_word_embeddings)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_dropout(name: str) -> bool:
    """A config field holding a dropout probability, by the names transformers' families give them:
    attention_dropout, hidden_dropout_prob, classifier_dropout, resid_pdrop, ..."""
    return "dropout" in name or name.endswith("pdrop")


def check_routing(built, config: ModelConfig) -> None:
    """A mixture-of-experts config routes each token to num_experts_per_tok of its experts: from 1 to as many as
    there are. Config classes take any number, and the run stopped in its first forward with torch's traceback
    ("selected index k out of range" for 9 of 8 experts), its output folder written."""
    from toolkit.observe.routing import num_experts

    experts, top_k = num_experts(built), getattr(built, "num_experts_per_tok", None)
    # one expert: a dense model in some families (Jamba's num_experts 1 builds plain MLPs, its top-k unused), so
    # only more than one is checked
    if experts > 1 and isinstance(top_k, int) and not 1 <= top_k <= experts:
        raise RecipeError(f"{config_key(config)}: num_experts_per_tok is {top_k} with {experts} experts a layer; each "
                          f"token is routed to 1 to {experts} of them")


def check_unknown_fields(built, fields: dict, config: ModelConfig) -> None:
    """A model.config key that is a near miss of one of the config class's fields (num_hidden_layer for
    num_hidden_layers): transformers keeps it as an attribute no model reads, so the run would silently use the
    default. Other keys the class does not declare pass, as transformers lets them: many are read all the same
    (T5's decoder_start_token_id, a generation setting) or are metadata copied from a config.json (n_ctx,
    gradient_checkpointing, auto_map). Legacy keys the class converts (rope_theta into rope_parameters) leave no
    attribute of their own."""
    import difflib

    import transformers

    try:
        known = set(type(built)().to_dict())
    except Exception:  # noqa: BLE001 - a config class without defaults: nothing to compare against
        return
    read_anyway = set(transformers.GenerationConfig().to_dict())
    for name in sorted(set(built.to_dict()) - known - read_anyway):
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8) if name in fields else []
        if near:
            raise RecipeError(f"model.config: {name} is not a field of {type(built).__name__} (did you mean "
                              f"{near[0]}?); fix or remove it")


def check_architecture(built, config: ModelConfig) -> None:
    """What transformers' config classes accept but their models cannot run: a task head the model type lacks
    (from_config's refusal lists every config class in one huge line), grouped-query attention whose key/value
    heads do not divide the query heads (Llama's config takes it; attention fails inside the first forward)."""
    key = config_key(config)
    auto = auto_class(config)
    # the condition from_config checks, on the auto class's private table: a transformers without it skips this
    # check, and from_config's own (long) refusal reaches config_errors instead
    mapping = getattr(auto, "_model_mapping", None)
    if mapping is not None and type(built) not in mapping:
        raise RecipeError(f"{key}: model_type {built.model_type} has no {config.task} head in transformers "
                          f"({auto.__name__}); use a model type that has one, or another model.task")
    if mapping is not None and config.task == "causal-lm" and getattr(built, "is_decoder", None) is False \
            and _needs_is_decoder(mapping[type(built)]):
        where = "model.config" if config.config is not None else "its config.json"
        raise RecipeError(f"{key}: {built.model_type} is an encoder (is_decoder false): as a causal LM "
                          f"({mapping[type(built)].__name__}) each position would attend to the token it "
                          "predicts; use a decoder model (llama, gpt2, ...) or model.task sequence-classification "
                          f"(or set is_decoder: true in {where} to train it as a decoder)")
    heads, kv_heads = getattr(built, "num_attention_heads", None), getattr(built, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise RecipeError(f"{key}: num_attention_heads {heads} must be a multiple of num_key_value_heads "
                          f"{kv_heads} (each key/value head serves a group of query heads); set "
                          f"num_key_value_heads to a divisor of {heads}")


@functools.cache
def _needs_is_decoder(model_class: type) -> bool:
    """Whether `model_class` attends causally only when its config sets is_decoder, as transformers decides it:
    the causal-LM classes of encoder families (BertLMHeadModel, RobertaForCausalLM, ElectraForCausalLM, ...) test
    `config.is_decoder` in their constructor and, when it is false, warn ("add `is_decoder=True`") or assert,
    then build a bidirectional model all the same. Decoder-only models (llama, gpt2, gpt_neox) never test it, and
    the encoder-decoder families' causal-LM classes (BartForCausalLM) set it themselves."""
    import inspect

    try:
        source = inspect.getsource(getattr(model_class, "__init__"))
    except (OSError, TypeError):  # no source shipped: no check
        return False
    return re.search(r"(\bnot|\bassert)\s+(self\.)?config\.is_decoder\b", source) is not None


def check_saved_head(fields: dict, config: ModelConfig, *, saved_num_labels: Callable[[], int]) -> None:
    """model.num_labels is the size of the classification head model.path holds, where it holds one (its
    config.json's architectures name a ...ForSequenceClassification class): from_pretrained refuses a head of
    another size (ignore_mismatched_sizes) and points at a report the toolkit's quiet logging hides. A folder
    without a head (BertModel, BertForMaskedLM) gets a new head of any size."""
    architectures = fields.get("architectures")
    if not isinstance(architectures, list) or \
            not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return
    saved = saved_num_labels()
    if saved != config.num_labels:
        raise RecipeError(f"model.path {config.path}: its classification head has {saved} labels (config.json "
                          f"id2label), model.num_labels is {config.num_labels}; set model.num_labels: {saved}, or "
                          f"for a new {config.num_labels}-label head save the model without its head "
                          "(AutoModel.from_pretrained(...).save_pretrained(DIR)) and point model.path at DIR")


def config_key(config: ModelConfig) -> str:
    return "model.config" if config.config is not None else f"model.path {config.path}"


@contextlib.contextmanager
def config_errors(config: ModelConfig, *more: type[Exception]) -> Iterator[None]:
    """transformers' refusal of a config's fields (a hidden size that is no multiple of the heads, an unknown
    model type, sizes past what a tensor holds) as a RecipeError, one line naming the recipe key."""
    from huggingface_hub.errors import StrictDataclassError

    refused: tuple[type[Exception], ...] = (ValueError, TypeError, ZeroDivisionError, StrictDataclassError, *more)
    try:
        yield
    except RecipeError:
        raise
    except refused as exc:
        lines = str(exc).strip().splitlines()  # transformers' validators: a header, the reason on the last line
        reason = lines[-1].strip().rstrip(".") if lines else type(exc).__name__
        raise RecipeError(f"{config_key(config)}: {reason[:200]}{'…' if len(reason) > 200 else ''}; fix the model's config") \
            from None


@contextlib.contextmanager
def build_errors(config: ModelConfig) -> Iterator[None]:
    """A model built from model.config: whatever transformers' constructors raise on the config's values, as
    one line naming the key that holds the value where one does (an activation ACT2FN lacks is a KeyError from
    inside the build). A model from model.path is left to config_errors: its failures are the files'."""
    try:
        yield
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - from_config runs only transformers' code on the recipe's values
        if config.config is None:
            raise
        raise RecipeError(_build_failure(exc, config.config)) from None


def _build_failure(exc: Exception, fields: dict) -> str:
    value = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
    names = [name for name, given in fields.items() if isinstance(value, str) and given == value]
    if names:
        from transformers.activations import ACT2FN

        known = f" (activations: {', '.join(sorted(ACT2FN))})" if value not in ACT2FN else ""
        return f"model.config: {names[0]} {value!r} is not a value transformers knows{known}; fix it"
    lines = str(exc).strip().splitlines()
    reason = lines[-1].strip().rstrip(".")[:200] if lines else ""
    return f"model.config: transformers cannot build the model from it ({type(exc).__name__}: {reason}); " \
        "fix the model's config"
