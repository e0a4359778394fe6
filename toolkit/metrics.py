"""Per-step metrics, memory readers and the JSONL writer (rank 0 writes, one flushed line per step)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory: CUDA allocator peak on GPU, peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_reserved_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # device sync: step timings must include queued kernels


def measured_matmul_flops(*, dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best-of-N FLOP/s of a square matmul with this process's threads: the CPU 'peak' MFU is taken against."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: first call pays allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the step in flight."""

    def __init__(self, path: Path, *, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class Progress:
    """A tqdm bar on rank 0 (steps, loss, tokens/s); plain log lines when stderr is not a terminal."""

    def __init__(self, *, total: int, enabled: bool, log_every: int):
        self.enabled, self.log_every, self.total = enabled, log_every, total
        self.bar = None
        self.eval_loss: float | None = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        evaluated = record.get("eval_loss") is not None
        if evaluated:
            self.eval_loss = record["eval_loss"]
        if self.bar is not None:
            self.bar.update(1)
            shown = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
            if self.eval_loss is not None:  # the latest evaluation, until the next one
                shown["eval_loss"] = f"{self.eval_loss:.4f}"
            self.bar.set_postfix(shown)
        elif evaluated or record["step"] % self.log_every == 0 or record["step"] == self.total:
            evaluation = f" eval_loss {record['eval_loss']:.4f}" if evaluated else ""
            print(f"step {record['step']}/{self.total} loss {record['loss']:.4f}{evaluation} lr {record['lr']:.2e} "
                  f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} "
                  f"step {record['step_time_s'] * 1000:.0f} ms", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
