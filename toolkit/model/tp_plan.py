"""Tensor-parallel plans (Megatron-style): which linear layers split their output features over the TP ranks
(column-wise: q/k/v, MLP up/gate) and which their input features (row-wise: attention out, MLP down).

A column-wise layer's output stays sharded (each rank holds its heads, its MLP columns); the row-wise layer
after it sums the partial outputs with one all-reduce. So each attention and each MLP block costs one
all-reduce of activations forward, one backward.

The plan comes from the model where transformers declares one (`config.base_model_tp_plan`, keys relative to
the base model, e.g. "layers.*.self_attn.q_proj": "colwise"), else from a small table per architecture
(BERT-style encoders declare none). Embeddings, norms and the head stay replicated, an embedding the model's plan
splits too (GPT-NeoX's "embedding_rowwise": the same maths, its memory not saved): every rank computes the
full logits, so the loop's loss is unchanged; strategy.loss_parallel splits the head (and a tied embedding) over
the vocabulary instead, the loss reduced over the ranks (vocab_plan, below). Attention needs no change: HF
attention reshapes with `view(..., -1, head_dim)`, so each rank infers its local head count.

Some plans gather a column-wise layer's output on every rank ("colwise_gather_output": OLMo 2's q, k and v, whose
norms span all heads; Phi-3's fused qkv_proj and gate_up_proj, cut into their parts after) and let the row-wise
layer after it take its own slice of the whole input ("rowwise_split_input"): the same split weights, one
all-gather more per gathered layer (its output, forward; the split input's gradient, backward), and the attention
or MLP between them computed whole on every rank.

A plan may also name modules "replicated_with_grad_allreduce" (Qwen3's, Gemma 3's per-head q_norm and k_norm,
between a column-wise projection and attention): they stay whole on every rank, but each rank normalizes only
its own heads, so its gradient is a partial sum over heads. The strategies sum those gradients over the TP
group once per step, after the last micro-batch's backward (`sum_partial_gradients`; a hook per backward, as
transformers installs, would sum the already summed gradient again under gradient accumulation).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, cast

import torch
from torch import nn

from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError
from toolkit.model.tied import head_tied_to_embedding

# architectures whose config declares no plan: module paths relative to the base model
FALLBACK_PLANS: dict[str, dict[str, str]] = {
    model_type: {"encoder.layer.*.attention.self.query": "colwise",
                 "encoder.layer.*.attention.self.key": "colwise",
                 "encoder.layer.*.attention.self.value": "colwise",
                 "encoder.layer.*.attention.output.dense": "rowwise",
                 "encoder.layer.*.intermediate.dense": "colwise",
                 "encoder.layer.*.output.dense": "rowwise"}
    for model_type in ("bert", "roberta", "xlm-roberta", "electra")}
# ModernBERT's fused projections are cut after them by position (Wqkv into q, k, v of all heads; Wi into input and
# gate), so their outputs are gathered on every rank (see the docstring)
FALLBACK_PLANS["modernbert"] = {"layers.*.attn.Wqkv": "colwise_gather_output",
                                "layers.*.attn.Wo": "rowwise_split_input",
                                "layers.*.mlp.Wi": "colwise_gather_output",
                                "layers.*.mlp.Wo": "rowwise_split_input"}

# the config fields a TP degree must divide: split heads and MLP columns
DIVIDED_FIELDS = {"num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
                  "intermediate_size": "MLP columns"}


# a module the plan keeps whole whose gradient each TP rank computes only in part (see the docstring)
PARTIAL_GRADIENT = "replicated_with_grad_allreduce"
# column-wise styles (the weight split by output features) and row-wise ones (by input features); the second of
# each gathers the output / splits the whole input on every rank (see the docstring)
GATHERED, SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"
COLUMN_WISE, ROW_WISE = ("colwise", GATHERED), ("rowwise", SPLIT_INPUT)
PLAIN = ("colwise", "rowwise")  # the styles whose split output or input stays split between the layers
# embeddings a plan splits, which the toolkit keeps whole on every rank (see the docstring; loss_parallel splits a
# tied one by its own rule, vocab_plan)
KEPT_WHOLE = ("embedding_rowwise", "embedding_colwise")


def resolve(model: nn.Module) -> dict[str, str]:
    """Full module name -> its style (COLUMN_WISE or ROW_WISE) for every linear layer the plan splits."""
    return {name: style for name, style in _entries(model).items() if style != PARTIAL_GRADIENT}


def whole_experts(model: nn.Module) -> bool:
    """Whether the model has mixture-of-experts layers its plan leaves whole on every TP rank (Mixtral's and
    Qwen3-MoE's plans split attention, and dense MLPs, only: their experts are named by the expert-parallel plan;
    a MoE model without one: no split layer under an `experts` module)."""
    from toolkit.observe.routing import DISPATCH, num_experts, plan_of

    split = resolve(model)
    named = [experts for experts, style in plan_of(model).items() if style == DISPATCH]
    if not named:
        return bool(num_experts(model.config)) and not any(".experts." in f".{name}." for name in split)
    return any(not any(name == experts or name.startswith(f"{experts}.") for name in split) for experts in named)


def partial_gradient_modules(model: nn.Module) -> list[str]:
    """Full names of the modules whose gradients the TP ranks must sum (PARTIAL_GRADIENT entries)."""
    return [name for name, style in _entries(model).items() if style == PARTIAL_GRADIENT]


def _entries(model: nn.Module) -> dict[str, str]:
    """Full module name -> its plan style, for every module the model's plan (or the toolkit's) names."""
    config: Any = model.config
    declared = getattr(config, "base_model_tp_plan", None) or FALLBACK_PLANS.get(config.model_type)
    if not declared:
        found = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if name and not list(m.children()) and any(True for _ in m.parameters(recurse=False))})
        raise RecipeError(f"tensor parallelism: {config.model_type} declares no tensor-parallel plan "
                          f"(config.base_model_tp_plan) and the toolkit has none for it (modules found: "
                          f"{', '.join(found) or 'none'}); use fsdp or zero for this model")
    prefix = _base_model_prefix(model)
    modules = dict(model.named_modules())
    plan: dict[str, str] = {}
    unmatched: list[str] = []
    matched_patterns: list[str] = []
    for pattern, style in declared.items():
        if style in KEPT_WHOLE:
            continue
        if style not in (*COLUMN_WISE, *ROW_WISE, PARTIAL_GRADIENT):
            raise RecipeError(f"tensor parallelism: the model's plan asks for {style!r} at {pattern}; the toolkit "
                              f"splits linear layers {', '.join((*COLUMN_WISE, *ROW_WISE))} and sums "
                              f"{PARTIAL_GRADIENT} gradients only; use fsdp or zero for this model")
        partial = style == PARTIAL_GRADIENT  # a module with parameters of its own; else a linear layer to split
        matched = [name for name in modules if fnmatch.fnmatchcase(name, prefix + pattern)]
        if not matched:  # an entry for a kind of layer this model has none of (Qwen3-MoE's plan names the dense
            unmatched.append(pattern)  # MLP of its mlp_only_layers beside the experts of its sparse ones)
            continue
        found = [name for name in matched if (any(True for _ in modules[name].parameters(recurse=False)) if partial
                                              else isinstance(modules[name], nn.Linear))]
        if not found:
            what = "module with parameters" if partial else "linear layer"
            raise RecipeError(f"tensor parallelism: the plan entry {pattern} matches no {what} of this model")
        plan.update(dict.fromkeys(found, style))
        matched_patterns.append(pattern)
    for pattern in unmatched:  # passed over only with the entries beside it: a column-wise layer split without its
        parent = pattern.rpartition(".")[0]  # row-wise partner (or the reverse) would meet whole activations
        beside = [other for other in matched_patterns if other.rpartition(".")[0] == parent]
        if beside:
            raise RecipeError(f"tensor parallelism: the plan entry {pattern} matches no module of this model while "
                              f"{beside[0]} beside it does; use fsdp or zero for this model")
    if not any(style in (*COLUMN_WISE, *ROW_WISE) for style in plan.values()) and unmatched:
        raise RecipeError(f"tensor parallelism: {config.model_type}'s tensor-parallel plan matches no module of this "
                          f"model ({', '.join(unmatched)}); use fsdp or zero for this model")
    if not any(style in (*COLUMN_WISE, *ROW_WISE) for style in plan.values()):
        raise RecipeError(f"tensor parallelism: {config.model_type}'s tensor-parallel plan splits no linear layer "
                          f"(it names {', '.join(sorted(set(declared.values())))} only); use fsdp or zero for this "
                          "model")
    return plan


def _base_model_prefix(model: nn.Module) -> str:
    """The name (with its dot) under which a head model holds the base model its config's plan names modules of:
    `base_model_prefix`, or else the one pretrained model among its children (Llama4ForCausalLM declares
    "language_model" and holds its Llama4TextModel as `model`); "" for a base model itself."""
    from transformers import PreTrainedModel

    base: Any = getattr(model, "base_model_prefix", "")
    if base and hasattr(model, base):
        return f"{base}."
    inner = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    return f"{inner[0]}." if len(inner) == 1 else ""


def partial_gradient_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the plan's PARTIAL_GRADIENT modules, as the model holds them now (after fully_shard,
    its DTensors): what `sum_partial_gradients` sums each step."""
    modules = dict(model.named_modules())
    return [p for name in partial_gradient_modules(model) for p in modules[name].parameters(recurse=False)
            if p.requires_grad]


def sum_partial_gradients(params: list[nn.Parameter], group, *, device: torch.device) -> None:
    """Sum the gradients of `params` (partial_gradient_params) over the TP `group` in place: one all-reduce of
    their concatenation, in fp32 (a handful of head-size vectors per block). A gradient that is a DTensor
    (FSDP's shard over the data-parallel ranks) sums its local shard: a TP group's ranks hold the same shard. One
    that DTensor marks a partial sum (a sequence-parallel norm's, where no FSDP replicates it) is marked whole once
    summed: the optimizer would sum it again."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    held = [p for p in params if p.grad is not None]
    grads = [cast(torch.Tensor, p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in held]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).to(device=device, dtype=torch.float32) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    for param, grad, summed in zip(held, grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))
        whole = param.grad
        if isinstance(whole, DTensor) and any(isinstance(p, Partial) for p in whole.placements):
            param.grad = DTensor.from_local(grad, whole.device_mesh, [Replicate() if isinstance(p, Partial) else p
                                                                      for p in whole.placements],
                                            run_check=False, shape=whole.shape, stride=whole.stride())


def check_recipe(recipe: Recipe, *, degree: int) -> None:
    """Before any rank starts: the recipe's model has a plan and `degree` divides what it splits."""
    from toolkit.model.build import meta_model

    if recipe.precision == "fp16":
        raise RecipeError("precision fp16 is not available with tensor parallelism (its loss scaler cannot unscale "
                          "gradients that mix DTensors and plain tensors); use bf16")
    model = meta_model(recipe.model)
    check_degree(model, degree)
    if recipe.strategy.sequence_parallel:
        sequence_parallel_plan(model)  # the model has the blocks it needs
    if recipe.strategy.loss_parallel:
        if recipe.model.task != "causal-lm":
            raise RecipeError(f"strategy.loss_parallel splits a causal LM's output layer over its vocabulary; a "
                              f"{recipe.model.task} model's head is small: set it to false")
        if recipe.train.tiled_loss:
            raise RecipeError("strategy.loss_parallel and train.tiled_loss both keep a rank from holding the whole "
                              "logits (split over the vocabulary, or in sequence tiles); set one of them to false")
        vocab_modules(model, degree=degree)


def check_degree(model: nn.Module, degree: int) -> None:
    """Heads, KV heads, intermediate size and every split layer's features divisible by `degree`. A MoE model whose
    experts stay whole (whole_experts) splits no MLP of `intermediate_size` columns by it: Mixtral's is its experts'
    width; a dense MLP it has beside them (Qwen3-MoE's mlp_only_layers) is a split layer, checked as such."""
    config: Any = model.config
    skipped = {"intermediate_size"} if whole_experts(model) else set()
    for field, what in DIVIDED_FIELDS.items():
        value = getattr(config, field, None)
        if field not in skipped and isinstance(value, int) and value % degree:
            raise RecipeError(f"tensor parallelism: the model's {what} ({field} = {value}) are not divisible by the "
                              f"tensor-parallel degree {degree}; use a degree that divides {value}")
    modules = dict(model.named_modules())
    for name, style in resolve(model).items():
        linear = cast(nn.Linear, modules[name])
        features = linear.out_features if style in COLUMN_WISE else linear.in_features
        if features % degree:
            side = "output" if style in COLUMN_WISE else "input"
            raise RecipeError(f"tensor parallelism: {name} has {features} {side} features, not divisible by the "
                              f"tensor-parallel degree {degree}")


def local_shapes(model: nn.Module, degree: int, *, loss_parallel: bool = False) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the shape one TP rank stores: column-wise layers split weight and bias by output
    features, row-wise layers split the weight by input features and keep the bias whole; the rest is whole but,
    under `loss_parallel`, the output layer (and a tied embedding), split over the vocabulary (vocab_modules)."""
    styles = resolve(model)
    vocab = set(vocab_modules(model, degree=degree)) if loss_parallel else set()
    shapes = {}
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        shape = list(param.shape)
        style = styles.get(module)
        if style in COLUMN_WISE or module in vocab:
            shape[0] //= degree
        elif style in ROW_WISE and kind == "weight":
            shape[1] //= degree
        shapes[name] = tuple(shape)
    return shapes


def parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Split the plan's linear layers over `mesh` (1-D) in place: their weights become DTensors; under
    `loss_parallel` the output layer (and a tied embedding) too (vocab_plan)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # a pipeline stage holds at most one of a tied pair's two copies (model/stages.py): nothing to tie again
    tied = loss_parallel and not getattr(model, "pipeline_stage", False) and head_tied_to_embedding(model)
    styles: dict[str, Callable[[], Any]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                                            GATHERED: lambda: ColwiseParallel(output_layouts=Replicate()),
                                            SPLIT_INPUT: lambda: RowwiseParallel(input_layouts=Replicate())}
    resolved = resolve(model)
    plan = sequence_parallel_plan(model) if sequence_parallel else {n: styles[s]() for n, s in resolved.items()}
    if loss_parallel:
        plan.update(vocab_plan(model, degree=mesh.size(), sequence_parallel=sequence_parallel))
    parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    if sequence_parallel and getattr(model, "pipeline_stage", False):  # it sends and receives sequence shares
        cast(Any, model).sequence_shards, cast(Any, model).sequence_mesh = mesh.size(), mesh
    if tied:  # each layer's style made a DTensor of its own from the one weight: the same shard, one parameter again
        cast(Any, model).get_output_embeddings().weight = cast(Any, model).get_input_embeddings().weight
    if sequence_parallel:
        return
    for parent, members in shared_input_groups(resolved).items():
        _share_input(model.get_submodule(parent), [model.get_submodule(m) for m in members], mesh)


# strategy.loss_parallel: the vocabulary split over the TP ranks (torchtitan's loss_parallel, Megatron's
# vocab-parallel cross-entropy). The output layer is column-wise with its output left sharded: each rank computes
# the logits of its 1/N of the vocabulary, and the loss reduces over ranks inside cross_entropy (torch's
# loss_parallel: max, sum of exponentials and the target's logit all-reduced, [tokens] each; its backward needs no
# collective; data/losses.py). A tied input embedding (the head's weight) is row-wise with it: each rank looks up
# the ids in its rows, the partial outputs summed by one all-reduce, and embedding and head stay one parameter,
# split alike. An untied embedding stays whole on every rank: torch 2.13's DTensor rules have no row-wise
# embedding backward, so a row-wise embedding's gradient is computed whole, the vocabulary's [V, hidden], on every
# rank (seen in a 2-rank probe); a tied one's is added into the head's split gradient, whole only while backward
# adds it.
def vocab_modules(model: nn.Module, *, degree: int) -> tuple[str, ...]:
    """The names of the modules a model's vocabulary split over `degree` ranks splits: its output layer, and its
    input embedding where the two are tied (one weight). A pipeline stage (model/stages.py, `pipeline_stage`) holds
    the output layer if it is the last, the embedding if it is the first and the model ties them (two copies, one
    on each end, split alike); a middle stage none. Its model was checked whole before it was cut."""
    names = {id(module): name for name, module in model.named_modules()}
    embedding, head = _embeddings(model)
    if getattr(model, "pipeline_stage", False):  # its model's embeddings, a later or earlier stage's stand-ins
        tied = cast(Any, model).tied is not None
        return tuple([names[id(embedding)]] if tied and isinstance(embedding, nn.Embedding) else []) \
            + tuple([names[id(head)]] if isinstance(head, nn.Linear) else [])
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
        raise RecipeError(f"strategy.loss_parallel: {type(model).__name__} has no embedding and linear output layer "
                          "to split over the vocabulary; set it to false")
    if head.out_features % degree:
        raise RecipeError(f"strategy.loss_parallel: the output layer's vocabulary ({head.out_features} tokens) is not "
                          f"divisible by the tensor-parallel degree {degree}; use a degree that divides it (a model "
                          f"built from model.config can pad vocab_size to a multiple of {degree}), or set "
                          "strategy.loss_parallel to false")
    return (names[id(embedding)], names[id(head)]) if head_tied_to_embedding(model) else (names[id(head)],)


def vocab_plan(model: nn.Module, *, degree: int, sequence_parallel: bool) -> dict[str, Any]:
    """The output layer column-wise with its logits left a DTensor sharded over the vocabulary (under sequence
    parallelism it all-gathers its input from the final norm's sequence shards, and reduce-scatters its gradient);
    a tied embedding row-wise (its output all-reduced, whole on every rank, where the first block's input is cut
    under sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    head = _embeddings(model)[1]
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    plan: dict[str, Any] = {}
    for name in vocab_modules(model, degree=degree):
        plan[name] = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                     output_layouts=Shard(-1), use_local_output=False) if name == head_name \
            else RowwiseParallel(input_layouts=Replicate())
    return plan


def vocab_parts(model: nn.Module, *, degree: int) -> tuple[bool, bool]:
    """(the input embedding split, the output layer split) over the vocabulary under loss_parallel: both or the head
    alone for a model (vocab_modules); for a pipeline stage what it holds of them."""
    split = vocab_modules(model, degree=degree)
    head = _embeddings(model)[1]
    names = {name for name, module in model.named_modules() if module is head}
    holds_head = any(name in names for name in split)
    return len(split) > int(holds_head), holds_head


def keep_gradients_split(model: nn.Module) -> None:
    """A first pipeline stage's tied embedding, split row-wise over the vocabulary (vocab_modules): torch 2.13's
    DTensor rules have no row-wise embedding backward, so each micro-batch's gradient arrives whole ([V, hidden],
    Replicate, the same on every tp rank). It is cut to the rank's rows as it is accumulated (a local slice, no
    collective), as the last stage's head holds its gradient: the two copies' rows are then summed between them.
    DTensor's cut copies the rows out (Replicate -> Shard clones the rank's chunk), so the whole gradient is freed;
    the activation trace keeps both for that moment (memory/tp_rank.py _RowsOfWhole).

    Under FSDP the parameter the forward reads, and autograd accumulates into, is FSDP's unsharded one, swapped
    onto the module at its all-gather (and kept across steps): a hook on the sharded parameter would never fire,
    and the unsharded gradient would stay whole until the step's reduce-scatter. So each parameter the module
    holds when its forward starts is hooked, once."""
    from torch.distributed.tensor import DTensor

    def cut(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)

    def hook_held(module: nn.Module, _args: Any = None) -> None:
        for param in module.parameters(recurse=False):
            # marked on the parameter itself: an id could be reused by a new parameter after one is freed
            if param.requires_grad and not getattr(param, "_toolkit_cut_hooked", False):
                param._toolkit_cut_hooked = True  # type: ignore[attr-defined]
                param.register_post_accumulate_grad_hook(cut)

    for name in vocab_modules(model, degree=1):
        module = model.get_submodule(name)
        hook_held(module)  # the parameters as they are now (without FSDP, those the forward reads)
        module.register_forward_pre_hook(hook_held)  # FSDP's unsharded ones, swapped in before this forward


def _embeddings(model: nn.Module) -> tuple[Any, Any]:
    """(input embedding, output layer) of a transformers model, or of a pipeline stage's (its `whole` model's, where
    another stage's are stand-ins)."""
    owner: Any = cast(Any, model).whole if getattr(model, "pipeline_stage", False) else model
    return owner.get_input_embeddings(), owner.get_output_embeddings()


# column-wise layers that read their module's input, by the names transformers' decoders and BERT give them
# (attention's q, k, v; an MLP's gate and up); a layer named otherwise may read something the module made
SHARED_INPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value")


def shared_input_groups(styles: dict[str, str]) -> dict[str, list[str]]:
    """From the plan's styles (`resolve`): module name -> its column-wise SHARED_INPUT layers, for every module
    that holds two or more: they read the module's input, so its gradient is the sum of theirs. Each column-wise
    layer all-reduces its own input gradient (the from_local of a plain input, per layer); given one replicated
    DTensor of it, the layers' partial gradients add up first and are all-reduced once (as torchtitan's plans do):
    2 all-reduces per Llama block in backward instead of 5, the same sum."""
    groups: dict[str, list[str]] = {}
    for name, style in styles.items():
        parent, _, leaf = name.rpartition(".")
        if style in COLUMN_WISE and leaf in SHARED_INPUT:
            groups.setdefault(parent, []).append(name)
    return {parent: names for parent, names in groups.items() if len(names) > 1}


def _share_input(parent: nn.Module, members: list[nn.Module], mesh) -> None:
    """Within one forward of `parent`, a plain input that a member reads after another member read it enters as
    that member's replicated DTensor, before the layer's own input hook (which passes a DTensor through): the
    members' input gradients meet there and are reduced once. A member that reads another tensor gets its own
    (as without the group); the module's other uses of its input stay plain."""
    from torch.distributed.tensor import DTensor, Replicate

    seen: list[tuple[torch.Tensor, Any]] = []  # (the input, its DTensor) of this forward of the parent

    def enter(_module, args):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return None
        if not (seen and seen[0][0] is x):
            seen[:] = [(x, DTensor.from_local(x, mesh, (Replicate(),), run_check=False))]
        return (seen[0][1], *args[1:])

    def forget(*_):
        seen.clear()

    parent.register_forward_pre_hook(forget)
    parent.register_forward_hook(forget)
    for member in members:
        member.register_forward_pre_hook(enter, prepend=True)


# what sequence parallelism needs of a decoder block (Llama, Qwen2, Mistral name them alike)
DECODER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def sequence_parallel_plan(model: nn.Module) -> dict[str, Any]:
    """Megatron's sequence parallelism on top of the plan: between the split layers the activations stay
    sharded along the sequence, so the norms and residual adds compute 1/N of the tokens each. The row-wise
    layers reduce-scatter instead of all-reduce, the inputs of attention and MLP are all-gathered: the same
    bytes, less activation memory. The first block's input is cut from the (replicated) embedding output and
    the head's input gathered back, so the model's mask, positions and the loss are those of the full
    sequence. Pipeline stages (model/stages.py) send and receive a tp rank's share of the sequence, as torchtitan's
    do: a stage before the last sends its last block's output as it is (no gather), and a stage after the first
    hands what it receives to its first block as that share (Stage.sequence_mesh), computing mask and positions
    for the whole sequence as the model does. Llama-style decoders only: their blocks hold exactly
    DECODER_PARTS."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    config: Any = model.config
    layers = decoder_layers(model)
    if layers is None:
        raise RecipeError(f"strategy.sequence_parallel: supported for Llama-style decoders (blocks of exactly "
                          f"{', '.join(DECODER_PARTS)}), not {config.model_type}; set it to false")
    stack, held = layers
    styles = resolve(model)
    gathered = sorted({style for style in styles.values() if style not in PLAIN})
    if gathered:
        raise RecipeError(f"strategy.sequence_parallel: the model's tensor-parallel plan has {', '.join(gathered)} "
                          "layers, which compute on the whole sequence between them; set it to false")
    seq, full = Shard(1), Replicate()
    shared, whole = shared_input_groups(styles), set(whole_mlps(model, styles))
    gather = dict(input_layouts=(seq,), desired_input_layouts=(full,), use_local_output=True)
    plan: dict[str, Any] = {}
    for name, style in styles.items():
        plan[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=seq,
                                                                                  use_local_output=False)
    for index in held:
        block = f"{stack}.{index}"
        plan[f"{block}.input_layernorm"] = SequenceParallel()
        plan[f"{block}.post_attention_layernorm"] = SequenceParallel()
        # attention's and the MLP's column-wise layers read the gathered input as a DTensor where they share it:
        # their partial input gradients add up, then one reduce-scatter (see shared_input_groups)
        plan[f"{block}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                        desired_input_kwarg_layouts={"hidden_states": full},
                                                        use_local_output=f"{block}.self_attn" not in shared)
        if f"{block}.mlp" not in whole:
            plan[f"{block}.mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(full,),
                                                      use_local_output=f"{block}.mlp" not in shared)
        else:  # a MoE block whose experts stay whole (whole_experts): it computes the gathered sequence on every
            # rank, its output cut back to this rank's shard (its gradient gathered in backward) for the residual
            plan[f"{block}.mlp"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(full,), use_local_input=True, output_layouts=(full,),
                desired_output_layouts=(seq,), use_local_output=False)
    # the first block's input: the embeddings' output cut to the rank's share; a later pipeline stage's is the
    # share it received, which the stage hands its first block as a DTensor already (Stage._given)
    stage = getattr(model, "pipeline_stage", False)
    cut: dict[str, Any] = dict(input_layouts=(full,), desired_input_layouts=(seq,)) \
        if not stage or cast(Any, model).first else {}
    if cut:
        plan[f"{stack}.{held[0]}"] = PrepareModuleInput(**cut)
    base = stack.rsplit(".", 1)[0]
    if stage and not cast(Any, model).last:
        # a pipeline stage before the last (its final norm a later stage's stand-in): its last block's output
        # share, a plain tensor, what the stage sends on (the next stage's same tp rank receives it)
        out: dict[str, Any] = dict(output_layouts=(seq,), desired_output_layouts=(seq,), use_local_output=True)
        plan[f"{stack}.{held[-1]}"] = PrepareModuleInputOutput(**cut, **out) if len(held) == 1 and cut \
            else PrepareModuleOutput(**out)
        return plan
    plan[f"{base}.norm"] = SequenceParallel()
    for head, _ in model.named_children():  # the head (lm_head, score) reads the gathered sequence
        if head != base:
            plan[head] = PrepareModuleInput(**gather)  # type: ignore[arg-type]
    return plan


def whole_mlps(model: nn.Module, styles: dict[str, str]) -> list[str]:
    """The decoder blocks' `mlp` modules no split layer lies in, under a plan of `styles` (resolve): a MoE layer
    whose experts stay whole on every rank (whole_experts). Under sequence parallelism each gathers its input and
    cuts its output back to the rank's sequence shard (sequence_parallel_plan)."""
    layers = decoder_layers(model)
    if layers is None:
        return []
    stack, held = layers
    mlps = [f"{stack}.{index}.mlp" for index in held]
    return [mlp for mlp in mlps if not any(name.startswith(f"{mlp}.") for name in styles)]


def decoder_layers(model: nn.Module) -> tuple[str, list[int]] | None:
    """(the layer stack's name, the indices of the blocks it holds) when every block with weights has exactly
    DECODER_PARTS and a final `norm` follows. A pipeline stage holds some of the blocks: the others are stand-ins
    without weights (model/stages.py), left out. A block with more norms (Gemma 2's around its MLP, which it also
    applies to the attention output, not the residual) would mix sequence shards and whole tensors: refused, not
    guessed."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module) and "." in name:
            held = [i for i, block in enumerate(module) if next(block.parameters(), None) is not None]
            parts = [{child for child, _ in module[i].named_children()} for i in held]
            if held and all(set(DECODER_PARTS) == p for p in parts) and f"{name.rsplit('.', 1)[0]}.norm" in modules:
                return name, held
    return None


def clip_global_norm(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over gradients that mix plain tensors (replicated over the TP ranks) and DTensors on
    different meshes (TP-split weights; under fsdp + tp, 2-D ones and 1-D ones), which one torch call
    refuses: one norm per kind, each made global (a collective for DTensors), then combined."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in members])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    if math.isfinite(max_norm):
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total)
    return total


def activation_reduction(*, sequence_parallel: bool, dtype: str, over: str = "", stream: str | None = None) -> str:
    """The precision audit's words for what TP reduces: activations, in the compute dtype; under autocast a
    column-wise layer's input and its gradient in the `stream`'s (the weights' dtype, which autocast casts inside
    the layer: comm.tp_collectives)."""
    how = "reduce-scattered and all-gathered along the sequence" if sequence_parallel else "all-reduced"
    dtypes = dtype if stream in (None, dtype) else f"row-wise outputs {dtype}, column-wise inputs {stream}"
    return f"activations {how} per block{over} ({dtypes})"


def first_of_group(total: torch.Tensor, *, tp_rank: int) -> torch.Tensor:
    """A TP group's ranks all compute the same loss: only the first reports it (the loop sums over ranks)."""
    return total if tp_rank == 0 else torch.zeros_like(total)
