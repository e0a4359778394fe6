"""The collectives each dimension of a layout calls in one optimizer step, from the model's shapes and the step's
micro-batch shapes: the rules every strategy's `predict_collectives` composes (toolkit/cost/collectives.py holds
what one entry is).

Each rule states what the library does, read from the collective counter on CPU (gloo) and held to it byte for
byte by tests/test_comm_prediction.py:
- DDP: one all-reduce of every trainable gradient per step (no_sync on the other micro-batches), in buckets of
  `bucket_cap_mb`; and one broadcast of the module's buffers, in the step's synced forward (broadcast_buffers).
  Under gradient compression, what its hook sends instead (dims/compression.py).
- FSDP2: each unit all-gathers its shards (in the compute dtype) before its forward on every micro-batch and,
  with reshard_after_forward, again before its backward (the root too); it reduce-scatters its gradients (in fp32
  under a 16-bit precision) once per step (set_requires_gradient_sync(False) before the last micro-batch); HSDP
  all-reduces the reduced shards over the replicas once per step. One rank's shard of a parameter is dim 0 in
  chunks of ceil(d0 / shard), padded.
- Tensor parallel (DTensor, model/tp_plan.py), each micro-batch: every row-wise layer all-reduces its output in
  forward (again where activation checkpointing's recompute reaches it: dims/recompute.py), every column-wise
  layer its input's gradient in backward (once for q, k and v, once for gate and up: the layers that read one
  module's input share one DTensor, tp_plan.shared_input_groups). With sequence parallelism a row-wise layer's
  output is reduce-scattered over the sequence instead (its backward: an all-gather), the norm's sequence shard is
  all-gathered before each column-wise group (its backward: one reduce-scatter of the group's summed input
  gradients), and the final norm's output is all-gathered for the replicated head, the embedding's output shard's
  gradient gathered in backward.
  A gathered column-wise layer (colwise_gather_output) all-gathers its output shard in forward; a row-wise layer
  that splits its whole input (rowwise_split_input) all-gathers its input's gradient shard in backward; each
  reduces as its plain kind does.
- Context parallel (dims/context.py), allgather method: each attention layer all-gathers the rank's keys and
  values (forward) and reduce-scatters their gradients (backward), each micro-batch; ulysses: its queries, keys,
  values and output pass an all-to-all each, forward and backward.
- Expert parallel (dims/expert.py, transformers' all_to_all dispatch), each MoE layer and micro-batch: the tokens
  per expert (int64, one per expert) in one all-to-all, then every (token, expert) pair's hidden row out to its
  expert's rank and the expert's output back, forward; in backward their gradients the other way. A rank sends all
  its rows (padding too) × top-k; what it receives is the router's choice: balanced routing is assumed (exact for
  the sum over ranks, not for one rank).
"""

from __future__ import annotations

import math
from typing import Any, Callable, cast

from torch import nn

from toolkit.cost.collectives import Collective
from toolkit.cost.flops import attention_heads
from toolkit.memory.state_bytes import dim0_rows, element_bytes
from toolkit.strategies.dims.compression import Compression, compression_collectives
from toolkit.strategies.dims.context import local_length
from toolkit.strategies.dims.recompute import forward_runs

Shapes = list[tuple[int, int]]  # (samples, padded length) of each micro-batch a rank computes in a step
Named = list[tuple[str, nn.Parameter]]


def tokens(shapes: Shapes) -> int:
    return sum(rows * length for rows, length in shapes)


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def ddp_collectives(model: nn.Module, *, group_size: int, group: str, bucket_cap_mb: float,
                    grad_dtype, compression: Compression | None = None) -> list[Collective]:
    """DDP over `group_size` replicas: the step's gradient all-reduce (as `compression` sends it), and the buffer
    broadcast of its synced forward (no_sync's forwards broadcast none)."""
    if group_size <= 1:
        return []
    grad_bytes = trainable_numel(model) * element_bytes(grad_dtype)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    buckets = max(1, math.ceil(grad_bytes / (bucket_cap_mb * 2 ** 20)))
    if compression is not None and compression.on:
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        out = compression_collectives(shapes, compression, group_size=group_size, group=group, buckets=buckets,
                                      grad_bytes_per_number=element_bytes(grad_dtype))
    else:
        out = [Collective(op="allreduce_", payload_bytes=grad_bytes, calls=buckets, group=group,
                          group_size=group_size, phase="backward", what="gradients", overlap="backward")]
    if buffer_bytes:
        out.append(Collective(op="broadcast_", payload_bytes=buffer_bytes, calls=1, group=group,
                              group_size=group_size, phase="forward", what="buffers"))
    return out


def fsdp_units(model: nn.Module, blocks: list[nn.Module]) -> list[Named]:
    """FSDP2's units: each block's parameters, then the root's (what no block holds), a tied weight once."""
    inside = {id(p) for block in blocks for p in block.parameters()}
    named = dict((id(p), n) for n, p in model.named_parameters())
    units = [[(named[id(p)], p) for p in block.parameters()] for block in blocks]
    return units + [[(n, p) for n, p in model.named_parameters() if id(p) not in inside]]


def fsdp_collectives(units: list[Named], *, shard: int, replicate: int, compute_dtype, reduce_dtype,
                     gathers_per_unit: int, local_shape: Callable[[str, nn.Parameter], tuple[int, ...]] | None = None,
                     shard_group: str = "dp_shard") -> list[Collective]:
    """FSDP2 over `shard` ranks (× `replicate` replicas: HSDP). `gathers_per_unit`: each unit's all-gathers in the
    step (micro-batches × 2 under reshard_after_forward, × 1 without; a pipeline stage's schedule decides its own).
    `local_shape(name, param)`: the parameter as this rank holds it before FSDP (a tensor-parallel rank's part).
    `shard_group`: the mesh dimension FSDP shards over (dp_shard_cp: dp_shard × cp flattened, under cp)."""
    shape_of = local_shape or (lambda name, p: tuple(p.shape))

    def padded(name: str, param: nn.Parameter) -> int:
        shape = shape_of(name, param)
        if not shape:
            return 1
        return math.ceil(shape[0] / shard) * math.prod(shape[1:])

    stored = [sum(padded(n, p) for n, p in unit) for unit in units]
    reduced = [sum(padded(n, p) for n, p in unit if p.requires_grad) for unit in units]
    out = []
    if shard > 1:
        out += [Collective(op="_allgather_base_",
                           payload_bytes=gathers_per_unit * sum(stored) * element_bytes(compute_dtype),
                           calls=gathers_per_unit * sum(1 for s in stored if s), group=shard_group, group_size=shard,
                           phase="forward", what="parameters", overlap="compute"),
                Collective(op="_reduce_scatter_base_",
                           payload_bytes=shard * sum(reduced) * element_bytes(reduce_dtype),
                           calls=sum(1 for r in reduced if r), group=shard_group, group_size=shard,
                           phase="backward", what="gradients", overlap="compute")]
    if replicate > 1:
        out.append(Collective(op="allreduce_", payload_bytes=sum(reduced) * element_bytes(reduce_dtype),
                              calls=sum(1 for r in reduced if r), group="dp_replicate", group_size=replicate,
                              phase="backward", what="gradient shards", overlap="compute"))
    return out


def tp_collectives(model: nn.Module, *, tp: int, shapes: Shapes, activation_dtype, sequence_parallel: bool,
                   recompute: bool, shard: int = 1, loss_parallel: bool = False, stream_dtype=None,
                   shard_index: int = 0) -> list[Collective]:
    """Tensor parallel over `tp` ranks, this rank's micro-batches `shapes` (the TP group's ranks compute the same);
    `recompute`: activation checkpointing runs each block's forward, and its collectives, again in backward, up to
    the last tensor the block saves (dims/recompute.py: not a Llama block's last row-wise exit). The
    gradients of modules each rank computes in part (Qwen3's q_norm, k_norm) are summed once a step in fp32
    (tp_plan.sum_partial_gradients), FSDP's shard of them where FSDP shards over `shard` ranks (this rank's:
    `shard_index`, whose rows are fewer where a dim 0 does not divide).
    Two dtypes: the split layers' matmuls output `activation_dtype` (what a row-wise layer's output and its
    gradient move); what lies between them (the residual stream, the norms' outputs: a column-wise layer's input
    and its gradient, the embedding's output) is in `stream_dtype`, the weights' own under autocast (tp: fp32
    weights, bf16 matmuls; measured by the counter), the compute dtype where the weights are cast (fsdp × tp).
    A LayerNorm under autocast outputs fp32 whatever its weights (an autocast fp32 op): an encoder with 16-bit
    weights under autocast moves fp32 column-wise inputs, counted here in its weights' dtype (untested)."""
    from toolkit.model import tp_plan

    if tp <= 1:
        return []
    stream_dtype = stream_dtype or activation_dtype
    partial = _partial_gradients(model, tp_plan.partial_gradient_modules(model), tp=tp, shard=shard,
                                 index=shard_index)
    if loss_parallel:
        partial += _vocab_parallel(model, tp=tp, shapes=shapes, stream_dtype=stream_dtype,
                                   sequence_parallel=sequence_parallel)
    styles = tp_plan.resolve(model)
    size, stream, micro = element_bytes(activation_dtype), element_bytes(stream_dtype), len(shapes)
    forwards = 2 if recompute else 1
    runs = forward_runs(model, styles, recompute=recompute)  # each split layer's forwards per micro-batch
    if not sequence_parallel:
        return partial + _whole_sequence_tp(model, styles, tp=tp, per_feature=tokens(shapes) * size,
                                            per_stream_feature=tokens(shapes) * stream, micro=micro, runs=runs)
    # sequence parallelism: Llama-style blocks of column- and row-wise layers only (tp_plan refuses the rest)
    rowwise = sum(style in tp_plan.ROW_WISE for style in styles.values())
    exits = sum(runs[name] for name, style in styles.items() if style in tp_plan.ROW_WISE)
    groups = tp_plan.shared_input_groups(styles)  # attention's and MLPs' that read one gathered input
    alone = sum(style in tp_plan.COLUMN_WISE for style in styles.values()) - sum(len(g) for g in groups.values())
    hidden = cast(Any, model).config.hidden_size
    # MoE layers whose experts stay whole: each gathers its input (forward, and a recompute's) and its output's
    # gradient (backward; in the stream's dtype: tp's experts output fp32 under autocast, measured), and cuts its
    # output and its input's gradient to the shard, which moves nothing
    whole = len(tp_plan.whole_mlps(model, styles))

    def entry(op: str, count: int, payload: int, phase: str, what: str) -> Collective:
        return Collective(op=op, payload_bytes=count * payload, calls=count * micro, group="tp", group_size=tp,
                          phase=phase, what=what)

    # a sequence shard: ceil(length / tp) positions (DTensor pads an uneven shard to the largest), and what a
    # reduce-scatter takes: the sequence padded to tp such shards; per element
    part = sum(rows * math.ceil(length / tp) for rows, length in shapes) * hidden
    # all-gathers: each column-wise group's entry (forward, and a recompute's), the final norm's output for the head
    # (forward, outside the blocks) and the embedding output's gradient (backward), in the stream's dtype (a
    # pipeline stage has the first only if it is the last, the second if it is the first: stages send and
    # receive sequence shares, tp_plan.sequence_parallel_plan); each
    # row-wise exit's gradient (backward), in the matmuls'. Reduce-scatters: each row-wise exit (forward, and where
    # a recompute reaches it), in the matmuls' dtype; each group's entry gradient, its layers' partial gradients
    # summed (backward), in the stream's. A column-wise layer outside a group all-reduces its own input gradient.
    # (the embedding output's gradient and a recompute's gathers run in backward: one entry, phase by majority)
    stage = getattr(model, "pipeline_stage", False)
    ends = 2 if not stage else int(cast(Any, model).first) + int(cast(Any, model).last)
    out = [entry("all_gather_into_tensor", forwards * (rowwise + whole) + ends, part * stream, "forward",
                 "activation shards"),
           entry("all_gather_into_tensor", rowwise, part * size, "backward", "row-wise outputs' gradient shards"),
           entry("all_gather_into_tensor", whole, part * stream, "backward", "whole MoE layers' output gradients"),
           entry("reduce_scatter_tensor", exits, part * tp * size, "forward", "row-wise outputs"),
           entry("reduce_scatter_tensor", len(groups), part * tp * stream, "backward", "activation gradients")]
    if alone:
        out.append(entry("all_reduce", alone, tokens(shapes) * hidden * stream, "backward", "activation gradients"))
    return partial + [c for c in out if c.calls]


def _vocab_parallel(model: nn.Module, *, tp: int, shapes: Shapes, stream_dtype, sequence_parallel: bool
                    ) -> list[Collective]:
    """strategy.loss_parallel (model/tp_plan.py vocab_plan), per micro-batch: a tied (row-wise) embedding's output
    all-reduced (forward, in its weight's dtype); the output layer's input gradient all-reduced (backward; under
    sequence parallelism reduce-scattered to sequence shards, its input's all-gather counted with the final norm's),
    in the final norm's output dtype, the stream's; the loss's max, sum of exponentials and target logit, one fp32
    value per token each, all-reduced (forward)."""
    from toolkit.model import tp_plan

    hidden, micro, count = cast(Any, model).config.hidden_size, len(shapes), tokens(shapes)
    head = count * hidden * element_bytes(stream_dtype)
    # a pipeline stage splits the embedding where it is the first (and tied), the head where it is the last
    split_embedding, split_head = tp_plan.vocab_parts(model, degree=tp)
    reduced = [Collective(op="all_reduce", payload_bytes=3 * count * 4, calls=3 * micro, group="tp", group_size=tp,
                          phase="forward", what="the loss's per-token max, sum and target logit")] if split_head else []
    if split_embedding:  # the embedding split with the head it is tied to
        reduced.append(Collective(op="all_reduce", payload_bytes=count * hidden * element_bytes(stream_dtype),
                                  calls=micro, group="tp", group_size=tp, phase="forward",
                                  what="the embedding's partial outputs"))
    if not split_head:
        return reduced
    if not sequence_parallel:
        return [*reduced, Collective(op="all_reduce", payload_bytes=head, calls=micro, group="tp", group_size=tp,
                                     phase="backward", what="the output layer's input gradient")]
    padded = sum(rows * math.ceil(length / tp) for rows, length in shapes) * hidden * element_bytes(stream_dtype)
    return [*reduced, Collective(op="reduce_scatter_tensor", payload_bytes=padded * tp, calls=micro, group="tp",
                                 group_size=tp, phase="backward", what="the output layer's input gradient")]


def _whole_sequence_tp(model: nn.Module, styles: dict[str, str], *, tp: int, per_feature: int,
                       per_stream_feature: int, micro: int, runs: dict[str, int]) -> list[Collective]:
    """Tensor parallel without sequence parallelism, each layer by its own features (`per_feature`: the bytes of one
    feature over every micro-batch's tokens in the matmuls' dtype, `per_stream_feature` in the stream's): a row-wise
    layer's output all-reduced in each of its forwards (`runs` per micro-batch), a column-wise layer's input
    gradient in backward (once for the layers of a module that read its input; the input's dtype, the stream's); a
    gathered output's shard all-gathered in each forward, a split input's gradient shard in backward."""
    from toolkit.model import tp_plan

    modules = dict(model.named_modules())
    outputs = inputs = gathered = out_reduces = in_reduces = gathers = 0
    # a group of column-wise layers that read one input all-reduce its gradient once (tp_plan.shared_input_groups)
    followers = {name for names in tp_plan.shared_input_groups(styles).values() for name in names[1:]}
    for name, style in styles.items():
        linear = cast(nn.Linear, modules[name])
        if style in tp_plan.ROW_WISE:
            outputs, out_reduces = outputs + runs[name] * linear.out_features, out_reduces + runs[name]
        elif name not in followers:
            inputs, in_reduces = inputs + linear.in_features, in_reduces + 1
        if style == tp_plan.GATHERED:
            gathered, gathers = gathered + runs[name] * linear.out_features // tp, gathers + runs[name]
        elif style == tp_plan.SPLIT_INPUT:
            gathered, gathers = gathered + linear.in_features // tp, gathers + 1
    out = [Collective(op="all_reduce", payload_bytes=outputs * per_feature, calls=out_reduces * micro, group="tp",
                      group_size=tp, phase="forward", what="activations"),
           Collective(op="all_reduce", payload_bytes=inputs * per_stream_feature, calls=in_reduces * micro,
                      group="tp", group_size=tp, phase="backward", what="activation gradients")]
    out = [c for c in out if c.calls]
    if gathers:
        out.append(Collective(op="all_gather_into_tensor", payload_bytes=gathered * per_feature,
                              calls=gathers * micro, group="tp", group_size=tp, phase="forward",
                              what="gathered activations"))
    return out


def sequence_parallel_norms(model: nn.Module, *, tp: int, reduce_dtype) -> list[Collective]:
    """Under FSDP × tp with sequence parallelism: the norms that compute on sequence shards (tp_plan's
    SequenceParallel modules) hold partial gradients over tp, which FSDP all-reduces once a step, each whole (FSDP2
    replicates a gradient partial over tp before it reduce-scatters it over its shards; measured at 2 × 2 ranks),
    in its reduce dtype (measured: fsdp × tp alone has none; tp with sequence parallelism alone neither)."""
    params = sequence_parallel_params(model)
    numel = sum(p.numel() for p in params)
    return [Collective(op="all_reduce", payload_bytes=numel * element_bytes(reduce_dtype), calls=len(params),
                       group="tp", group_size=tp, phase="backward", what="sequence-parallel norms' gradients",
                       overlap="compute")] if numel else []


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of the norms sequence parallelism computes on sequence shards (tp_plan's
    SequenceParallel modules): their gradients are partial sums over tp."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from toolkit.model import tp_plan

    named = dict(model.named_modules())
    norms = [name for name, style in tp_plan.sequence_parallel_plan(model).items()
             if isinstance(style, SequenceParallel)]
    return [p for name in norms for p in named[name].parameters() if p.requires_grad]


PARTIAL_GRADIENTS = "partial gradients"  # tp_plan.sum_partial_gradients: one all-reduce of them a step


def _partial_gradients(model: nn.Module, modules: list[str], *, tp: int, shard: int, index: int) -> list[Collective]:
    """The one all-reduce of the gradients tp ranks compute in part: of FSDP shard `index`'s unpadded rows where
    FSDP shards them over `shard` ranks (tp_plan.sum_partial_gradients sends each gradient's to_local())."""
    if not modules:
        return []
    named = dict(model.named_modules())
    params = [p for name in modules for p in named[name].parameters() if p.requires_grad]
    numel = sum(dim0_rows(p.shape[0], shard, index) * math.prod(p.shape[1:]) if p.dim() else 1 for p in params)
    return [Collective(op="allreduce_", payload_bytes=numel * 4, calls=1, group="tp", group_size=tp,
                       phase="step", what=PARTIAL_GRADIENTS)] if numel else []


def ulysses_collectives(model: nn.Module, *, cp: int, tp: int, shapes: Shapes, activation_dtype, recompute: bool
                        ) -> list[Collective]:
    """Context parallel, ulysses method, over `cp` ranks: each attention layer's queries, keys, values and output
    pass one all-to-all each (heads for sequence and back), forward and again in backward, each micro-batch; each
    hands over the whole local tensor (the rank's 2·ceil(L / 2cp) tokens, its heads: 1/tp of them under tensor
    parallel)."""
    if cp <= 1:
        return []
    config: Any = model.config
    heads, kv_heads, head_dim = attention_heads(config, tp=tp)
    local = sum(rows * local_length(length, cp=cp) for rows, length in shapes)
    one_pass = local * head_dim * (2 * heads + 2 * kv_heads) * element_bytes(activation_dtype)
    passes = 3 if recompute else 2  # forward, backward, and the recompute's forward
    layers, micro = config.num_hidden_layers, len(shapes)
    return [Collective(op="all_to_all_single", payload_bytes=passes * layers * one_pass,
                       calls=4 * passes * layers * micro, group="cp", group_size=cp, phase="forward",
                       what="heads for sequence")]


def cp_collectives(model: nn.Module, *, cp: int, tp: int, shapes: Shapes, activation_dtype, recompute: bool
                   ) -> list[Collective]:
    """Context parallel (allgather method) over `cp` ranks: `shapes` are the micro-batches before the split (each
    padded to a multiple of 2·cp, a rank holding 1/cp); keys and values of each attention layer, this rank's heads
    (1/tp of the KV heads under tensor parallel); `recompute`: activation checkpointing gathers them again in
    backward."""
    if cp <= 1:
        return []
    config: Any = model.config
    _, kv_heads, head_dim = attention_heads(config, tp=tp)
    layers = config.num_hidden_layers
    local = sum(rows * local_length(length, cp=cp) for rows, length in shapes)  # this rank's tokens
    one = local * kv_heads * head_dim * element_bytes(activation_dtype)  # a key (or a value) shard
    micro = len(shapes)
    forwards = 2 if recompute else 1
    return [Collective(op="all_gather_into_tensor", payload_bytes=forwards * 2 * layers * one,
                       calls=forwards * 2 * layers * micro,
                       group="cp", group_size=cp, phase="forward", what="keys and values"),
            Collective(op="reduce_scatter_tensor", payload_bytes=2 * layers * one * cp, calls=2 * layers * micro,
                       group="cp", group_size=cp, phase="backward", what="key and value gradients")]


def ring_collectives(model: nn.Module, *, cp: int, tp: int, shapes: Shapes, activation_dtype, recompute: bool
                     ) -> list[Collective]:
    """Context parallel, ring method, over `cp` ranks (dims/ring.py): per attention layer and micro-batch, the rank's
    keys and values (one buffer) pass to the next rank cp-1 times in forward (the recompute's forward again), and
    cp-1 times in backward, where the key and value gradients (fp32, torch's accumulation) pass cp times; each pass
    an all-to-all of the whole buffer (torch's permute). torch starts each pass before it attends to the block the
    rank holds and waits for it after (overlap "attention"), except a layer's last gradient pass, which backward
    waits for as soon as it is sent (_templated_ring_attention_backward: after its loop)."""
    if cp <= 1:
        return []
    config: Any = model.config
    _, kv_heads, head_dim = attention_heads(config, tp=tp)
    layers, micro = config.num_hidden_layers, len(shapes)
    local = sum(rows * local_length(length, cp=cp) for rows, length in shapes)
    elements = 2 * local * kv_heads * head_dim  # keys and values, every micro-batch
    forwards = 2 if recompute else 1
    return [Collective(op="all_to_all_single", payload_bytes=(forwards + 1) * (cp - 1) * layers * elements
                       * element_bytes(activation_dtype), calls=(forwards + 1) * (cp - 1) * layers * micro,
                       group="cp", group_size=cp, phase="forward", what="keys and values to the next rank",
                       overlap="attention"),
            Collective(op="all_to_all_single", payload_bytes=(cp - 1) * layers * elements * 4,
                       calls=(cp - 1) * layers * micro, group="cp", group_size=cp, phase="backward",
                       what="key and value gradients to the next rank", overlap="attention"),
            Collective(op="all_to_all_single", payload_bytes=layers * elements * 4, calls=layers * micro,
                       group="cp", group_size=cp, phase="backward",
                       what="each layer's last key and value gradients to the next rank")]


# parallel.cp_method -> its collectives
CP_COLLECTIVES = {"allgather": cp_collectives, "ulysses": ulysses_collectives, "ring": ring_collectives}


def ep_collectives(model: nn.Module, *, ep: int, shapes: Shapes, activation_dtype, recompute: bool
                   ) -> list[Collective]:
    """Expert parallel over `ep` ranks: per MoE layer and micro-batch, the counts all-to-all and four row
    all-to-alls (the pairs out and the outputs back, forward; their gradients, backward), each pair a hidden-size
    row in the compute dtype; `recompute`: activation checkpointing runs the forward's three again in backward. The
    rows a rank receives are taken as what it sends (balanced routing): the ranks' sum is exact."""
    if ep <= 1:
        return []
    from toolkit.observe.routing import DISPATCH, num_experts, plan_of

    config: Any = model.config
    layers = sum(1 for style in plan_of(model).values() if style == DISPATCH)
    pairs = sum(rows * length for rows, length in shapes) * int(config.num_experts_per_tok)
    row = config.hidden_size * element_bytes(activation_dtype)
    forwards, micro = (2 if recompute else 1), len(shapes)
    return [Collective(op="alltoall_base_", payload_bytes=forwards * layers * micro * num_experts(config) * 8,
                       calls=forwards * layers * micro, group="ep", group_size=ep, phase="forward",
                       what="tokens per expert"),
            Collective(op="all_to_all_single", payload_bytes=(2 * forwards + 2) * layers * pairs * row,
                       calls=(2 * forwards + 2) * layers * micro, group="ep", group_size=ep, phase="forward",
                       what="(token, expert) pairs to their experts and back (balanced routing)")]


def fp16_scaler_collectives(*, world_size: int, dtensors: bool) -> list[Collective]:
    """fp16's ShardedGradScaler (fsdp, pipeline), once a step as it unscales: its found-inf flag (one fp32)
    all-reduced over every rank, and where the gradients are DTensors (FSDP's shards) DTensor's reduction of it
    over their mesh before (its found_inf_reduce_handler). Measured on CPU at 2 ranks: fsdp over dp_shard, and a
    pipeline of plain stages; on a mesh of more dimensions (HSDP, fsdp x tp) the DTensor's one is not measured."""
    return [*([Collective(op="all_reduce", payload_bytes=4, calls=1, group="dp_shard", group_size=world_size,
                          phase="step", what="the fp16 scaler's found-inf over the gradients' mesh")]
              if dtensors else []),
            Collective(op="allreduce_", payload_bytes=4, calls=1, group="world", group_size=world_size,
                       phase="step", what="the fp16 scaler's found-inf")]
