"""How a CPU rank's process allocates its tensors (glibc's malloc), from `train.host_memory`.

- fast: no allocation gets pages of its own (M_MMAP_MAX 0) and the heap's top is not trimmed: a step's tensors
  reuse the pages the last step freed, with no page faults. Without it a tensor over glibc's mmap threshold
  (which rises as large blocks are freed, up to 32 MiB; the default MiniLM's 47 MB embedding gradient is always
  above it) is mapped, faulted in and zeroed page by page, and unmapped, every micro-batch. The default job
  (`benchmarks/peer_trainer.py`): 1.12× the Trainer against 0.98× with glibc's default and 0.63× with the
  threshold below. The resident set keeps its high-water mark and freed transients sit in heap holes: under
  sharding it is far above the plan (measured on the 302M model of `benchmarks/memory_scaling.py`, 2 ranks:
  fsdp +81/+111 %, fsdp+lora rank 1 +261 %; ddp +7.6 %).
- predictable: allocations of 64 KiB and more (tensors) get pages of their own, given back when freed, so the
  resident set follows the live tensors and its peak is what `toolkit plan` predicts (within ±15 % on that
  benchmark). glibc's own default is neither: its threshold rises after a large free, after which freed heap
  memory between kept tensors stays resident (fsdp +22 %, fsdp+lora rank 1 +54 %). At 1 MiB the heap still
  fragmented under the activations of short sequences (128 tokens × hidden 1024 in fp32: 512 KiB each): on the
  302M ddp benchmark freed heap memory grew by ~240 MiB over 4 steps; at 64 KiB it stays under 4 MiB. The cost is
  page faults on every such tensor: nothing measurable at 302M, the default MiniLM job at 0.6× of fast.
- auto: fast where even FAST_HEADROOM × the plan's peak fits the rank's share of host memory, else predictable.

A threshold the user set (MALLOC_MMAP_THRESHOLD_ or MALLOC_MMAP_MAX_) is kept; off Linux/glibc nothing
changes. GPU memory is the caching allocator's, untouched here."""

from __future__ import annotations

import ctypes
import os
import sys

MODES = ("auto", "fast", "predictable")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters
PREDICTABLE_MMAP_THRESHOLD = 64 << 10
FAST_TRIM_THRESHOLD = 2 ** 31 - 1  # mallopt takes an int: 2 GiB, a freed top of the heap stays for the next step
# fast's peak reached 3.6× the plan (fsdp+lora rank 1 above): auto takes it only with that much room
FAST_HEADROOM = 4


def choose(setting: str, *, predicted_peak_bytes: int | None, memory_per_rank_bytes: int) -> str:
    """The mode `setting` (a MODES entry) comes to; auto with no prediction is predictable."""
    if setting != "auto":
        return setting
    if predicted_peak_bytes is None:
        return "predictable"
    return "fast" if predicted_peak_bytes * FAST_HEADROOM <= memory_per_rank_bytes else "predictable"


def apply(mode: str) -> bool:
    """glibc's settings for `mode` (fast or predictable) in this process; True when set here."""
    if sys.platform != "linux" or {"MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_"} & os.environ.keys():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    if mode == "fast":
        return bool(mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, FAST_TRIM_THRESHOLD))
    assert mode == "predictable", mode
    return bool(mallopt(M_MMAP_THRESHOLD, PREDICTABLE_MMAP_THRESHOLD))
