"""Context parallel: each sample's sequence is split over the cp ranks, and attention sees the whole sequence by one
of three methods (`parallel.cp_method`):
- allgather (Llama 3's): each rank attends with its own queries to the keys and values of the whole sequence,
  all-gathered from every rank (their gradients come back through the gather as a reduce-scatter). Any cp;
- ulysses (DeepSpeed-Ulysses): an all-to-all trades the split of the sequence for a split of the heads, each rank
  attends with 1/cp of the heads over the whole sequence, and a second all-to-all trades back (gradients come back
  through both). cp must divide the KV heads; each rank moves 1/cp of q, k, v and the output, where allgather
  moves every rank's keys and values;
- ring (torch's ring attention, dims/ring.py): the keys and values pass from rank to rank, each rank attending to one
  block at a time with the device's fused kernel; causal attention only (no padding mask: the batches are padded on
  the right; no sliding window shorter than the samples), any cp. A rank holds two blocks of keys and values, not
  the whole sequence's.

Load balance (causal models): the padded sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r,
so that every rank has the same attention work (a causal query's work grows with its position).

A rank's batch (`split_batch`):
- the sequence is padded to a multiple of 2·cp (padding masked, its labels ignored);
- the labels are shifted once over the whole sequence (the label of position p is the token at p+1), so that the
  last token of a chunk keeps its label, the next chunk's first token; the loss of a rank's tokens is then taken
  without a shift (`shifted_labels`);
- `position_ids` are each token's place in the whole sequence (RoPE);
- the padding mask of the whole sequence reaches the attention, which builds its own mask from the positions:
  causal by place in the whole sequence, padding keys masked.

The attention runs inside `sequence(...)`, the context that tells it the rank's positions and the whole sequence's
padding; `register()` names each method to transformers (AttentionInterface, ATTENTIONS), with no mask of its own.

In a run (fsdp with cp_degree; `parallel.cp`): the ranks of a cp group are neighbours and read the same data shard;
FSDP shards over dp_shard × cp, so its reduction averages over cp times the data shards the loop scales for: each
rank's share of the loss is multiplied by cp (`each_micro_batch`). A rank's loss sum is that of its own tokens (the
logged loss, summed over the ranks, counts each token once); its evaluation counts a sequence's tokens on the cp
group's first rank only.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from toolkit.config.recipe import Recipe
from toolkit.cost.flops import attention_heads
from toolkit.data.losses import IGNORE_INDEX, TILED
from toolkit.errors import RecipeError
from toolkit.observe.routing import counted_tokens
from toolkit.strategies.base import LossSum, MicroBatchStrategy, Share, refuse_untested, tiled_head

# how a refusal names its fix: a recipe's parallel.cp, or the fsdp option a compare arm (fsdp-cp2) sets
DROP_CP = "drop parallel.cp (strategy.cp_degree)"
# each method's name to transformers (config._attn_implementation)
ATTENTIONS = {"allgather": "toolkit_cp_allgather", "ulysses": "toolkit_cp_ulysses", "ring": "toolkit_cp_ring"}


@dataclass(frozen=True, kw_only=True)
class Sequence:
    """What the attention of one forward needs beyond its own tensors."""

    group: Any  # the cp ranks' process group
    cp: int
    query_positions: torch.Tensor  # [local length]: each of this rank's tokens' place in the whole sequence
    key_positions: torch.Tensor  # [cp × local length]: the same for the gathered keys, in the gather's order
    key_valid: torch.Tensor  # [batch, cp × local length] bool: the gathered keys that are not padding
    # the attention mask, made at the first layer and shared by every layer (and by the recompute of activation
    # checkpointing): one [batch, 1, queries, keys] bool per sliding window, not one per layer saved for backward
    masks: dict[tuple[str, int | None], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # the local extents (sliding windows, attention chunks) the model's masks asked for, and the windows its
    # attention was told of: one asked for and never told is a mask the cp attention cannot follow (`sequence`)
    asked: set[int] = field(default_factory=set, compare=False, repr=False)
    told: set[int] = field(default_factory=set, compare=False, repr=False)

    @functools.cached_property
    def padding(self) -> tuple[bool, int]:
        """(whether every row's tokens come before its padding, the longest row's tokens), on the host: one sync, at
        the first layer that asks (ring, which attends without a mask)."""
        valid = torch.zeros_like(self.key_valid)
        valid[:, self.key_positions] = self.key_valid
        padded_before = (valid[:, 1:] & ~valid[:, :-1]).any()
        before, longest = torch.stack([padded_before.long(), self.key_valid.sum(1).max()]).tolist()
        return not before, int(longest)


_current: Sequence | None = None


def padded_length(length: int, *, cp: int) -> int:
    """The sequence length rounded up to a multiple of 2·cp (two chunks per rank)."""
    return -(-length // (2 * cp)) * (2 * cp)


def local_length(length: int, *, cp: int) -> int:
    """A cp rank's part of a sequence of `length`: its two chunks of the padded sequence."""
    return padded_length(length, cp=cp) // cp



def rank_positions(length: int, *, cp: int, rank: int) -> torch.Tensor:
    """The places in a sequence of `length` (a multiple of 2·cp) that cp rank `rank` holds: chunks rank and
    2·cp-1-rank."""
    assert length % (2 * cp) == 0, (length, cp)
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


@dataclass(frozen=True, kw_only=True)
class RankBatch:
    """One cp rank's share of a batch, and the context its forward runs in."""

    input_ids: torch.Tensor  # [batch, local length]
    position_ids: torch.Tensor  # [batch, local length]
    shifted_labels: torch.Tensor  # [batch, local length]: the next token's label (IGNORE_INDEX: no loss)
    token_mask: torch.Tensor  # [batch, local length]: 1 a token, 0 padding (the routing counter's; attention reads
    #   every rank's through `sequence`)
    sequence: Sequence


def split_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, *, cp: int,
                rank: int, group: Any, pad_token_id: int = 0) -> RankBatch:
    """Rank `rank`'s share of a [batch, length] batch (see the module's docstring)."""
    length = input_ids.shape[1]
    pad = padded_length(length, cp=cp) - length
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=pad_token_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (0, pad), value=0)
        labels = torch.nn.functional.pad(labels, (0, pad), value=IGNORE_INDEX)
    ignored = torch.full_like(labels[:, :1], IGNORE_INDEX)
    shifted = torch.cat([labels[:, 1:], ignored], dim=1)
    every = torch.cat([rank_positions(input_ids.shape[1], cp=cp, rank=r) for r in range(cp)]).to(input_ids.device)
    local = input_ids.shape[1] // cp
    mine = every[rank * local:(rank + 1) * local]
    batch = input_ids.shape[0]
    return RankBatch(input_ids=input_ids[:, mine], position_ids=mine.expand(batch, -1), shifted_labels=shifted[:, mine],
                     token_mask=attention_mask[:, mine],
                     sequence=Sequence(group=group, cp=cp, query_positions=mine, key_positions=every,
                                       key_valid=attention_mask[:, every].bool()))


@contextlib.contextmanager
def sequence(context: Sequence) -> Iterator[None]:
    """Run a forward (and its backward's recompute) with `context` as what the attention reads."""
    global _current
    before, _current = _current, context
    try:
        yield
    finally:
        _current = before
    untold = sorted(context.asked - context.told)
    if untold:  # Qwen2-MoE's window, Llama 4's chunks: in the mask transformers would build, not in the attention
        raise RecipeError(f"context parallel: the model masks its attention to {untold[0]} positions (a sliding "
                          "window or attention chunks) without telling the attention function, which the cp methods "
                          f"replace; they would attend over the whole causal past; {DROP_CP}")


def _gathered(tensor: torch.Tensor, context: Sequence) -> torch.Tensor:
    """[batch, heads, local, dim] from every cp rank -> [batch, heads, cp × local, dim], rank after rank."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    batch, heads, local, dim = tensor.shape
    # gathers along dim 0 (the only dimension it gathers along); its backward reduce-scatters the gradients
    every = all_gather_single_autograd(tensor.contiguous(), 0, context.group)
    return every.view(context.cp, batch, heads, local, dim).permute(1, 2, 0, 3, 4).reshape(
        batch, heads, context.cp * local, dim)


def allgather_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: this rank's queries against every rank's keys and values, through
    transformers' own sdpa function with the mask the positions give (`attention_mask`, built for the rank's
    tokens alone, is not it)."""
    context = _context()
    keys, values = _gathered(key, context), _gathered(value, context)
    allowed = _allowed(context, "local", _told(context, kwargs.pop("sliding_window", None)))
    return _sdpa(module, query, keys, values, allowed, dropout=dropout, scaling=scaling, **kwargs)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: 1/cp of the heads over the whole sequence (see the module)."""
    context = _context()
    queries, keys, values = (_heads_to_sequence(t, context) for t in (query, key, value))
    allowed = _allowed(context, "whole", _told(context, kwargs.pop("sliding_window", None)))
    out, _ = _sdpa(module, queries, keys, values, allowed, dropout=dropout, scaling=scaling, **kwargs)
    return _sequence_to_heads(out, context), None


def ring_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: this rank's queries over the whole sequence by torch's ring (dims/ring.py),
    causal by place, without a mask; what it cannot follow is refused in one line."""
    from toolkit.strategies.dims import ring

    context = _context()
    window = _told(context, kwargs.pop("sliding_window", None))
    if dropout:
        raise RecipeError(f"parallel.cp_method ring attends without dropout, and {type(module).__name__} drops "
                          f"attention weights at {dropout}; set model.dropout 0.0 or {ring.FIX}")
    _refuse_unread(module, kwargs, kernel="the flash kernel")
    right_padded, longest = context.padding
    if not right_padded:
        raise RecipeError(f"parallel.cp_method ring attends without a padding mask, which needs each sample's padding "
                          f"after its tokens; a batch here has padding before them; {ring.FIX}")
    if window is not None and window < longest:  # a window the tokens fit in is no window (padding is after them)
        raise RecipeError(f"parallel.cp_method ring attends over the whole causal past, and "
                          f"{type(module).__name__} attends within a sliding window of {window} positions, fewer "
                          f"than a sample's {longest} tokens; {ring.FIX}")
    out = ring.ring_attention(query, key, value, group=context.group, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _context() -> Sequence:
    assert _current is not None, "context-parallel attention outside strategies.dims.context.sequence()"
    return _current


def _told(context: Sequence, window: int | None) -> int | None:
    if window is not None:
        context.told.add(window)
    return window


def _allowed(context: Sequence, queries: str, window: int | None = None) -> torch.Tensor:
    """[batch, 1, queries, keys] bool for the rank's own queries (`local`, allgather) or the whole sequence's
    (`whole`, ulysses): causal by place in the whole sequence, within the layer's sliding `window` where it has one
    (a key fewer than `window` places back, as transformers' sliding_window_overlay), padding keys out; a padding
    query attends to itself too, so that no row is empty (its output reaches no loss and no other token)."""
    if (queries, window) not in context.masks:
        places = context.key_positions[None, :]
        rows = (context.query_positions if queries == "local" else context.key_positions)[:, None]
        seen = places <= rows
        if window is not None:
            seen = seen & (places > rows - window)
        context.masks[queries, window] = ((seen[None] & context.key_valid[:, None, :]) | (places == rows)[None]
                                          )[:, None]
    return context.masks[queries, window]


# what an attention function is handed that transformers' sdpa_attention_forward does not read, without a word: the
# model's attention would differ from what it computes
UNREAD_BY_SDPA = {"s_aux": "attention sinks: GPT-OSS", "sinks": "attention sinks",
                  "indices": "sparse attention's selected keys: DeepSeek-V3.2, GLM-MoE-DSA",
                  "block_indices": "block-sparse attention's selected blocks"}


def _refuse_unread(module: torch.nn.Module, kwargs: dict, *, kernel: str) -> None:
    unread = next((key for key in UNREAD_BY_SDPA if kwargs.get(key) is not None), None)
    if unread is not None:
        raise RecipeError(f"context parallel attends with {kernel}, which leaves out what {type(module).__name__} "
                          f"hands its attention as {unread} ({UNREAD_BY_SDPA[unread]}); {DROP_CP}")


def _sdpa(module, query, key, value, allowed, *, dropout, scaling, **kwargs) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    _refuse_unread(module, kwargs, kernel="sdpa")
    return sdpa_attention_forward(module, query, key, value, allowed, dropout=dropout, scaling=scaling,
                                  is_causal=False, **kwargs)


def _all_to_all(tensor: torch.Tensor, context: Sequence) -> torch.Tensor:
    """Dimension 0 (cp parts) exchanged: part j goes to cp rank j, part i of the result came from rank i."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(tensor.contiguous(), None, None, context.group)


def _heads_to_sequence(tensor: torch.Tensor, context: Sequence) -> torch.Tensor:
    """[batch, heads, local, dim] -> [batch, heads/cp, cp × local, dim]: this rank's head group over every rank's
    tokens, rank after rank (the order of key_positions)."""
    batch, heads, local, dim = tensor.shape
    parts = tensor.view(batch, context.cp, heads // context.cp, local, dim).transpose(0, 1)
    every = _all_to_all(parts, context)  # [cp: the rank the tokens are from, batch, heads/cp, local, dim]
    return every.permute(1, 2, 0, 3, 4).reshape(batch, heads // context.cp, context.cp * local, dim)


def _sequence_to_heads(out: torch.Tensor, context: Sequence) -> torch.Tensor:
    """sdpa's output [batch, cp × local, heads/cp, dim] -> [batch, local, heads, dim]: this rank's tokens, every
    head group, in head order."""
    batch, length, group, dim = out.shape
    local = length // context.cp
    parts = out.view(batch, context.cp, local, group, dim).transpose(0, 1)
    every = _all_to_all(parts, context)  # [cp: the head group, batch, local, heads/cp, dim]
    return every.permute(1, 2, 0, 3, 4).reshape(batch, local, context.cp * group, dim)


def register() -> None:
    """Name the methods to transformers; the mask it would build for a rank's tokens alone is not wanted."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for method, attention in (("allgather", allgather_attention), ("ulysses", ulysses_attention),
                              ("ring", ring_attention)):
        AttentionInterface.register(ATTENTIONS[method], attention)
        AttentionMaskInterface.register(ATTENTIONS[method], _no_mask)


def _no_mask(*args, **kwargs) -> None:
    """transformers' mask function for the cp methods: no mask (the attention builds its own from the places);
    a sliding window's or chunks' extent (`local_size`) is noted, for `sequence` to check the attention got it."""
    if _current is not None and kwargs.get("local_size") is not None:
        _current.asked.add(int(kwargs["local_size"]))
    return None


def check_recipe(recipe: Recipe, *, cp: int, tp: int, world_size: int) -> None:
    """What context parallel cannot run, before any rank starts (cp > 1; `tp`: the heads are split over that many
    ranks first)."""
    if world_size % (cp * tp):
        raise RecipeError(f"context parallel over {cp} ranks × tp {tp} does not divide the {world_size} ranks; use a "
                          f"world size that is a multiple of {cp * tp}")
    if recipe.model.task != "causal-lm":
        raise RecipeError(f"context parallel splits a causal LM's sequences; model.task is {recipe.model.task} (its "
                          f"sequences are pooled whole); {DROP_CP}")
    refuse_untested(recipe, layout="context parallel", drop="parallel.cp", lora_why="not tested together",
                    compile_why="its attention is not checked compiled")
    from toolkit.model.build import hf_config, meta_model  # transformers: only where cp is asked for

    config = hf_config(recipe.model)
    kernel = "the flash kernel" if recipe.parallel.cp_method == "ring" else "sdpa"
    if getattr(config, "attn_logit_softcapping", None):  # Gemma 2's: the methods' kernels have none
        raise RecipeError(f"context parallel attends with {kernel}, which has no attention logit soft-capping "
                          f"(config.attn_logit_softcapping {config.attn_logit_softcapping}); {DROP_CP}")
    if recipe.parallel.cp_method == "ring":
        check_ring(config, max_length=recipe.data.max_length, dropout=recipe.model.dropout,
                   precision=recipe.precision)
    attends(meta_model(recipe.model))
    if getattr(config, "output_router_logits", False):  # transformers' router loss over a rank's part of a sequence
        raise RecipeError("context parallel does not add a mixture-of-experts router's auxiliary loss yet (each rank "
                          f"routes part of each sequence); set output_router_logits: false or {DROP_CP}")
    if recipe.parallel.cp_method == "ulysses":
        heads = int(getattr(config, "num_attention_heads", None) or 0) // tp  # a tp rank's
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads * tp) // tp
        holder = "the model has" if tp == 1 else f"each of the {tp} tp ranks holds"
        if not heads or heads % cp or kv_heads % cp:
            raise RecipeError(f"parallel.cp_method ulysses splits the attention heads over the {cp} cp ranks, but "
                              f"{holder} {heads} attention and {kv_heads} key/value heads; use a cp that divides "
                              f"{kv_heads}, or parallel.cp_method allgather")


def check_ring(config: Any, *, max_length: int, dropout: float | None = None, precision: str = "bf16") -> None:
    """What the ring method cannot follow, from the model's config and the recipe (dims/ring.py), before any rank
    starts: attention dropout (`dropout`: model.dropout, None for the config's own); fp32 where the run is on CUDA,
    whose flash kernel takes 16-bit inputs only; a sliding window shorter than the sequences (`max_length`: a window
    they fit in changes nothing); a torch without ring attention. (Each was refused at the first step alone.)"""
    import torch

    from toolkit.strategies.dims import ring

    ring.check_available()
    rate = float(getattr(config, "attention_dropout", 0.0) or 0.0) if dropout is None else dropout
    if rate:
        raise RecipeError(f"parallel.cp_method ring attends without dropout, and the model drops attention weights at "
                          f"{rate} (config.attention_dropout); set model.dropout 0.0 or {ring.FIX}")
    if precision == "fp32" and torch.cuda.is_available():  # the run's device (process.dist): CUDA where there is one
        raise RecipeError(f"parallel.cp_method ring attends with CUDA's flash kernel, which takes bf16 and fp16 only, "
                          f"not fp32: set precision bf16, or {ring.FIX}")
    windows = sorted(w for w in layer_windows(config) if w is not None and w < max_length)
    if windows:
        raise RecipeError(f"parallel.cp_method ring attends over the whole causal past, and the model's layers attend "
                          f"within a sliding window of {windows[0]} positions, fewer than data.max_length "
                          f"{max_length}; {ring.FIX}")


def attends(model: torch.nn.Module) -> None:
    """A RecipeError for a model whose attention transformers' AttentionInterface does not choose (BLOOM's ALiBi,
    Falcon, MPT): the cp methods could not take its place."""
    if not getattr(model, "_supports_attention_backend", False):
        raise RecipeError(f"context parallel needs a model whose attention transformers lets the toolkit replace "
                          f"(AttentionInterface); {type(model).__name__} does not; {DROP_CP}")


def use_on(model: torch.nn.Module, *, method: str) -> None:
    """The model attends through `method`; a model whose attention transformers' AttentionInterface does not
    choose is refused in one line."""
    attends(model)
    register()
    model.set_attn_implementation(ATTENTIONS[method])  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True)
class Group:
    """This rank's place in its cp group."""

    group: Any
    size: int
    rank: int


def _share(batch: dict, group: Group, device: torch.device) -> RankBatch:
    return split_batch(batch["input_ids"].to(device), batch["attention_mask"].to(device), batch["labels"].to(device),
                       cp=group.size, rank=group.rank, group=group.group)


def _local_loss(strategy: MicroBatchStrategy, share: RankBatch, loss_sum: LossSum, *, tiled: bool) -> torch.Tensor:
    """The loss sum of this rank's tokens; `tiled` (train.tiled_loss): computed in tiles of its tokens by the
    output layer inside the model's forward (base.tiled_head), whose output is then that sum, not the logits."""
    mine: dict[str, Any] = {"labels": share.shifted_labels, "labels_shifted": True, **({TILED: True} if tiled else {})}
    model: Any = strategy.model  # FSDP2 works in place: the model itself
    head = model.get_output_embeddings() if tiled else None
    with strategy.forward_context(), counted_tokens(share.token_mask), \
            tiled_head(head, mine, share.input_ids.device) if head is not None else contextlib.nullcontext():
        output = strategy.model(input_ids=share.input_ids, position_ids=share.position_ids).logits
    return loss_sum(output, mine)


def each_micro_batch(strategy: MicroBatchStrategy, micro_batches: list[dict], *, loss_sum: LossSum, share: Share,
                     device: torch.device, group: Group) -> torch.Tensor:
    """base.each_micro_batch on this rank's share of each micro-batch: forward and backward inside its sequence
    context (activation checkpointing recomputes the attention in backward), the share × cp (see the module)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for index, batch in enumerate(micro_batches):
        mine = _share(batch, group, device)
        with strategy.accumulate(sync=index == len(micro_batches) - 1), sequence(mine.sequence):
            micro_sum = _local_loss(strategy, mine, loss_sum, tiled=bool(batch.get(TILED)))
            strategy.backward(share(micro_sum) * group.size)
        total += micro_sum.detach().double()
    return total


def forward_once(strategy: MicroBatchStrategy, micro_batches: list[dict], *, loss_sum: LossSum,
                 device: torch.device, group: Group) -> tuple[torch.Tensor, int]:
    """base.forward_once on this rank's shares: its tokens' loss; the count on the group's first rank only."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for batch in micro_batches:
        mine = _share(batch, group, device)
        with sequence(mine.sequence):
            total += _local_loss(strategy, mine, loss_sum, tiled=bool(batch.get(TILED))).detach().double()
    return total, sum(int(batch["num_items"]) for batch in micro_batches) if group.rank == 0 else 0


def activation_bytes(model, recipe: Recipe, *, world_size: int, how: dict[str, Any], cp: int, tp: int) -> list[int]:
    """A cp rank's activations, estimated (toolkit plan): its part of each sequence (2 chunks of ceil(L / 2cp))
    traced through the whole stack as a rank computes it, plus what the trace of that part does not hold: every
    layer's gathered keys and values, saved for backward at the whole sequence's length (the layer being recomputed
    alone under activation checkpointing; its own chunk counted twice, a 1/cp over-count), and the attention mask of
    the rank's queries (ulysses: the whole sequence's) over every key, made once per sliding window and shared by the
    layers (`Sequence.masks`: one byte a pair). The ring method saves only the rank's own keys and values, no mask:
    the trace alone."""
    import dataclasses

    from toolkit.memory.state_bytes import element_bytes
    from toolkit.strategies.base import whole_stack_activations

    micro, part = recipe.batch.micro_batch_size, local_length(recipe.data.max_length, cp=cp)
    local = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, max_length=part))
    traced = whole_stack_activations(model, local, world_size=world_size, how=how, tp_degree=tp)
    config: Any = model.config
    _, kv_heads, head_dim = attention_heads(config, tp=tp)
    dtype = how.get("autocast_dtype") or how["params_dtype"]
    layers = 1 if how.get("checkpointing") else config.num_hidden_layers
    gathered = layers * 2 * micro * cp * part * kv_heads * head_dim * element_bytes(dtype)
    if recipe.parallel.cp_method == "ring":  # saves only the rank's own keys and values: in the trace
        return traced
    queries = cp * part if recipe.parallel.cp_method == "ulysses" else part
    mask = micro * queries * cp * part * len(layer_windows(config))
    return [t + gathered + mask for t in traced]


def layer_windows(config: Any) -> set[int | None]:
    """The sliding windows the model's layers attend within (None: the whole causal past), one mask each."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return {window if kind == "sliding_attention" else None for kind in types}
    return {window}
