"""A transformers model cut into pipeline stages, for any model whose blocks sit in one list. Not traced: torch's
tracer frontend (torch.distributed.pipelining.pipeline with a split spec) cannot capture Llama or GPT-2 as one
graph (measured, torch 2.13 and transformers 5.24: mask building and caches break it). Not written per family: a
hand-written stage forward drops what a family's own forward adds, such as Cohere's logit scale or Gemma 2's soft
cap.

Each stage runs the model's own forward, with the blocks of other stages left out of its block list, so
positions, masks (sliding windows included), rotary tables and whatever the model does before its first
block and after its last are the model's own code:
  first stage    the model's forward from its input ids, stopped at the output of its last block
  other stages   the same forward given the received hidden states as `inputs_embeds`; a hook hands them to
                 the stage's first block in place of what the model computed from them before the blocks
                 (embeddings scaled, positions added: the previous stage did that)
  last stage     runs on to the model's own output (final norm, head, logit scale or soft cap)

Which modules run before the blocks and which after is read from the model itself (`layout_of`): its block
list (transformer blocks by `_no_split_modules` or strategy.blocks, as fsdp finds them), and for each module
with weights outside it, where the owning module's `forward` names it, before or after the block list. A
stage keeps only its own: the others are swapped for modules without weights, so that a stage's parameters,
checkpoint and loaded tensors are its own, under the whole model's names (`model.layers.2…`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, NoReturn, cast

import torch
from torch import nn

from toolkit.data.losses import row_stats
from toolkit.errors import RecipeError
from toolkit.model.blocks import layer_stack


INPUT_IDS = "input_ids"  # a forward reading these itself after the blocks: only the first stage has them


@dataclass(frozen=True)
class Layout:
    """Where a model's parts sit, by module name: its block list, and the modules with weights outside it
    that its forward runs before the blocks (embeddings) and after them (final norm, head)."""

    stack: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    outputs: int = 1  # the values the forward unpacks a block's output into (DeBERTa's hidden states, attention)


def layout_of(model: nn.Module, class_names: tuple[str, ...] | None = None) -> Layout:
    """The model's stage layout, read from its modules and its forward's code; a RecipeError where they do
    not tell (blocks not in one list, a module with weights its forward names on both sides of the blocks,
    or not at all)."""
    blocks = layer_stack(model, class_names)
    kind = type(blocks[0]).__name__
    layerdrop = getattr(getattr(model, "config", None), "layerdrop", 0.0) or 0.0
    if layerdrop > 0:
        raise RecipeError(f"pipeline: {type(model).__name__} skips blocks at random in training (config.layerdrop "
                          f"{layerdrop}), which a stage cut at its blocks cannot follow; set layerdrop 0 in "
                          "model.config, or run fsdp, zero or ddp")
    stack = next((name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
                  and any(child is blocks[0] for child in m.children())), None)
    if stack is None or [id(b) for b in model.get_submodule(stack).children()] != [id(b) for b in blocks]:
        raise RecipeError(f"pipeline: the {len(blocks)} blocks {kind} of {type(model).__name__} are not one list "
                          "of the model (a ModuleList of all of them, in order), which pipeline stages cut; set "
                          "strategy.blocks to the class of the model's repeated block, or run fsdp, zero or ddp")
    before: list[str] = []
    after: list[str] = []
    parts = stack.split(".")
    for depth, toward in enumerate(parts):
        owner_name = ".".join(parts[:depth])
        owner = model.get_submodule(owner_name)
        uses = _uses(owner)
        if toward not in uses:
            _unclear(model, f"{type(owner).__name__}.forward does not name self.{toward}, the way to its blocks")
        where = uses[toward]
        for name, child in owner.named_children():
            if name == toward or next(child.parameters(), None) is None:
                continue  # modules without weights (rotary tables, dropout) stay on every stage
            path = f"{owner_name}.{name}" if owner_name else name
            if name not in uses:
                _unclear(model, f"{path} has weights that {type(owner).__name__}.forward does not name")
            used = uses[name]
            if used[1] < where[0]:
                before.append(path)
            elif used[0] > where[1]:
                after.append(path)
            else:
                _unclear(model, f"{type(owner).__name__}.forward uses {path} where it runs the blocks")
        read = uses.get(INPUT_IDS)
        if read is not None and read[1] > where[1]:  # a classifier finding each sample's last token
            raise RecipeError(f"pipeline: {type(owner).__name__}.forward reads the input ids after its blocks (to "
                              "find each sample's last token), which only the first stage has; run fsdp, zero or "
                              "ddp")
    owner = model.get_submodule(".".join(parts[:-1]))
    return Layout(stack=stack, before=tuple(before), after=tuple(after), outputs=_unpacked(owner, parts[-1]))


def _unclear(model: nn.Module, why: str) -> NoReturn:
    raise RecipeError(f"pipeline: cannot cut {type(model).__name__} into stages: {why}; set strategy.blocks to "
                      "the class of the model's repeated block if another list holds it, or run fsdp, zero or ddp")


def _uses(owner: nn.Module) -> dict[str, tuple[int, int]]:
    """The first and last line of `owner.forward` that names each `self.<attribute>` (the input and output
    embeddings also where it calls get_input_embeddings / get_output_embeddings)."""
    try:
        source = textwrap.dedent(inspect.getsource(type(owner).forward))
    except (OSError, TypeError):
        return {}
    getters = ("get_input_embeddings", "get_output_embeddings")
    children = {id(m): n for n, m in owner.named_children()}
    uses: dict[str, tuple[int, int]] = {}

    def note(name: str, line: int) -> None:
        first, last = uses.get(name, (line, line))
        uses[name] = (min(first, line), max(last, line))

    tree = ast.parse(source)
    handed = {id(inner) for call in ast.walk(tree)
              if isinstance(call, ast.Call) and (_on_self(call.func) or _base_getattr(call.func))
              for argument in (*call.args, *call.keywords) for inner in ast.walk(argument)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == INPUT_IDS and id(node) not in handed:
            note(INPUT_IDS, node.lineno)  # read by the forward itself
        if isinstance(node, ast.Call) and _base_getattr(node):  # the base model, by its prefix
            note(str(getattr(owner, "base_model_prefix", "")), node.lineno)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            name = node.attr
            if name in getters:
                module = getattr(owner, name)()
                name = children.get(id(module), name) if module is not None else name
            note(name, node.lineno)
    return uses


def _unpacked(owner: nn.Module, stack: str) -> int:
    """How many values `owner.forward` unpacks each block's output into (`hidden, attn = layer(...)`: 2), 1 where
    it keeps the output whole. A RecipeError where a value besides the hidden states goes on to the next block, as
    unpacked, indexed (`layout = outputs[1]`: LiLT) or renamed (`position_bias = self_attention_position_bias`:
    T5): a stage receives the hidden states alone."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
    except (OSError, TypeError):
        return 1
    count = 1
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and any(isinstance(n, ast.Attribute) and n.attr == stack
                                                  and isinstance(n.value, ast.Name) and n.value.id == "self"
                                                  for n in ast.walk(loop.iter))):
            continue
        targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target]
        block = targets[-1].id if isinstance(targets[-1], ast.Name) else None
        calls = [c for c in ast.walk(loop) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                 and c.func.id == block]
        handed = {n.id for c in calls for a in (*c.args, *c.keywords) for n in ast.walk(a) if isinstance(n, ast.Name)}
        assigns = [a for a in ast.walk(loop) if isinstance(a, ast.Assign) and len(a.targets) == 1]
        whole: set[str] = set()  # names holding a block's whole output
        others: set[str] = set()  # names holding a value of it besides the hidden states
        for assign in assigns:
            if any(assign.value is c for c in calls):
                if isinstance(assign.targets[0], ast.Tuple):
                    names = [ast.unparse(t) for t in assign.targets[0].elts]
                    others.update(names[1:])
                    count = max(count, len(names))
                elif isinstance(assign.targets[0], ast.Name):
                    whole.add(assign.targets[0].id)
        while True:  # what is indexed past [0] out of a whole output, or renamed from such a value
            more = {assign.targets[0].id for assign in assigns if isinstance(assign.targets[0], ast.Name)
                    and (_indexed_past_first(assign.value, whole)
                         or isinstance(assign.value, ast.Name) and assign.value.id in others)} - others
            if not more:
                break
            others |= more
        onward = sorted(others & handed)
        if onward:
            raise RecipeError(f"pipeline: {type(owner).__name__}.forward hands {onward[0]} from each block to the "
                              "next beside the hidden states, which a stage does not receive; run fsdp, zero or ddp")
    return count


def _indexed_past_first(node: ast.expr, names: set[str]) -> bool:
    """`outputs[k]` with k >= 1, `outputs` one of `names`."""
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names \
        and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int) and node.slice.value != 0


def _base_getattr(node: ast.AST) -> bool:
    """`getattr(self, self.base_model_prefix)`, as transformers' generic heads reach their base model."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
        and len(node.args) == 2 and ast.unparse(node.args[0]) == "self" \
        and ast.unparse(node.args[1]) == "self.base_model_prefix"


def _on_self(func: ast.expr) -> bool:
    """A call of one of the module's own children or methods (`self.model(...)`, `self.model.decoder(...)`)."""
    if not isinstance(func, ast.Attribute):
        return False
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id == "self"


def layer_list(model: nn.Module, class_names: tuple[str, ...] | None = None) -> nn.ModuleList:
    """The model's list of transformer blocks, the one stages cut."""
    return cast(nn.ModuleList, model.get_submodule(layout_of(model, class_names).stack))


class _Reached(BaseException):
    """Raised at a stage's last block, to end the model's forward there (a BaseException: no `except
    Exception` on the way catches it)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class _Passed(torch.Tensor):
    """What a left-out block before a stage's own hands on: indexed [0], as the models whose blocks return a
    tuple index it, it is itself. The stage's first block is given the received hidden states instead."""

    def __getitem__(self, index):
        if isinstance(index, int) and index == 0:
            return self
        return super().__getitem__(index)


class _Before(nn.Module):
    """A block of an earlier stage: hands its input on (the stage's first block replaces it), with Nones for the
    other values a forward unpacking several from each block takes (only what it returns or discards)."""

    def __init__(self, outputs: int = 1):
        super().__init__()
        self.outputs = outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        try:
            passed = hidden if isinstance(hidden, _Passed) else hidden.as_subclass(_Passed)
        except RuntimeError:  # a fake tensor (the plan's trace of a stage of the head's rows alone, whose head is
            passed = hidden  # given the received tensor whatever its blocks passed on)
        return passed if self.outputs == 1 else (passed, *[None] * (self.outputs - 1))


class _After(nn.Module):
    """A block or module of a later stage: never run (the forward stops at the stage's last block)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"a pipeline stage ran {self.what}, which a later stage holds")


class _Embedded(nn.Module):
    """A module that runs before the blocks, on a stage other than the first: its output only feeds what the
    stage's first block is given instead, so it hands on a floating-point input (inputs_embeds, the received
    hidden states) or, for an embedding of ids or positions, zeros of its width."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.width = getattr(original, "embedding_dim", None)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        floats = [t for t in tensors if t.is_floating_point()]
        if floats:
            return floats[0]
        if self.width is not None and tensors:
            return torch.zeros(*tensors[0].shape, self.width, device=tensors[0].device)
        raise RuntimeError("a pipeline stage ran an embedding of the first stage without an input it can pass on")


def _plain_attributes(block: nn.Module, stand_in: nn.Module) -> nn.Module:
    """`stand_in` with the plain settings of the block it replaces (ModernBERT's forward reads each layer's
    attention_type, Gemma 3's its sliding window)."""
    for key, value in vars(block).items():
        if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool, type(None))):
            setattr(stand_in, key, value)
    return stand_in


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    owner, _, name = path.rpartition(".")
    setattr(model.get_submodule(owner), name, module)


def _first_argument(block: nn.Module) -> str:
    """The name a block's forward gives its hidden states (its first argument)."""
    return next(iter(inspect.signature(block.forward).parameters), "hidden_states")


class Stage(nn.Module):
    """One stage: blocks `layer_ids` of `model`, plus what runs before the blocks (first) and after them
    (last). The model's own children are this module's children, under their own names."""

    whole: Any  # the transformers model whose forward the stage runs
    pipeline_stage = True  # what the tensor-parallel plan asks to tell a stage from a model (tp_plan.vocab_modules)
    # under sequence parallelism (tp_plan.parallelize) a stage after the first receives a tp rank's share of the
    # sequence: the model is given a stand-in of the whole sequence's shape (its mask and positions are the whole
    # sequence's) and the first block the share, a DTensor of `sequence_mesh` (none in the plan's trace)
    sequence_shards = 1
    sequence_mesh: Any = None

    def __init__(self, model: Any, *, layer_ids: list[int], first: bool, last: bool,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 blocks: tuple[str, ...] | None = None, head_rows: tuple[int, int] | None = None):
        """`head_rows` (strategy.split_head): this stage computes the head over those rows of the vocabulary, and
        gives on the final norm's output with each token's log-sum-exp and next-token logit so far (the last
        stage: those two alone, the loss's). Its blocks, if any, are the model's last; without any, it receives
        the final norm's output and those two from the stage before."""
        super().__init__()
        self.layout = layout_of(model, blocks)
        self.first, self.last, self.autocast = first, last, autocast
        self.config = model.config
        self.layer_ids = sorted(layer_ids)
        self.tied = tied_embedding_names(model)
        self.head_rows = head_rows
        stack: Any = model.get_submodule(self.layout.stack)
        for i in range(len(stack)):
            if i not in layer_ids:
                earlier = not self.layer_ids or i < self.layer_ids[0]
                stand_in = _Before(self.layout.outputs) if earlier else _After(f"block {i}")
                stack[i] = _plain_attributes(stack[i], stand_in)
        if not first:
            for path in self.layout.before:
                _replace(model, path, _Embedded(model.get_submodule(path)))
        if head_rows is not None:
            self.head_path = head_path(model, self.layout)
            head = model.get_submodule(self.head_path)
            head.forward = functools.partial(_head_rows, self, head, *head_rows)
            embedding = model.get_input_embeddings() if first and self.tied is not None else None
            if embedding is not None:  # the tied weight's two uses on this stage, one autograd node (_TiedRows)
                embedding.register_forward_pre_hook(functools.partial(_tied_lookup, self, *head_rows))
                embedding.register_forward_hook(_tied_lookup_done)
            if not self.layer_ids:  # the final norm ran on the stage before: its output arrives
                for path in self.layout.after:
                    if path != self.head_path:
                        _replace(model, path, _Embedded(model.get_submodule(path)))
        elif not last:
            for path in self.layout.after:
                _replace(model, path, _After(path))
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "whole", model)  # not a child: its children are this module's
        signature = inspect.signature(type(model).forward).parameters
        self.options = {"use_cache": False} if "use_cache" in signature else {}
        self.hidden_name = _first_argument(stack[self.layer_ids[0]]) if self.layer_ids else "hidden_states"
        self._head_input: torch.Tensor | None = None  # what the head was given (split_head), read after a forward
        self._received: torch.Tensor | None = None  # a rows-only stage's final-norm output, for its head
        self._row_gradients: dict = {}  # the whole head's gradient buffer its rows' backward writes (_Rows)
        self._tied_rows: torch.Tensor | None = None  # the first stage's rows of its tied weight (_TiedRows)

    def train(self, mode: bool = True) -> Stage:
        super().train(mode)
        self.whole.training = mode
        return self

    def blocks(self) -> list[nn.Module]:
        stack: Any = self.whole.get_submodule(self.layout.stack)
        return [stack[i] for i in self.layer_ids]

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of a weight other stages hold too: a tied input/output embedding, the input one
        (first) or the head (last, or holding rows of it under split_head); under split_head an untied head, on
        each stage with rows of it."""
        if self.tied is None:
            return self.get_parameter(f"{self.head_path}.weight") if self.head_rows is not None else None
        if self.first:
            return self.get_parameter(self.tied[0])
        if self.last or self.head_rows is not None:
            return self.get_parameter(self.tied[1])
        return None

    def forward(self, x: torch.Tensor, *stats: torch.Tensor, attention_mask: torch.Tensor | None = None,
                length: int | None = None, labels: torch.Tensor | None = None) -> Any:
        """`length`: the whole sequence's, where `attention_mask` is None (the plan's trace of packed data).
        Under split_head, `stats` are the earlier stages' log-sum-exp and next-token logit per token and `labels`
        the micro-batch's (every stage is given them)."""
        if self.head_rows is None:
            return self._run(x, attention_mask, length)
        assert labels is not None, "a stage with rows of the head needs the micro-batch's labels"
        self._received = None if self.layer_ids else x
        try:
            logits = self._run(x, attention_mask, length)
            hidden = cast(torch.Tensor, self._head_input)
        finally:
            self._received = self._head_input = None
        if logits.shape[-1] != self.head_rows[1] - self.head_rows[0]:  # a forward that skips the head module
            raise RuntimeError(f"strategy.split_head: {type(self.whole).__name__}'s forward gave {logits.shape[-1]} "
                               f"logits a token, not its stage's {self.head_rows[1] - self.head_rows[0]} rows of "
                               f"{self.head_path}; set strategy.split_head=false")
        log_sum_exp, target_logit = row_stats(logits, labels, start=self.head_rows[0])
        if stats:
            log_sum_exp, target_logit = torch.logaddexp(stats[0], log_sum_exp), stats[1] + target_logit
        if self.last:
            return log_sum_exp, target_logit
        # a copy: a stage's output is neither its input (the received tensor) nor a view (the head's input is one of
        # the final norm's output): torch's split backward detaches the outputs in place
        return hidden.clone(), log_sum_exp, target_logit

    def _run(self, x: torch.Tensor, attention_mask: torch.Tensor | None, length: int | None) -> torch.Tensor:
        blocks = self.blocks()
        handles = []
        embeds = x
        if not self.first and self.sequence_shards > 1:  # x is this tp rank's share of the sequence
            whole = length if length is not None else cast(torch.Tensor, attention_mask).shape[-1]
            embeds = x.new_zeros(()).expand(x.shape[0], whole, *x.shape[2:])  # its shape, no memory
            if self.sequence_mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                shape = (x.shape[0], whole, *x.shape[2:])
                x = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False, shape=torch.Size(shape),
                                       stride=torch.empty(shape, device="meta").stride())
        if not self.first and blocks:  # prepended: before FSDP2's own pre-forward hook, which casts the block's
            # inputs
            handles.append(blocks[0].register_forward_pre_hook(functools.partial(self._given, x), with_kwargs=True,
                                                               prepend=True))
        if not self.last and self.head_rows is None:  # appended: after FSDP2's post-forward hook (reshard, the
            # backward hooks)
            handles.append(blocks[-1].register_forward_hook(_stop))
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": embeds}
        try:
            with self.autocast():
                out = self.whole(**inputs, attention_mask=attention_mask, **self.options)
        except _Reached as reached:
            return reached.hidden
        finally:
            for handle in handles:
                handle.remove()
        return out.logits if hasattr(out, "logits") else out[0]

    def _given(self, hidden: torch.Tensor, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, self.hidden_name: hidden}


def _head_rows(stage: Stage, head: nn.Module, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor:
    """The head over rows [start, end) of the vocabulary (its forward under split_head): a rows-only stage's head
    is given the final norm's output it received, in place of what its stand-ins passed on."""
    if stage._received is not None:
        hidden = stage._received
    stage._head_input = hidden
    rows = stage._tied_rows
    stage._tied_rows = None
    if rows is None:
        rows = _Rows.apply(cast(torch.Tensor, head.weight), start, end, stage._row_gradients)
    return torch.nn.functional.linear(hidden, rows)  # no bias: head_path refuses one


def _tied_lookup(stage: Stage, start: int, end: int, module: nn.Module, args: tuple) -> None:
    """Before the first stage's input embedding runs: its tied weight, through _TiedRows, for the lookup (put in
    the module's place until it returns) and for the head's rows."""
    weight = module._parameters["weight"]
    assert weight is not None
    if plain_lookup(module) and args and isinstance(args[0], torch.Tensor):
        # the lookup too in one autograd node that writes its gradient into a kept buffer: torch's embedding
        # backward makes a zeroed dense tensor of the whole weight per micro-batch (measured with
        # train.profile_steps: a sixth of llama-tiny's first stage, split_head's rows included, in fills)
        looked, stage._tied_rows = _TiedLookup.apply(weight, args[0], start, end, module.padding_idx,
                                                     stage._row_gradients)
        module.__dict__["_looked"] = looked
        lookup = weight.detach()  # the module's own lookup, not differentiated: its output is replaced
    else:
        lookup, stage._tied_rows = _TiedRows.apply(weight, start, end)
    module.__dict__["_stashed_weight"] = weight  # not a parameter: the module's own stays registered as it was
    module._parameters["weight"] = lookup  # type: ignore[assignment]


def _tied_lookup_done(module: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
    module._parameters["weight"] = module.__dict__.pop("_stashed_weight")
    return module.__dict__.pop("_looked", None)  # None: the module's output as it is


def plain_lookup(module: nn.Module) -> bool:
    """An nn.Embedding whose forward is torch's own, without max_norm, frequency scaling or sparse gradients:
    its output is F.embedding(ids, weight), which _TiedLookup computes. A subclass's forward (a scaled
    embedding) keeps the module's lookup (_TiedRows)."""
    return isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward and \
        module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


class _TiedLookup(torch.autograd.Function):
    """A tied weight's embedding lookup and rows of the head on one stage, one autograd node whose backward
    writes the whole weight's gradient into a buffer kept across micro-batches (_kept_buffer): the rows'
    gradient, and the lookup's added at its tokens' rows (the padding index's left out, as torch's)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, start: int, end: int, padding: int | None,
                buffers: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(ids)
        ctx.start, ctx.end, ctx.padding, ctx.buffers, ctx.shape, ctx.weight = start, end, padding, buffers, \
            weight.shape, weight
        return torch.nn.functional.embedding(ids, weight), weight[start:end]

    @staticmethod
    def backward(ctx: Any, looked: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None,
                                                                             None, None]:
        # both gradients are tensors: autograd hands zeros for an output that reached no loss
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        (ids,) = ctx.saved_tensors
        whole = _kept_buffer(ctx, looked)
        whole[ctx.start:ctx.end].copy_(rows)
        touched = ids.reshape(-1)
        grad = looked.reshape(touched.numel(), -1)
        if ctx.padding is not None:  # zeroed, not filtered out: shapes that do not hang on the data (the plan
            # traces this backward on fake tensors; a GPU would sync on a filter)
            grad = grad.masked_fill((touched == ctx.padding).unsqueeze(-1), 0)
        whole.index_add_(0, touched, grad.to(whole.dtype))
        _keep(ctx, whole, touched)
        return whole, None, None, None, None, None


class _TiedRows(torch.autograd.Function):
    """A tied weight used on one stage by the input embedding and by rows of the head, as one autograd node:
    the lookup's gradient (made whole, dense, per micro-batch) takes the rows' gradient in place. A slice of the
    weight instead made another zeroed tensor of the whole weight per micro-batch, and its sum with the lookup's a
    third pass."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.start, ctx.end, ctx.shape = start, end, weight.shape
        return weight.view_as(weight), weight[start:end]

    @staticmethod
    def backward(ctx: Any, whole: torch.Tensor | None, rows: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        if whole is None:
            assert rows is not None
            whole = rows.new_zeros(ctx.shape)
        elif not whole.is_contiguous():
            whole = whole.contiguous()
        if rows is not None:
            whole[ctx.start:ctx.end] += rows
        return whole, None, None


class _Rows(torch.autograd.Function):
    """weight[start:end], whose backward hands the whole weight's gradient back in a buffer kept across
    micro-batches (zero outside the rows, written once): slicing makes a new zeroed tensor of the whole weight
    per micro-batch, which cost a pipeline stage of llama-tiny's head (30,522 × 128) a fifth of its step in
    page faults and fills (measured with train.profile_steps)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, start: int, end: int, buffers: dict) -> torch.Tensor:
        ctx.start, ctx.end, ctx.buffers, ctx.shape, ctx.weight = start, end, buffers, weight.shape, weight
        return weight[start:end]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        whole = _kept_buffer(ctx, grad)
        whole[ctx.start:ctx.end].copy_(grad)
        _keep(ctx, whole)
        return whole, None, None, None


def _kept_buffer(ctx: Any, like: torch.Tensor) -> torch.Tensor:
    """The whole weight's gradient buffer a rows backward (_Rows, _TiedLookup) writes, kept across micro-batches:
    zero but where its last use wrote (the rows, and a lookup's token rows, zeroed here). A buffer taken as the
    weight's gradient itself (torch's split backward assigns what it is handed) or changed since (accumulated
    into, zeroed) is no longer this function's: a new one."""
    key = (like.dtype, like.device, tuple(ctx.shape))
    whole, version, touched = ctx.buffers.get(key, (None, -1, None))
    held = ctx.weight.grad
    if whole is None or whole._version != version or held is not None and held.data_ptr() == whole.data_ptr():
        return like.new_zeros(ctx.shape)
    if touched is not None:
        whole.index_fill_(0, touched, 0)
    return whole


def _keep(ctx: Any, whole: torch.Tensor, touched: torch.Tensor | None = None) -> None:
    """Keep the buffer for the next micro-batch, with the token rows written beyond the rows (to zero then)."""
    ctx.buffers[(whole.dtype, whole.device, tuple(ctx.shape))] = (whole, whole._version, touched)


def head_path(model: nn.Module, layout: Layout) -> str:
    """The name of the model's output layer (its get_output_embeddings), a linear layer after the blocks; a
    RecipeError where there is none such (strategy.split_head)."""
    head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules()}
    path = names.get(id(head)) if head is not None else None
    if path is None or path not in layout.after or not isinstance(head, nn.Linear) or head.bias is not None:
        raise RecipeError(f"strategy.split_head: {type(model).__name__} has no linear output layer without a bias "
                          "run after its blocks (its get_output_embeddings) to split over the stages; set "
                          "strategy.split_head=false")
    return path


def _stop(module: nn.Module, args: tuple, output: Any) -> None:
    raise _Reached(output[0] if isinstance(output, (tuple, list)) else output)


def tied_embedding_names(model: Any) -> tuple[str, str] | None:
    """(input embedding, output head) parameter names when the two are one tied weight."""
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inputs is None or outputs is None or getattr(outputs, "weight", None) is not inputs.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return f"{names[id(inputs)]}.weight", f"{names[id(outputs)]}.weight"
