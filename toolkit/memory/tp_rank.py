"""One tensor-parallel rank as the activation trace runs it (toolkit/memory/activations.py): a plain copy of the
model with its share of every split layer (`local_model`), of the sequence between them under sequence parallelism,
and of the vocabulary under loss_parallel, with the loss computed as torch's loss_parallel computes it. Traced on
fake tensors, it keeps byte for byte what the plan itself keeps on DTensors (tests/test_tp_trace_reference.py),
without the process group a DTensor needs: `toolkit plan` runs where there is none, and a run's own prediction where
there is a real one."""

from __future__ import annotations

import copy
from typing import Any, Callable, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.errors import RecipeError
from toolkit.model import tp_plan
from toolkit.model.tied import head_tied_to_embedding


def local_model(model: nn.Module, degree: int, *, loss_parallel: bool = False,
                sequence_parallel: bool = False) -> nn.Module:
    """A copy of the meta `model` as one TP rank computes it: every linear layer the plan splits replaced by
    one of the local shape (column-wise: 1/N of the output features, row-wise: 1/N of the input features),
    the rest whole. Attention infers its head count from q/k/v's outputs (`view(..., -1, head_dim)`), so the
    copy runs 1/N of the heads and MLP columns on the full residual stream, as a rank does: what the activation
    trace of a TP rank runs. A gathered layer and the split-input layer after it stay whole, as a rank computes
    what lies between them whole (their split outputs and inputs, 1/N of a whole one, are not counted apart).
    Under `sequence_parallel` the norms and residual adds between the split layers hold the rank's 1/N of the
    tokens (`_shard_sequence`). Under `loss_parallel` the output layer (and a tied embedding) hold 1/N of the
    vocabulary: the logits and the loss's copies of them are a rank's share (the loss's all-reduced statistics,
    [tokens] each, are not counted; its backward as torch's: VocabularyShareLoss). Traces of it are cached
    (toolkit/memory/activations.py): a change to what it builds raises activations.TRACE_VERSION."""
    local = copy.deepcopy(model)
    if loss_parallel:
        _split_vocabulary(local, degree=degree)
    modules = dict(local.named_modules())
    for name, style in tp_plan.resolve(local).items():
        if style not in tp_plan.PLAIN:
            continue
        old = cast(nn.Linear, modules[name])
        features = ((old.in_features, old.out_features // degree) if style == "colwise"
                    else (old.in_features // degree, old.out_features))
        new = nn.Linear(*features, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
        for kind in ("weight", "bias"):
            if getattr(old, kind) is not None:
                getattr(new, kind).requires_grad_(getattr(old, kind).requires_grad)
        parent, _, child = name.rpartition(".")
        setattr(local.get_submodule(parent) if parent else local, child, new)
    if sequence_parallel:
        _shard_sequence(local, degree=degree)
    return local


def _shard_sequence(model: nn.Module, *, degree: int) -> None:
    """local_model under sequence parallelism: hooks that keep a plain copy's tokens where sequence_parallel_plan's
    DTensors keep a rank's. The first block's input is cut to the rank's share of the sequence (a tensor of its own,
    as a Replicate -> Shard(1) redistribution makes); attention's and the MLP's inputs are gathered whole and their
    outputs reduce-scattered to the share again (_Gathered, _Scattered: the tensors torch's collectives make on the
    way), and the head's input gathered. The norms and residual adds between run on the share. Checked against the
    plan itself on DTensors over a fake process group (tests/test_tp_trace_reference.py)."""
    layers = tp_plan.decoder_layers(model)
    if layers is None:  # the run refuses it first (tp_plan.sequence_parallel_plan): the plan says the same
        tp_plan.sequence_parallel_plan(model)
        raise RecipeError(f"strategy.sequence_parallel: {type(model).__name__} has no Llama-style decoder blocks")
    stack, held = layers
    tokens: dict[str, int] = {}

    def on_hidden(change: Callable[[torch.Tensor], torch.Tensor]):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (change(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
        return hook

    def first(hidden: torch.Tensor) -> torch.Tensor:
        tokens["whole"] = hidden.shape[1]
        return cast(torch.Tensor, _Cut.apply(hidden, degree))

    def cut_or_received(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        whole = getattr(module, RECEIVED_WHOLE, None)  # on the block (the hooks outlive a copy of the model)
        if whole is None:
            return on_hidden(first)(module, args, kwargs)
        tokens["whole"] = whole  # a pipeline stage after the first: given its share, a receive buffer, as it is
        return None

    def gather(hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, _Gathered.apply(hidden, degree, tokens["whole"]))

    def scattered(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (_Scattered.apply(output[0], degree), *output[1:])
        return _Scattered.apply(output, degree)

    model.get_submodule(f"{stack}.{held[0]}").register_forward_pre_hook(cut_or_received, with_kwargs=True)
    for index in held:
        for part in ("self_attn", "mlp"):
            module = model.get_submodule(f"{stack}.{index}.{part}")
            module.register_forward_pre_hook(on_hidden(gather), with_kwargs=True)
            module.register_forward_hook(scattered)
    base = stack.rsplit(".", 1)[0]
    for name, child in model.named_children():  # the head reads the gathered sequence
        if name != base:
            child.register_forward_pre_hook(on_hidden(gather), with_kwargs=True)
    setattr(model, SEQUENCE_SHARDS, degree)  # a pipeline stage's trace sends and receives shares


SEQUENCE_SHARDS = "toolkit_sequence_shards"  # on a local_model under sequence parallelism: its tp degree
# on the first block of a local_model traced as a pipeline stage after the first, under sequence parallelism: the
# whole sequence's length (the block is given the rank's share, as a run's stage receives it)
RECEIVED_WHOLE = "toolkit_received_whole"


# What torch 2.13's sequence-dim collectives allocate on a rank (DTensor's Shard(1) <-> Replicate / Partial
# redistributions over torch.distributed._functional_collectives), rank 0's share, the other ranks' data
# standing in for its own: the tensors, not the values.
def _all_gather(share: torch.Tensor, degree: int, whole: int) -> torch.Tensor:
    """[b, share, h] -> [b, whole, h]: all_gather_into_tensor stacks the ranks' shares on dim 0, then a chunk and
    cat moves them to the sequence (a view where b is 1); an uneven sequence is cut back (a copy)."""
    staged = torch.cat([share] * degree, dim=0)
    if share.shape[0] == 1:
        gathered = staged.view(1, degree * share.shape[1], *share.shape[2:])
    else:
        gathered = torch.cat(torch.chunk(staged, degree, dim=0), dim=1)
    return gathered if gathered.shape[1] == whole else gathered.narrow(1, 0, whole).contiguous()


def _reduce_scatter(full: torch.Tensor, degree: int) -> torch.Tensor:
    """[b, whole, h] -> [b, share, h]: an uneven sequence padded to `degree` equal chunks (copied), a non-contiguous
    one made contiguous, the chunks moved to dim 0 (a copy) and reduce-scattered (a new tensor of the share)."""
    share = -(-full.shape[1] // degree)
    if full.shape[1] % degree:
        chunks = [c.contiguous() for c in torch.chunk(full, degree, dim=1)]
        chunks = [torch.nn.functional.pad(c, (0, 0, 0, share - c.shape[1])) if c.shape[1] < share else c
                  for c in chunks]
        full = torch.cat(chunks, dim=1)
    elif not full.is_contiguous():
        full = full.contiguous()
    staged = torch.cat(torch.chunk(full, degree, dim=1), dim=0)
    return staged.narrow(0, 0, full.shape[0]).clone()


class _Cut(torch.autograd.Function):
    """A whole sequence cut to the rank's share, a tensor of its own (forward: the whole one can go); its gradient
    gathered whole (backward)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, degree: int) -> torch.Tensor:
        ctx.degree, ctx.whole = degree, full.shape[1]
        return torch.chunk(full, degree, dim=1)[0].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.degree, ctx.whole), None


class _Gathered(torch.autograd.Function):
    """A sequence share gathered whole (forward); its gradient reduce-scattered back to the share (backward)."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, degree: int, whole: int) -> torch.Tensor:
        ctx.degree = degree
        return _all_gather(share, degree, whole)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.degree), None, None


class _Scattered(torch.autograd.Function):
    """A row-wise layer's partial output reduce-scattered to the share (forward); the share's gradient gathered
    whole (backward)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, degree: int) -> torch.Tensor:
        ctx.degree, ctx.whole = degree, full.shape[1]
        return _reduce_scatter(full, degree)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.degree, ctx.whole), None


def _split_vocabulary(model: nn.Module, *, degree: int) -> None:
    """local_model under loss_parallel: the output layer (and a tied embedding) of a rank's 1/`degree` of the
    vocabulary."""
    old_head = cast(Any, model).get_output_embeddings()
    head = nn.Linear(old_head.in_features, old_head.out_features // degree, bias=old_head.bias is not None,
                     device=old_head.weight.device, dtype=old_head.weight.dtype)
    cast(Any, head).vocabulary_share = True  # its loss traced as torch's loss_parallel computes it (VocabularyShareLoss)
    if head_tied_to_embedding(model):
        old_embedding = cast(Any, model).get_input_embeddings()
        like = dict(device=old_embedding.weight.device, dtype=old_embedding.weight.dtype)
        cast(Any, model).set_input_embeddings(_RowsOfWhole(old_embedding.num_embeddings // degree,
                                                           old_embedding.embedding_dim,
                                                           whole=old_embedding.num_embeddings, **like))
        head.weight = cast(Any, model).get_input_embeddings().weight
    cast(Any, model).set_output_embeddings(head)


class _RowsOfWhole(nn.Embedding):
    """A tied embedding's rows of the vocabulary, its gradient made as torch 2.13's DTensor makes a row-wise
    embedding's: whole ([`whole`, hidden], no row-wise backward rule), then cut to the rank's rows (the tied head's
    split gradient it is added to; a pipeline's first stage: tp_plan.keep_gradients_split)."""

    def __init__(self, *args: Any, whole: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.whole = whole

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight: Any = self.weight  # the trace's own (to_empty swaps the tensors: a mark made earlier is not kept)
        weight.toolkit_rows_of_whole = True
        return cast(torch.Tensor, _WholeGradient.apply(ids, weight, self.whole))


def copy_rows_of_whole(param: torch.Tensor) -> None:
    """Where `param` is a _RowsOfWhole weight, its accumulated gradient (a view of the whole one) copied out, as
    DTensor's Replicate -> Shard does and the strategy's hook runs it (tp_plan.keep_gradients_split), before the
    trace lets the gradient go (activations._run_fake: its hooks run in the order the strategy's would)."""
    if getattr(param, "toolkit_rows_of_whole", False) and param.grad is not None:
        param.grad = param.grad.clone()


class _WholeGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, whole: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.whole, ctx.rows = whole, weight.shape[0]
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        gathered = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.whole, -1, False)
        return None, gathered.narrow(0, 0, ctx.rows), None  # the rows copied once accumulated (copy_rows_of_whole)


class VocabularyShareLoss(TorchDispatchMode):
    """Cross-entropy over a rank's share of the vocabulary's logits as torch's loss_parallel computes it
    (torch.distributed.tensor.parallel.loss: its handlers of these ops), with its collectives left out (they
    keep [tokens] each): the trace of a local_model under strategy.loss_parallel, whose head computes plain
    logits of that share. Its backward is not the fused kernel's: it builds the gradient as
    (one-hot - 1 + exp(log-softmax)) × grad, three tensors of tokens × share at once where the kernel needs two.
    The ops mirror torch's (rank 0's share); tests/test_tp_trace_reference.py checks the trace against
    torch's own handlers on DTensors. It is on for the loss's forward and the whole backward: a block's own
    log-softmax (none of the decoders the trace meets) would be computed this way too, the same bytes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._log_softmax.default:
            return self._log_softmax(*args, **kwargs)
        if func is torch.ops.aten._log_softmax_backward_data.default:
            grad, _, _, dtype = args
            return grad.to(dtype)  # the gradient came whole from the loss's backward
        if func is torch.ops.aten.nll_loss_backward.default and args[3] is None:  # the loop's loss: no class weights
            return self._nll_loss_backward(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        # 16-bit logits computed in fp32 and returned in their dtype unless half_to_float (the loop's are fp32)
        result = torch.float32 if half_to_float else x.dtype
        x = x.to(dtype=torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype,
                 memory_format=torch.contiguous_format)
        shifted = x - torch.amax(x, dim, keepdim=True)
        return (shifted - torch.log(torch.sum(torch.exp(shifted), dim, keepdim=True))).to(result)

    @staticmethod
    def _nll_loss_backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: None, reduction: int,
                           ignore_index: int, total_weight: torch.Tensor) -> torch.Tensor:
        if reduction == 1:  # mean
            grad = grad / total_weight
        target = target.unsqueeze(1)
        safe = torch.where(target != ignore_index, target, 0).squeeze(1).flatten()
        gradient = torch.zeros_like(x)
        mask = (safe < 0) | (safe >= x.shape[1])  # a target outside the share: its rank's offset is 0 here
        masked = safe.clone() - 0  # torch's clone() - offset: two tensors of [tokens]
        masked[mask] = 0
        update, rows = mask.to(gradient.dtype) - 1.0, torch.arange(masked.shape[0])  # alive to the end, as torch's
        gradient[rows, masked] = update
        grad = torch.where(target != ignore_index, grad.unsqueeze(1) if grad.dim() else grad, 0)
        return (gradient + torch.exp(x)) * grad
