"""Checks of a recipe that need no process group, run before anything is written: by `validate`, by the ranks of
`toolkit launch` on one machine as their first step (each says the same mistake; say_user_error prints it once),
and by each machine's launcher of a job over several before it joins the rendezvous. A user's mistake is one line,
not a failure somewhere inside training."""

from __future__ import annotations

from toolkit.config.parallel import resolve
from toolkit.config.recipe import BatchPlan, Recipe
from toolkit.errors import RecipeError
from toolkit.strategies import strategy_info, validate_strategy
from toolkit.train.tracking_checks import check_trackers


def check_paths(recipe: Recipe) -> None:
    from toolkit.model.build import resolve_path
    from toolkit.model.files import check_model_dir

    if recipe.model.path is not None:
        check_model_dir(resolve_path(recipe.model.path), "model.path")
    if recipe.model.tokenizer is not None:
        check_model_dir(resolve_path(recipe.model.tokenizer), "model.tokenizer")
    from toolkit.data.files import data_source

    for key in ("train", "eval"):
        value = getattr(recipe.data, key)
        if value is not None:
            data_source(f"data.{key}", value)


def check_accelerator(recipe: Recipe) -> None:
    """The precision against this machine's DeepSpeed accelerator, for a strategy that runs on DeepSpeed: a check of
    a run here, not of the strategy's rules, which `toolkit plan --hardware` applies to devices this machine lacks
    (fp16 ZeRO-3 on H100s is a plan, although this CPU's accelerator has no fp16)."""
    if "deepspeed" in strategy_info(recipe.strategy.name).runtime_modules:
        from toolkit.strategies.zero.config import check_deepspeed_precision

        check_deepspeed_precision(recipe.precision)


def check_position_limit(recipe: Recipe) -> None:
    """The model's config is one transformers accepts for the task (model_config's checks; a folder's files are
    complete), and data.max_length is within its position embeddings (reads config.json and weight headers only)."""
    from toolkit.model.build import hf_config, position_limit

    limit = position_limit(hf_config(recipe.model))
    if limit is not None and recipe.data.max_length > limit:
        raise RecipeError(f"data.max_length {recipe.data.max_length} is above the model's position limit {limit} "
                          f"(max_position_embeddings); set data.max_length <= {limit}")



# config fields of models whose forward changes the head's output before the loss (Gemma 2's soft cap, Cohere's
# and Granite's scales): under train.tiled_loss the head is applied outside the forward, without them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_tiled_loss(recipe: Recipe) -> None:
    """train.tiled_loss: a causal LM whose logits are its output layer's, nothing applied after it."""
    if not recipe.train.tiled_loss:
        return
    if recipe.model.task != "causal-lm":
        raise RecipeError(f"train.tiled_loss tiles a causal LM's per-token loss; model.task is {recipe.model.task}; "
                          "set train.tiled_loss: false")
    from toolkit.model.build import hf_config

    config = hf_config(recipe.model)
    found = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if found:
        raise RecipeError(f"train.tiled_loss applies the output layer outside the model's forward, but this model "
                          f"changes its logits after it ({found[0]}); set train.tiled_loss: false")


def check_data(recipe: Recipe, *, global_batch_size: int | None = None):
    """Reads the data files (not tokenized): they have rows, and the named columns hold what training needs; the
    train rows fill one global batch where a row is a sample (without packing: one that `train` may still leave
    out for having no token to learn from is counted); the tokenizer that will tokenize them loads, and
    data.max_length leaves room beside its special tokens. Returns the tokenizer."""
    from toolkit.data.splits import check_one_batch, check_room, check_rows
    from toolkit.data.files import data_source, num_blank_lines, read_rows, text_columns
    from toolkit.model.build import saved_label_names

    names = None  # data.train's class names, which data.eval's labels must be among
    model_names = saved_label_names(recipe.model)
    for key in ("data.train", "data.eval"):
        value = getattr(recipe.data, key.split(".")[1])
        if value is not None:
            source = data_source(key, value)
            raw = read_rows(source, text=text_columns(recipe.data))
            names = check_rows(raw, source, data=recipe.data, task=recipe.model.task,
                               num_labels=recipe.model.num_labels, names=names, model_names=model_names)
            packed = recipe.model.task == "causal-lm" and recipe.data.packing  # blocks, not rows: known once tokenized
            if key == "data.train" and global_batch_size is not None and not packed:
                num_rows = len(raw) - num_blank_lines(raw, source, recipe.data.text_column)
                check_one_batch(num_rows, global_batch_size=global_batch_size)
    from toolkit.model.build import load_tokenizer

    tokenizer = load_tokenizer(recipe.model)  # its folder's files load (0.1 s for MiniLM's, measured)
    check_room(recipe.data, tokenizer)
    if recipe.data.format != "text":
        from toolkit.data.instruct import chat_template_text, check_tokenizer

        check_tokenizer(chat_template_text(recipe.data), tokenizer)
    return tokenizer


def check_model(recipe: Recipe, tokenizer) -> None:
    """What the ranks would find only once they build the model, on one meta-device copy of it (its config and
    class only, no weights read): the tokenizer fits its vocabulary, LoRA targets name layers of it, and the
    blocks to shard (strategy.blocks) or to checkpoint are there."""
    from toolkit.model.blocks import enable_activation_checkpointing
    from toolkit.model.build import check_vocabulary
    from toolkit.plan.predict import planned_model

    model = planned_model(recipe)  # applies the adapters: targets that match nothing are peft's one-line error
    check_vocabulary(model, tokenizer)
    check_experts(recipe, model)
    check_blocks(recipe, model)
    if recipe.train.activation_checkpointing:
        enable_activation_checkpointing(model, recipe.train.recompute)  # a model without blocks: its one-line error


GROUPED_GEMM_ROW_BYTES = 16  # torch's grouped GEMM refuses operands whose rows are not a multiple of it
# the strategies whose forward computes with the weights in a 16-bit precision (FSDP2's MixedPrecisionPolicy, ZeRO's
# bf16/fp16 parameters; a hybrid's and transformers' layouts may shard with FSDP): the others keep model.load_dtype's
# weights, under autocast
SIXTEEN_BIT_WEIGHTS = ("fsdp", "zero", "hybrid", "hf_native")


def check_experts(recipe: Recipe, model=None) -> None:
    """A mixture-of-experts model's routers and experts, on its meta-device copy (`model`; built here for a model
    that has experts if not given): what would otherwise stop every rank in its first forward."""
    if model is None:
        from toolkit.model.build import hf_config
        from toolkit.observe.routing import num_experts
        from toolkit.plan.predict import planned_model

        if not num_experts(hf_config(recipe.model)):
            return
        model = planned_model(recipe)
    check_routers(recipe, model)
    check_expert_widths(recipe, model)


def check_routers(recipe: Recipe, model) -> None:
    """Each router picks top_k of its num_experts experts, so 1 <= top_k <= num_experts. The config check
    (model.config.check_routing) judges only configs of more than one expert, as one expert is a dense model in
    some families (Jamba's builds plain MLPs, its top-k unused); the modules built tell: a Qwen3-MoE or Qwen2-MoE of
    one expert and top-k 2 builds routers that stopped in the first forward ("selected index k out of range")."""
    from toolkit.model.config import config_key

    for name, module in model.named_modules():
        top_k, experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
        if isinstance(top_k, int) and isinstance(experts, int) and not 1 <= top_k <= experts:
            raise RecipeError(f"{config_key(recipe.model)}: the router {name} picks {top_k} of {experts} "
                              f"expert(s) a token; set num_experts_per_tok from 1 to {experts}")


def check_expert_widths(recipe: Recipe, model) -> None:
    """A mixture-of-experts model whose experts run transformers' default implementation, torch's grouped GEMM
    (its input cast to the weights' dtype): the weights' rows must be multiples of 16 bytes, else every rank stops
    in its first forward ("strides should be multiple of 16 bytes": a from-config Mixtral with experts 66 wide,
    fp32; 68 wide ran in fp32 and in bf16 as one process, and stopped under fsdp in bf16, whose weights are 2 bytes
    there)."""
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        return
    from toolkit.model.config import config_key
    from toolkit.model.precision import DTYPES

    weights = DTYPES[recipe.model.load_dtype]
    if recipe.precision != "fp32" and recipe.strategy.name in SIXTEEN_BIT_WEIGHTS:
        weights = DTYPES[recipe.precision]
    elements = GROUPED_GEMM_ROW_BYTES // weights.itemsize
    for name, module in model.named_modules():
        if not (hasattr(module, "has_gate") and hasattr(module, "is_transposed")):  # transformers' experts modules
            continue
        for weight, param in module.named_parameters(recurse=False):
            odd = [size for size in param.shape[1:] if size % elements] if param.dim() == 3 else []
            if not odd:
                continue
            fix = (f"make the model's hidden and expert intermediate sizes multiples of {elements}"
                   if recipe.model.config is not None else
                   "train its weights in fp32 (precision fp32, model.load_dtype fp32)" if elements == 8
                   and all(size % 4 == 0 for size in param.shape[1:]) else "this model's experts cannot run it")
            raise RecipeError(f"{config_key(recipe.model)}: the experts' {weight} of {name} is {odd[0]} wide, which "
                              f"torch's grouped GEMM (transformers' experts) cannot run with "
                              f"{str(weights).removeprefix('torch.')} weights; {fix}")
        return  # every layer's experts have the same widths


def check_recipe(recipe: Recipe, *, world_size: int) -> BatchPlan:
    recipe = resolve(recipe, world_size=world_size)  # parallel degrees -> their preset
    plan = validate_strategy(recipe, world_size=world_size)
    check_accelerator(recipe)
    check_trackers(recipe)  # train.report_to's packages, and where they write
    check_paths(recipe)
    check_position_limit(recipe)
    check_tiled_loss(recipe)
    tokenizer = check_data(recipe, global_batch_size=plan.global_batch_size)
    check_model(recipe, tokenizer)
    return plan


def check_blocks(recipe: Recipe, model=None) -> None:
    """A strategy that shards (fsdp) or cuts (model parallel, pipeline) at the transformer blocks finds them in the
    model (`model`: its meta-device copy, built here if not given). DistilBERT names none of its own: the run
    stopped at set-up, after validate said ok."""
    if "blocks" not in strategy_info(recipe.strategy.name).options:
        return
    from toolkit.model.blocks import transformer_blocks
    from toolkit.model.build import meta_model

    transformer_blocks(model if model is not None else meta_model(recipe.model), recipe.strategy.blocks)
