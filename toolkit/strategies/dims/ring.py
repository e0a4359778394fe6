"""Context parallel's ring method (`parallel.cp_method: ring`): each rank keeps its queries while the keys and values
travel round the cp ranks, one neighbour's block a step, and each block is attended by the device's fused kernel, the
partial outputs merged by their log-sum-exp. A rank holds two key/value blocks at a time, never the whole sequence's
(allgather holds every rank's, for each layer, until backward).

The algorithm is torch's own ring attention (`_templated_ring_attention` and its backward, what torch's
`context_parallel` runs), called here on the toolkit's split rather than through DTensor's dispatch: its load balance
is the toolkit's (rank r holds chunks r and 2·cp-1-r, dims/context.py), and it takes the kernel as an argument, which
lets it run on the CPU's flash kernel too (torch's dispatch knows CUDA's only). Its options are torch's globals, set
for each call: the keys and values pass to the next rank by an all-to-all each step (torch's default all-gathers them
once), the blocks merge in fp32.

What ring attends with is causal attention and nothing else: no padding mask (the toolkit pads on the right, where a
causal query never reaches a padding key; a row padded elsewhere is refused), no sliding window shorter than the
samples, no dropout, no logit soft-capping; each is refused in one line where a model or batch asks for it.

Kernels: the CPU's flash kernel (any float dtype, grouped-query heads natively); CUDA's flash kernel (bf16, fp16),
handed each block's keys and values repeated to the query heads, their gradients summed back. Under autocast the
queries, keys and values are cast to its dtype first, as autocast casts them for sdpa."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from toolkit.errors import RecipeError

SEQ_DIM = 2  # [batch, heads, tokens, head dim]
FIX = "use parallel.cp_method allgather"


@functools.cache
def _found() -> Any:
    """torch's ring attention module (its place moved in torch 2.9) where `usable`, else None; looked for once a
    process."""
    import importlib

    for place in ("torch.distributed.tensor.experimental._context_parallel._attention",
                  "torch.distributed.tensor.experimental._attention"):
        try:
            ring = importlib.import_module(place)
        except ImportError:
            continue
        return ring if usable(ring) else None
    return None


def _torch_ring() -> Any:
    """torch's ring attention module, or a RecipeError."""
    ring = _found()
    if ring is None:
        raise RecipeError(f"parallel.cp_method ring runs torch's ring attention, which torch {torch.__version__} "
                          f"does not have in the form the toolkit calls; {FIX}")
    return ring


def usable(ring: Any) -> bool:
    """Whether torch's ring module has what the toolkit calls, in the form it calls it: the templates taking a
    process group and the sequence dimension first (earlier torch versions took a device mesh), and the options."""
    import inspect

    for name in ("_templated_ring_attention", "_templated_ring_attention_backward"):
        function = getattr(ring, name, None)
        if function is None or list(inspect.signature(function).parameters)[:2] != ["group", "seq_dim"]:
            return False
    options = getattr(ring, "_cp_options", None)
    return hasattr(ring, "_RotateMethod") and all(
        hasattr(options, name) for name in ("enable_load_balance", "rotate_method", "convert_to_f32"))


def check_available() -> None:
    """A RecipeError where this torch has no ring attention (before any rank starts)."""
    _torch_ring()


@contextlib.contextmanager
def _options(ring: Any) -> Iterator[None]:
    """torch's ring options for one call: load balance on (the toolkit's chunks), keys and values passed to the next
    rank (all-to-all), blocks merged in fp32; torch's own values back after."""
    options = ring._cp_options
    before = (options.enable_load_balance, options.rotate_method, options.convert_to_f32)
    options.enable_load_balance, options.rotate_method, options.convert_to_f32 = (
        True, ring._RotateMethod.ALL_TO_ALL, True)
    try:
        yield
    finally:
        options.enable_load_balance, options.rotate_method, options.convert_to_f32 = before


@dataclass
class Kernel:
    """One device's fused attention: `forward(q, k, v, is_causal=, scale=)` -> (out, logsumexp, *rest) and
    `backward(grad_out=, query=, key=, value=, out=, logsumexp=, is_causal=, scale=)` -> (dq, dk, dv), as torch's
    ring templates call them. `expand`: keys and values repeated to the query heads for the kernel (one that takes
    no grouped-query heads), their gradients summed back to the key/value heads."""

    name: str
    expand: bool
    rest: tuple = ()  # CUDA flash's forward outputs beyond out and logsumexp, which its backward takes

    def _heads(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        if not self.expand or key.shape[1] == query.shape[1]:
            return key, value
        repeats = query.shape[1] // key.shape[1]
        return key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
                scale: float | None) -> tuple:
        aten = torch.ops.aten
        key, value = self._heads(query, key, value)
        if self.name == "cpu-flash":
            return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)
        out, lse, *rest = aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False,
                                                                   scale=scale)
        self.rest = tuple(rest)
        return (out, lse, *rest)

    def backward(self, *, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool, scale: float | None) -> tuple:
        aten = torch.ops.aten
        kv_heads = key.shape[1]
        key, value = self._heads(query, key, value)
        grad_out = grad_out.contiguous()
        if self.name == "cpu-flash":
            grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)
        else:
            cum_q, cum_k, _, _, seed, offset = self.rest[:6]
            grads = aten._scaled_dot_product_flash_attention_backward(
                grad_out, query, key, value, out, logsumexp, cum_q, cum_k, query.shape[2], key.shape[2], 0.0,
                is_causal, seed, offset, scale=scale)
        grad_query, grad_key, grad_value = grads[:3]
        if grad_key.shape[1] != kv_heads:  # summed in fp32 at least, as the ring accumulates them
            batch, heads, tokens, dim = grad_key.shape
            wide = torch.promote_types(grad_key.dtype, torch.float32)
            grad_key = grad_key.to(wide).view(batch, kv_heads, heads // kv_heads, tokens, dim).sum(2)
            grad_value = grad_value.to(wide).view(batch, kv_heads, heads // kv_heads, tokens, dim).sum(2)
        return grad_query, grad_key, grad_value


def kernel_for(query: torch.Tensor) -> Kernel:
    """The fused kernel for `query`'s device and dtype, or a RecipeError (one line) where there is none."""
    if query.device.type == "cpu":
        return Kernel(name="cpu-flash", expand=False)
    if query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16):
        capability, dim = torch.cuda.get_device_capability(query.device), query.shape[-1]
        if capability < (8, 0):
            raise RecipeError(f"parallel.cp_method ring attends with CUDA's flash kernel, which needs compute "
                              f"capability 8.0 or newer (Ampere); this GPU has {capability[0]}.{capability[1]}; {FIX}")
        if dim % 8 or dim > 256:
            raise RecipeError(f"parallel.cp_method ring attends with CUDA's flash kernel, which takes a head "
                              f"dimension that is a multiple of 8 up to 256; the model's is {dim}; {FIX}")
        return Kernel(name="cuda-flash", expand=True)
    if query.device.type == "cuda":
        raise RecipeError(f"parallel.cp_method ring attends with CUDA's flash kernel, which takes bf16 and fp16 only, "
                          f"not {str(query.dtype).removeprefix('torch.')}: set precision bf16, or {FIX}")
    raise RecipeError(f"parallel.cp_method ring attends with the flash kernels of the CPU and of CUDA, and this run's "
                      f"device is {query.device.type}; {FIX}")


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys and values, by torch's ring."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale):  # type: ignore[override]
        ring, kernel = _torch_ring(), kernel_for(query)
        with _options(ring):
            out, lse, *_ = ring._templated_ring_attention(group, SEQ_DIM, kernel.forward, query, key, value,
                                                          is_causal=True, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale, ctx.kernel = group, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        ring = _torch_ring()
        with _options(ring):
            grad_query, grad_key, grad_value, *_ = ring._templated_ring_attention_backward(
                ctx.group, SEQ_DIM, ctx.kernel.backward, grad_out, "grad_out", query, key, value, out, lse,
                is_causal=True, scale=ctx.scale)
        return grad_query, grad_key, grad_value, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, group: Any,
                   scale: float | None) -> torch.Tensor:
    """[batch, heads, local, dim] queries and [batch, kv heads, local, dim] keys and values of this rank's tokens
    (its two chunks) -> the output for its queries, [batch, heads, local, dim]."""
    if value.shape[-1] != query.shape[-1]:  # MLA (DeepSeek): the flash kernels take one head dimension
        raise RecipeError(f"parallel.cp_method ring attends with the flash kernel, which takes values of the queries' "
                          f"head dimension ({query.shape[-1]}); the model's values have {value.shape[-1]}; {FIX}")
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return _RingAttention.apply(query, key, value, group, scale)

