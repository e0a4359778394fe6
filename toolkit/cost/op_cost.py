"""A dispatched op's fixed cost on the host: what a CPU step spends beside its FLOPs.

An eager step dispatches every op from Python through autograd and torch's dispatcher: a few microseconds each
before any arithmetic. At small shapes that is most of a step: llama-tiny at 12 blocks, micro 2 × ~20 tokens,
spends 55 of a micro-batch's 113 ms outside its matmuls, in ~2,400 ops (23 µs each on average), which a FLOP rate
does not see (the plan predicted single at −50 % of its measured step there). `seconds_per_op` measures that cost
on the model's own first block (its Python, its kernels) at a few tokens, where the arithmetic is a small part of
it: 15-19 µs for llama-tiny's block, below the whole model's average, whose few ops outside the blocks (the
embedding's dense gradient, a tied weight's two gradients summed) move whole vocabulary-sized tensors. `toolkit
plan` charges it for each op the activation trace counts (memory/activations.py traced_ops) on a CPU profile. The
probe's block carries no LoRA adapters (a LoRA run's ops are counted with them, each at the plain block's cost).
On a GPU the host runs ahead of the device and this cost hides behind the kernels, until it does not (small
models, small batches): not measured there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.checkpoint.loading import materialize
from toolkit.cost.flops import counted_op
from toolkit.cost.timing import median_seconds
from toolkit.model.blocks import layer_stack
from toolkit.model.stages import Stage

PROBE_TOKENS = 16  # the probe's sequence: one sample this long keeps its matmuls a small part of its time
PROBE_REPEATS = 20


def probe_stage(model: nn.Module, *, layer_ids: list[int], last: bool, head_rows: tuple[int, int] | None,
                device: torch.device, dtype: torch.dtype, dropout: float | None, blocks: tuple[str, ...] | None,
                autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> Stage:
    """A stage of a fresh model of `model`'s class built from its config (no weights copied): `layer_ids` of its
    blocks, the head (its `head_rows`) when `last`; random weights in `dtype`, `dropout` where given (None: the
    model's own), on `device`, in training mode. Transient: a probe, built and let go before a run builds its
    model."""
    from accelerate import init_empty_weights

    from toolkit.model.build import set_dropout

    with init_empty_weights(include_buffers=False):  # rotary inv_freq and such: computed, in no weight file
        fresh = type(model)(model.config)
    if dropout is not None:
        set_dropout(fresh, dropout)
    stage = Stage(fresh, layer_ids=layer_ids, first=False, last=last, autocast=autocast, blocks=blocks,
                  head_rows=head_rows)
    materialize(stage, device=device)
    with torch.no_grad():
        for param in stage.parameters():
            param.data = param.data.to(dtype).normal_(0.0, 0.02)
    return stage.train()


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it that no FLOP rate times (as memory/activations.py LiveBytes) and
    keeps the calls of those that one does, to be timed again alone."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.timed: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if counted_op(func):
            self.ops += 1
        elif func.namespace == "aten":  # a matmul or attention kernel
            self.timed.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))

    def timed_s(self) -> float:
        """The median time of the kept matmul and attention calls, run again alone (their inputs kept)."""
        def replay() -> None:
            for func, args, kwargs in self.timed:
                func(*args, **kwargs)
        return median_seconds(replay, PROBE_REPEATS, warm=False)  # each ran once already, in the probe


def seconds_per_op(model: nn.Module, *, dtype: torch.dtype, threads: int) -> float | None:
    """The host's time per op outside the matmuls and attention kernels, on `threads` threads: the model's first
    block, forward and backward on one sample of PROBE_TOKENS, its median time less that of its matmul and
    attention calls run again alone, over the other ops it dispatched. None (no charge: the plan as before) for a
    model with no layer stack to probe, one whose block the probe cannot run alone, or a block so wide that its
    matmuls take over half the probe's time (what is left is then too small a difference of two large times to
    read an op's cost from)."""
    try:
        layer_stack(model, guess=True)
        hidden = int(getattr(model.config, "hidden_size"))
        stage = probe_stage(model, layer_ids=[0], last=False, head_rows=None, device=torch.device("cpu"),
                            dtype=dtype, dropout=0.0, blocks=None)
    except Exception:  # a model the pipeline's stages do not cut: no probe, no charge
        return None
    x = torch.randn(1, PROBE_TOKENS, hidden, dtype=dtype)
    mask = torch.ones(1, PROBE_TOKENS, dtype=torch.long)

    def step() -> None:
        inputs = x.detach().requires_grad_()
        out = stage(inputs, attention_mask=mask)
        out.backward(torch.ones_like(out))

    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step()  # warm: the first call builds caches
        with _OpCounter() as counter:
            step()
        whole_s = median_seconds(step, PROBE_REPEATS, warm=False)  # warmed above
        flops_s = counter.timed_s()
    except Exception:
        return None
    finally:
        torch.set_num_threads(kept)
    if not counter.ops or flops_s > whole_s / 2:
        return None
    return (whole_s - flops_s) / counter.ops

