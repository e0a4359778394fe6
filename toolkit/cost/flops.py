"""Training FLOPs of one step from a model's shapes (no weights): matmuls, attention, the head, and the recompute of
activation checkpointing, per token and per rank of a layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from torch import nn


# the ops whose time the measured GEMM and attention rates hold, dispatch included (toolkit calibrate times them
# alone): every other op a step dispatches costs the host a fixed time each (Measured.seconds_per_op, on a CPU)
TIMED_AS_FLOPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"})


def timed_as_flops(op_name: str) -> bool:
    """Whether an aten op (its overload packet's name: "mm", "_scaled_dot_product_flash_attention_for_cpu") is
    priced by its FLOPs: the matmuls and attention's fused kernels, forward and backward."""
    return op_name in TIMED_AS_FLOPS or op_name.startswith(("_scaled_dot_product", "_flash_attention",
                                                            "_efficient_attention"))


def counted_op(func: Any) -> bool:
    """Whether a dispatched op (an OpOverload) costs the host a fixed time of its own: aten's ops that no FLOP rate
    times (fake tensors also dispatch prim's queries, a tensor's device, that a real run answers inline)."""
    return func.namespace == "aten" and not timed_as_flops(func.overloadpacket.__name__)


@dataclass(frozen=True, kw_only=True)
class ModelFlops:
    """Per token, forward + backward (3 × the forward: backward computes the gradients of inputs and weights)."""
    block_matmul: float  # the transformer blocks' matmuls: 6 × their weight elements (active experts only)
    head_matmul: float  # the output layer: 6 × hidden × vocab (an embedding lookup is not a matmul)
    attention: float  # scores and values: 12 × layers × hidden × sequence length (PaLM, appendix B)
    recompute: float  # activation checkpointing's forward of the blocks again: full, a third of their total;
    # selective, the forward of the matmuls it does not keep (toolkit/model/blocks.py selective_context)
    num_layers: int
    logits: int = 0  # what the loss reads per token: the output layer's vocabulary (a classifier's: none counted)

    @property
    def total(self) -> float:
        return self.block_matmul + self.head_matmul + self.attention + self.recompute

    @property
    def model_flops(self) -> float:
        """What MFU counts: the model's FLOPs, without the recompute (PaLM's definition)."""
        return self.block_matmul + self.head_matmul + self.attention


def model_flops(model: nn.Module, *, seq_len: int, checkpointing: str) -> ModelFlops:
    """Per-token training FLOPs of `model` (on the meta device) at `seq_len`; a mixture of experts counts the
    experts a token is routed to (top-k of them), not all. `checkpointing`: none | full | selective
    (TrainConfig.recompute)."""
    config: Any = model.config
    layers, hidden = config.num_hidden_layers, config.hidden_size
    blocks = _block_elements(model, config)
    head = head_elements(model)
    block_matmul, attention = 6.0 * blocks, 12.0 * layers * hidden * seq_len
    recompute = 0.0
    if checkpointing == "selective":
        recompute = 2.0 * _block_elements(model, config, recomputed=True)
    elif checkpointing == "full":
        recompute = (block_matmul + attention) / 3
    return ModelFlops(block_matmul=block_matmul, head_matmul=6.0 * head, attention=attention, recompute=recompute,
                      num_layers=layers, logits=logits_per_token(model))


def _block_elements(model: nn.Module, config: Any, *, recomputed: bool = False) -> float:
    """Weight elements of the blocks' matrices a token passes through: every 2-D+ weight in a block, the experts'
    scaled by top-k / experts (`recomputed`: those selective checkpointing recomputes)."""
    from toolkit.model.blocks import layer_stack

    return sum(block_elements(block, config, recomputed=recomputed) for block in layer_stack(model, guess=True))


def block_elements(block: nn.Module, config: Any, *, recomputed: bool = False) -> float:
    """One block's share of _block_elements. `recomputed`: only the matrices selective checkpointing does not keep
    the output of, the 2nd, 4th, ... in the order the block holds them: the order its forward runs them in for
    transformers' blocks (a Llama block: k, o, up of q k v o gate up down), checked against the FLOPs torch
    counts in a real backward (tests/test_selective_checkpointing.py); an estimate for experts, whose matmuls
    depend on the routing."""
    experts: int = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    top_k: int = getattr(config, "num_experts_per_tok", None) or 0
    total, matrices = 0.0, 0
    for name, param in block.named_parameters():
        if param.dim() < 2:
            continue
        matrices += 1
        if recomputed and matrices % 2:
            continue
        routed = bool(experts and top_k and ".experts." in f".{name}." and param.shape[0] == experts)
        total += param.numel() * (top_k / experts if routed else 1.0)
    return total


def head_elements(model: nn.Module) -> int:
    head = _output_layer(model)
    if head is not None:
        return cast(Any, head).weight.numel()
    return 0  # a classifier's head is a few numbers per token's class


def logits_per_token(model: nn.Module) -> int:
    """The rows of the model's output layer (a causal LM's vocabulary); 0 without one (a classifier)."""
    head = _output_layer(model)
    return int(cast(Any, head).weight.shape[0]) if head is not None else 0


def _output_layer(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def attention_heads(config: Any, *, tp: int = 1) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of one attention layer as a tensor-parallel rank of `tp` holds it."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads // tp, kv_heads // tp, head_dim
