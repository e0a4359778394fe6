"""`toolkit calibrate --hardware NAME`: measure on this machine what a profile can only estimate, and write a profile
whose `measured:` section the step-time model prefers: matmul FLOP/s on the model's GEMM shapes, attention FLOP/s
per sequence length, memory bandwidth and, for `--hardware cpu`, each collective's bus bandwidth between local gloo
ranks (nccl-tests' busbw). On a GPU machine the named profile's datasheet values stay beside what was measured
(matmul, attention, memory; its links stay the datasheet's: one lent GPU has no bus to measure).

Each rank of a multi-process CPU run gets cores / ranks threads (the launcher's OMP_NUM_THREADS), so the matmul and
attention rates are measured at the threads a rank of `--nproc` ranks has; where the ranks outnumber the cores (4
ranks of 1 thread on 2 cores) they time-share them, and the rates are those of the rank's share (at_cores).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit.cost.flops import attention_heads, logits_per_token
from toolkit.cost.hardware import Hardware, Link, Measured, PeakFlops, load, write
from toolkit.cost.op_cost import seconds_per_op
from toolkit.cost.timing import median_seconds
from toolkit.model.precision import dtype_name

ATTENTION_LENGTHS = (64, 256, 1024)
GPU_ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192)  # on a GPU, each at the micro-batch's tokens (batch × length)
GPU_BURST = 10  # on a GPU, calls timed back to back between two synchronisations, as a step queues its kernels


class MeasurementFailed(RuntimeError):
    """A process measuring this machine ended without its result (killed: out of memory; or an error in it): the
    message names which measurement and how it ended, in one line."""


def _burst_seconds(run, *, size_bytes: int, bursts: int = 3) -> float:
    """A collective's time per call as a step pays it: back to back, summed. gloo's calls on a shared CPU vary
    several-fold (measured at 1 MiB: 0.4-3.8 ms medians of 9 single calls, a scheduler tick more or less each), and
    a step issuing 80 of them pays their mean: each burst's mean per call (10 calls up to 1 MiB, fewer above), the
    median of `bursts` bursts."""
    calls = max(2, min(10, 2 ** 24 // size_bytes))

    def burst() -> None:
        for _ in range(calls):
            run()
    return median_seconds(burst, bursts) / calls  # after a burst's warm-up


MAX_ROWS = 2048  # a GEMM's rows measured: a longer micro-batch runs at the same rate, and takes minutes on a CPU
CPU_SHAPE_FLOPS = 2e11  # on a CPU, shapes of more FLOPs a pass are left out (a large head: seconds each)


def gemm_shapes(model: nn.Module | None, tokens: int, *, device: torch.device) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's distinct linear layers for `tokens` rows (at most MAX_ROWS), the 6 of most FLOPs (on
    a CPU those under CPU_SHAPE_FLOPS), or two square ones without a model."""
    rows = min(tokens, MAX_ROWS)
    if model is None:
        return [(rows, 1024, 1024), (rows, 4096, 1024)]
    shapes = {(rows, m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    kept = [s for s in shapes if device.type != "cpu" or 6 * s[0] * s[1] * s[2] <= CPU_SHAPE_FLOPS] or \
        [min(shapes, key=lambda s: s[1] * s[2])]
    return sorted(kept, key=lambda s: s[1] * s[2], reverse=True)[:6]


def gemm_counts(model: nn.Module | None, tokens: int) -> dict[tuple[int, int, int], int]:
    """(m, k, n) of each of the model's linear layers for `tokens` rows, with how many layers have it: on a GPU every
    shape is measured at the micro-batch's rows and weighted as a step spends its FLOPs. Distinct shapes weighted
    alike (gemm_shapes) let a 1B Llama's one head outweigh its 154 block GEMMs: its 30,522-token vocabulary, no
    multiple of 8, runs an older, slower kernel (3.7 ms a call on an H200, about 270 TFLOP/s, against about 780 for
    the blocks' GEMMs in the same profile), and calibrate wrote 271 TFLOP/s for a model whose GEMMs ran at ~700."""
    if model is None:
        return {(tokens, 4096, 4096): 1, (tokens, 4096, 14336): 1}
    counts: dict[tuple[int, int, int], int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            shape = (tokens, module.in_features, module.out_features)
            counts[shape] = counts.get(shape, 0) + 1
    return counts


def matmul_flops_per_s(shapes: list[tuple[int, int, int]] | dict[tuple[int, int, int], int], dtype: torch.dtype,
                       device: torch.device) -> float:
    """Forward and backward of x @ w.T over the shapes, FLOP-weighted: 6·m·k·n per shape over their total time, each
    shape counted as often as `shapes` says where it is a dict of counts (gemm_counts). The output's gradient is a
    dense tensor, as a layer's is in training (a `.sum()`'s is one value broadcast with stride 0, which the
    weight-gradient GEMM reads more slowly: llama-tiny's 168-row MLP shapes measured at 58 against 62-74 GFLOP/s on
    one thread here). On a GPU the calls are timed GPU_BURST at a time, back to back as a step issues them: one
    synchronisation each costs more than a block's small GEMMs (a 12 µs one at 8,192 rows on an H200)."""
    counts = shapes if isinstance(shapes, dict) else {shape: 1 for shape in shapes}
    calls = GPU_BURST if device.type == "cuda" else 1
    flops = seconds = 0.0
    for (m, k, n), count in counts.items():
        x = torch.randn(m, k, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(n, k, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn(m, n, dtype=dtype, device=device)

        def step() -> None:
            for _ in range(calls):
                x.grad = w.grad = None  # one gradient each, as in a step, not one added to another's
                torch.nn.functional.linear(x, w).backward(grad)
            _sync(device)
        seconds += count * median_seconds(step) / calls
        flops += count * 6 * m * k * n
    return flops / seconds


def attention_flops_per_s(*, heads: int, head_dim: int, batch: int, dtype: torch.dtype,
                          device: torch.device, tokens: int | None = None) -> dict[str, float]:
    """Causal scaled-dot-product attention, forward and backward, at each of ATTENTION_LENGTHS: FLOPs counted as the
    model's (12 · batch · length² · heads · head_dim, PaLM's, no causal halving) over the time. With `tokens` (a
    GPU's micro-batch), at each of GPU_ATTENTION_LENGTHS up to it with that many tokens (batch = tokens / length),
    timed GPU_BURST calls at a time: one sequence of 1,024 tokens or fewer, synchronised each call, measured the
    launches (36 TFLOP/s at 1,024 on an H200, whose step ran its attention at ~190)."""
    out = {}
    calls = GPU_BURST if tokens is not None else 1
    lengths = ATTENTION_LENGTHS if tokens is None else \
        [n for n in GPU_ATTENTION_LENGTHS if n <= tokens] or GPU_ATTENTION_LENGTHS[:1]
    for length in lengths:
        rows = max(1, tokens // length) if tokens is not None else batch
        q, k, v = (torch.randn(rows, heads, length, head_dim, dtype=dtype, device=device, requires_grad=True)
                   for _ in range(3))

        def step() -> None:
            for _ in range(calls):
                if tokens is not None:  # one gradient each, as in a step (a CPU profile's rates keep their sums)
                    q.grad = k.grad = v.grad = None
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            _sync(device)
        out[str(length)] = 12 * rows * length ** 2 * heads * head_dim * calls / median_seconds(step)
    return out


LOSS_LOGITS = 2 ** 24  # logits of the loss timed (64 MiB in fp32): a micro-batch's head at CPU speed


def loss_seconds_per_logit(vocab: int, *, dtype: torch.dtype, device: torch.device) -> float:
    """A causal LM's loss as the loop computes it (data/losses.py: logits in the compute dtype, made fp32, summed
    cross-entropy), forward and backward, per logit: the rows of LOSS_LOGITS logits over `vocab` tokens."""
    rows = max(1, LOSS_LOGITS // vocab)
    logits = torch.randn(rows, vocab, dtype=dtype, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device=device)

    def step() -> None:
        logits.grad = None  # the loop's logits get one gradient, not one added to another's
        torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").backward()
        _sync(device)
    return median_seconds(step) / (rows * vocab)


def memory_bandwidth(device: torch.device, *, size_bytes: int = 256 * 2 ** 20) -> float:
    """A large copy: bytes read and written per second."""
    source = torch.empty(size_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)

    def copy() -> None:
        target.copy_(source)
        _sync(device)
    return 2 * size_bytes / median_seconds(copy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BUS_SIZES = (128 * 2 ** 10, 2 ** 20, 64 * 2 ** 20)  # the message sizes each collective's bus bandwidth is measured at


def bus_bandwidth(nproc: int) -> tuple[dict[str, dict[str, float]], float]:
    """({collective kind: {bytes per call: bus bytes/s}}, seconds of a small all-reduce's ring step) over `nproc`
    local CPU ranks on gloo. Bus bandwidth as nccl-tests defines it, so that the ring model's bytes over it give the
    time: an all-reduce moves 2(n-1)/n of its payload, a reduce-scatter and an all-gather (n-1)/n of the whole."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with mp.get_context("spawn").Manager() as manager:  # the ranks' results, back to this process
        results = manager.dict()
        try:
            mp.spawn(_bus_rank, args=(nproc, _free_port(), results), nprocs=nproc, join=True)
        except ProcessException as exc:  # a rank killed or raising: its first line, not its traceback
            cause = _last_line(str(exc)) if isinstance(exc, mp.ProcessRaisedException) else str(exc)
            raise MeasurementFailed(f"measuring gloo's bus between {nproc} ranks failed: {cause}") from exc
        return dict(results["busbw"]), results["latency"]


def _last_line(text: str) -> str:
    """A traceback's last line: the error it ended in."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bus_rank(rank: int, nproc: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    try:
        busbw: dict[str, dict[str, float]] = {"all_reduce": {}, "reduce_scatter": {}, "all_gather": {}}
        for size_bytes in BUS_SIZES:
            numel = size_bytes // 4 // nproc * nproc
            big, part = torch.ones(numel), torch.empty(numel // nproc)
            moved = (nproc - 1) / nproc * numel * 4
            key = str(numel * 4)  # an all-reduce's and a reduce-scatter's payload; an all-gather's is its shard's
            timed = functools.partial(_burst_seconds, size_bytes=numel * 4)
            busbw["all_reduce"][key] = 2 * moved / timed(lambda: dist.all_reduce(big))
            busbw["reduce_scatter"][key] = moved / timed(lambda: dist.reduce_scatter_single(part, big))
            busbw["all_gather"][str(numel // nproc * 4)] = moved / timed(lambda: dist.all_gather_single(big, part))
        latency = median_seconds(lambda: dist.all_reduce(torch.ones(8)), repeats=20)
        if rank == 0:
            results["busbw"] = busbw
            results["latency"] = latency / (2 * (nproc - 1))  # a step of the ring
    finally:
        dist.destroy_process_group()


def _attention_shape(model: nn.Module | None, *, default: tuple[int, int]) -> tuple[int, int]:
    """(heads, head dim) of the model's attention, or `default` without a model."""
    if model is None:
        return default
    heads, _, head_dim = attention_heads(model.config)
    return heads, head_dim


def _vocab(model: nn.Module | None) -> int:
    """The logits per token of the model's output layer; a Llama 3 vocabulary without a model or one."""
    return (logits_per_token(model) if model is not None else 0) or 128256


def cpu_profile(*, nproc: int, model: nn.Module | None, tokens: int, dtype: torch.dtype) -> Hardware:
    """This machine's CPU as a profile, every value measured: its matmul rate as the peak (a rank of `nproc`
    ranks' threads), host memory and its bandwidth, a causal LM's loss per logit, the host's time per dispatched op
    (on the model's first block: op_cost.seconds_per_op), gloo's bus between local ranks (one node). A GPU profile
    measures no loss and no op: its fitted efficiency covers a step's work outside the GEMMs.

    The compute rates are measured in a process of their own (measure_cpu_rates), as a rank's are; the op's time
    here (a block at a few tokens: no tensor the allocator setting changes)."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // nproc)
    heads, head_dim = _attention_shape(model, default=(8, 64))
    rates = measure_cpu_rates(threads=threads, shapes=gemm_shapes(model, tokens, device=torch.device("cpu")),
                              heads=heads, head_dim=head_dim, batch=max(1, tokens // 1024), vocab=_vocab(model),
                              dtype=dtype)
    matmul, attention, memory, loss = rates.matmul, rates.attention, rates.memory, rates.loss
    per_op = seconds_per_op(model, dtype=dtype, threads=threads) if model is not None else None
    by_kind, latency = bus_bandwidth(nproc) if nproc > 1 else ({"all_reduce": {str(BUS_SIZES[-1]): memory}}, 1e-6)
    busbw = max(by_kind["all_reduce"].values())
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = Link(bandwidth_bytes_per_s=busbw, latency_s=latency)
    name = dtype_name(dtype)
    share = rank_cores(threads, world=nproc, cores=cores)
    shared = f" (the ranks share the cores: {share:g} of one each)" if share < threads else ""
    allocator = ", measured with host memory fast" if rates.fast else ""
    description = f"this machine's CPU: {cores} cores, {threads} thread(s) a rank of {nproc}{shared}{allocator}"
    profile = Hardware(name="cpu", description=description,
                    peak_flops_per_s=PeakFlops(bf16=matmul, fp16=matmul, fp32=matmul),
                    memory_bytes=total / nproc, memory_bandwidth_bytes_per_s=memory, intra_node=link, inter_node=link,
                    host_link=Link(bandwidth_bytes_per_s=memory, latency_s=1e-6), gpus_per_node=nproc,
                    compute_efficiency=1.0, overlaps_communication=False,
                    measured=Measured(matmul_flops_per_s=matmul, matmul_dtype=name, attention_flops_per_s=attention,
                                      memory_bandwidth_bytes_per_s=memory, bus_bandwidth_bytes_per_s=busbw,
                                      bus_bandwidth_by_kind=by_kind,
                                      bus_latency_s=latency, num_ranks=nproc, threads=threads,
                                      loss_seconds_per_logit=loss, seconds_per_op=per_op))
    return at_cores(profile, share)


@dataclasses.dataclass(frozen=True)
class CpuRates:
    """What one CPU process measured at a rank's threads (cpu_profile's compute side)."""
    matmul: float  # FLOP/s over the model's GEMM shapes, forward and backward
    attention: dict[str, float]  # FLOP/s per sequence length (ATTENTION_LENGTHS)
    memory: float  # bytes/s of a large copy
    loss: float  # seconds per logit of a causal LM's loss, forward and backward
    fast: bool  # measured with train.host_memory fast's allocator (False: the user's MALLOC_ settings ruled)


def measure_cpu_rates(*, threads: int, shapes: list[tuple[int, int, int]], heads: int, head_dim: int, batch: int,
                      vocab: int, dtype: torch.dtype) -> CpuRates:
    """The compute rates of a CPU rank of `threads` threads, measured in a spawned process with the allocator a
    rank runs with (train.host_memory fast, what auto takes where the plan fits: toolkit/process/host_memory.py).
    In the calling process's glibc default every tensor above the mmap threshold (the loss's 64 MiB of logits) is
    faulted in and zeroed page by page, which no rank pays: the loss measured 6.6-8.4 ns a logit on one thread here
    against 1.8-2.3 in fast, and a compare's single arm was predicted +58 % over its measured step with the former.
    A process of its own leaves the caller's allocator as it was."""
    import concurrent.futures
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    try:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_cpu_rates, threads=threads, shapes=shapes, heads=heads, head_dim=head_dim,
                               batch=batch, vocab=vocab, dtype=dtype).result()
    except BrokenProcessPool as exc:
        raise MeasurementFailed("measuring the CPU's compute rates failed: the process measuring them ended "
                                "without a result (killed: out of memory?)") from exc
    except (RuntimeError, MemoryError, OSError) as exc:  # raised in that process: its message, not its traceback
        raise MeasurementFailed(f"measuring the CPU's compute rates failed: {type(exc).__name__}: "
                                f"{_last_line(str(exc))}") from exc


def _cpu_rates(*, threads: int, shapes: list[tuple[int, int, int]], heads: int, head_dim: int, batch: int,
               vocab: int, dtype: torch.dtype) -> CpuRates:
    from toolkit.process import host_memory

    fast = host_memory.apply("fast")
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    return CpuRates(matmul=matmul_flops_per_s(shapes, dtype, device),
                    attention=attention_flops_per_s(heads=heads, head_dim=head_dim, batch=batch, dtype=dtype,
                                                    device=device),
                    memory=memory_bandwidth(device), loss=loss_seconds_per_logit(vocab, dtype=dtype, device=device),
                    fast=fast)


def rank_cores(threads: int, *, world: int, cores: int) -> float:
    """The cores one rank of `world` computes on: its threads, or its share of the cores where the ranks' threads
    outnumber them (4 ranks of 1 thread on 2 cores time-share them: half a core each)."""
    return min(float(threads), cores / world)


def at_cores(profile: Hardware, cores: float) -> Hardware:
    """A CPU profile's compute rates for a rank on `cores` cores, from those measured at the profile's own (its
    `measured.cores`, else its threads: measured in one process alone, on whole cores): the matmul rate (the peak
    too, which caps it in step_time) and attention's in proportion, the loss's time per logit inversely. Memory
    bandwidth and the bus stay as measured. An op's host time is one thread's: it grows where the rank has less
    than a core (time-shared), and does not shrink with more."""
    measured = profile.measured
    now = measured.cores or measured.threads
    if not now or cores == now:
        return profile
    scale = cores / now
    peak = profile.peak_flops_per_s
    rates = {k: v * scale for k, v in (measured.attention_flops_per_s or {}).items()} or None
    return dataclasses.replace(
        profile,
        peak_flops_per_s=dataclasses.replace(peak, bf16=peak.bf16 * scale, fp16=peak.fp16 * scale,
                                             fp32=peak.fp32 * scale,
                                             fp8=peak.fp8 * scale if peak.fp8 is not None else None),
        measured=dataclasses.replace(
            measured, cores=cores, attention_flops_per_s=rates,
            matmul_flops_per_s=measured.matmul_flops_per_s * scale if measured.matmul_flops_per_s else None,
            loss_seconds_per_logit=(measured.loss_seconds_per_logit / scale if measured.loss_seconds_per_logit
                                    else None),
            seconds_per_op=(measured.seconds_per_op * min(now, 1.0) / min(cores, 1.0) if measured.seconds_per_op
                            else None)))


PROFILE_CACHE_VERSION = 5  # raise when what cpu_profile measures changes: older cached profiles are not read
PROFILE_CACHE_MAX_AGE_S = 24 * 3600  # a profile measured longer ago is measured again


def cached_cpu_profile(*, nproc: int, model: nn.Module | None, tokens: int,
                       dtype: torch.dtype) -> tuple[Hardware, float] | None:
    """(the profile, when it was measured) this machine measured for the same shapes, ranks, threads and dtype
    within PROFILE_CACHE_MAX_AGE_S (the user's cache, calibration/; the CPU's model, flags, cores and memory and
    torch's version in the key), or None: measure it (kept_cpu_profile). Measuring costs a compare ~10 s at its
    end (gloo's bus between spawned ranks, mostly starting them), every time."""
    from toolkit.errors import RecipeError

    try:  # no home to find, none cached yet, or a file that is not a whole profile: measure
        path = _profile_path(nproc=nproc, model=model, tokens=tokens, dtype=dtype)
        measured_at = path.stat().st_mtime
        if 0 <= time.time() - measured_at < PROFILE_CACHE_MAX_AGE_S:
            return load(str(path)), measured_at
    except (OSError, RuntimeError, RecipeError):
        pass
    return None


def kept_cpu_profile(*, nproc: int, model: nn.Module | None, tokens: int, dtype: torch.dtype) -> Hardware:
    """cpu_profile's, measured now and kept in the user's cache for cached_cpu_profile (where it can be)."""
    profile = cpu_profile(nproc=nproc, model=model, tokens=tokens, dtype=dtype)
    try:
        path = _profile_path(nproc=nproc, model=model, tokens=tokens, dtype=dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        write(profile, path, header="measured by toolkit compare (toolkit calibrate --hardware cpu's way), kept for "
                                    "later compares of the same shapes on this machine")
    except (OSError, RuntimeError):
        pass
    return profile


def _profile_path(*, nproc: int, model: nn.Module | None, tokens: int, dtype: torch.dtype) -> Path:
    from toolkit.atomic import cache_dir

    return cache_dir("calibration") / f"{_profile_key(nproc=nproc, model=model, tokens=tokens, dtype=dtype)}.yaml"


def _profile_key(*, nproc: int, model: nn.Module | None, tokens: int, dtype: torch.dtype) -> str:
    """Everything cpu_profile's numbers depend on: this machine (its CPU's model and flags, cores, memory), torch's
    version, the ranks and so threads a rank, the dtype, and the shapes measured (GEMMs, attention, vocabulary)
    and the model's class (its block's ops)."""
    import hashlib
    import json

    try:
        with open("/proc/cpuinfo") as handle:
            cpu = sorted({line.strip() for line in handle if line.startswith(("model name", "flags"))})
    except OSError:
        cpu = []
    device = torch.device("cpu")
    parts = [PROFILE_CACHE_VERSION, cpu, os.cpu_count(), os.sysconf("SC_PHYS_PAGES"), torch.__version__, nproc,
             str(dtype), tokens, gemm_shapes(model, tokens, device=device), _attention_shape(model, default=(8, 64)),
             _vocab(model), type(model).__name__ if model is not None else None]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def gpu_profile(base: Hardware, *, nproc: int, model: nn.Module | None, tokens: int, dtype: torch.dtype) -> Hardware:
    """`base` (a datasheet profile) with what this GPU machine measured."""
    device = torch.device("cuda")
    heads, head_dim = _attention_shape(model, default=(32, 128))
    measured = Measured(matmul_flops_per_s=matmul_flops_per_s(gemm_counts(model, tokens), dtype, device),
                        matmul_dtype=dtype_name(dtype),
                        attention_flops_per_s=attention_flops_per_s(heads=heads, head_dim=head_dim, batch=1,
                                                                    dtype=dtype, device=device, tokens=tokens),
                        memory_bandwidth_bytes_per_s=memory_bandwidth(device, size_bytes=2 ** 30))
    return dataclasses.replace(base, measured=measured)
