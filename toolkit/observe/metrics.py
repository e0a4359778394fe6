"""Per-step metrics, memory readers and the JSONL writer (rank 0 writes, one flushed line per step)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from toolkit.process.stopping import nonfinite_value


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory: CUDA allocator peak on GPU, peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def process_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_reserved_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """(device type, address) of the storage behind `tensor` (a DTensor: this rank's shard): views of one
    buffer share it, so bytes counted per key count each buffer once."""
    local = getattr(tensor, "_local_tensor", tensor)
    return local.device.type, local.untyped_storage().data_ptr()


def _tensors_alive() -> list:
    """Every object the collector tracks whose class is a torch.Tensor class (Parameter, DTensor, subclasses), meta
    and fake ones (toolkit plan's activation trace, torch.compile's tracing) left out. Found by class, not isinstance:
    torch.Tensor's metaclass makes isinstance slow over the ~430k objects of a process with transformers loaded (a
    call took 0.21 s, by class 0.13 s, on every rank of every run), and a weak proxy (torch.compile keeps some) is not
    its tensor, which is among the objects itself."""
    import gc
    import itertools

    from torch._subclasses.fake_tensor import FakeTensor

    objects = gc.get_objects()
    classes = {kind for kind in set(map(type, objects)) if torch.Tensor in kind.__mro__}
    return [obj for obj in itertools.compress(objects, map(classes.__contains__, map(type, objects)))
            if not obj.is_meta and not isinstance(obj, FakeTensor)]


def live_tensor_storages() -> dict[tuple[str, int], tuple[int, str, int]]:
    """Every tensor storage Python can reach in this process: (device, address) -> (bytes, dtype, numel of the
    largest view seen). An independent count of what a strategy holds, read without asking it: tensors only
    C++ references (autograd's saved activations) are not seen, so call it between steps."""
    found: dict[tuple[str, int], tuple[int, str, int]] = {}
    for obj in _tensors_alive():
        local = getattr(obj, "_local_tensor", obj)  # DTensor: this rank's shard
        try:
            storage = local.untyped_storage()
            key = storage_key(local)
        except (RuntimeError, NotImplementedError):  # subclasses without real memory (torch.compile's fake tensors)
            continue
        if storage.nbytes():
            seen = found.get(key)
            if seen is None or local.numel() > seen[2]:
                found[key] = (storage.nbytes(), str(local.dtype).removeprefix("torch."), local.numel())
    return found


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (dynamo's own timers: frames and backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def compile_graph_breaks() -> dict[str, int]:
    """Graph breaks torch.compile has met in this process so far, by reason (dynamo's own counters). A break
    inside a block leaves the code around it eager: a compile that 'works' but makes nothing faster."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # device sync: step timings must include queued kernels


def measured_matmul_flops(shapes: list[tuple[int, int, int]], *, dtype: torch.dtype, repeats: int = 3) -> dict:
    """The CPU 'peak' MFU is taken against: the best FLOP/s over `shapes` (m, k, n) of `x @ w.T` (the way
    nn.Linear multiplies), best of `repeats` timings each, with this process's threads and dtype.

    A peak is an upper bound only if it is measured on the kernels the step runs: one square matmul
    can land on a slower path (bf16 without native support converts; small k under-fills the vector units)
    than the step's own shapes, and then MFU reads above 100 %. So the model's matmul shapes are included.
    """
    best_flops_per_s, best_shape = 0.0, shapes[0]
    # its own generator: drawn from torch's, the run's dropout masks depended on this measurement (and a resumed
    # run's, measured after its generator was restored, differed from the uninterrupted run's)
    numbers = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        x, w = (torch.randn(rows, k, dtype=dtype, generator=numbers) for rows in (m, n))
        torch.nn.functional.linear(x, w)  # warm-up: first call pays allocation and kernel selection
        fastest_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            fastest_s = min(fastest_s, time.perf_counter() - start)
        if 2 * m * k * n / fastest_s > best_flops_per_s:
            best_flops_per_s, best_shape = 2 * m * k * n / fastest_s, (m, k, n)
    return {"flops_per_s": best_flops_per_s, "shape": list(best_shape)}


NONFINITE_KEY = "nonfinite"  # where strict_json keeps what a null written for a non-finite number was


def strict_json(obj: dict) -> dict:
    """`obj` as JSON can hold it: every NaN or ±inf (at any depth) becomes null, and obj["nonfinite"] holds
    each where it stood, as text: {"loss": null, ..., "nonfinite": {"loss": "nan"}}; nested, the same shape
    ({"a": {"b": [1.0, null]}, "nonfinite": {"a": {"b": {"1": "inf"}}}}: a list's items by index). json.dumps
    would write bare NaN / Infinity tokens, which are no JSON: JSON.parse, jq and Python's parse_constant
    refuse them. restore_nonfinite puts the numbers back."""
    assert NONFINITE_KEY not in obj  # our own records never use the name
    clean, found = _finite(obj)
    return {**clean, NONFINITE_KEY: found} if found else clean


def _finite(value):
    """(value with null for each non-finite float, what those were in value's shape, or None if none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, repr(float(value))  # 'nan', 'inf', '-inf': float() reads each back
    if isinstance(value, dict):
        parts = {k: _finite(v) for k, v in value.items()}
        found = {str(k): f for k, (_, f) in parts.items() if f is not None}
        return {k: v for k, (v, _) in parts.items()}, found or None
    if isinstance(value, (list, tuple)):
        items = [_finite(v) for v in value]
        found = {str(i): f for i, (_, f) in enumerate(items) if f is not None}
        return [v for v, _ in items], found or None
    return value, None


def restore_nonfinite(obj):
    """A record strict_json wrote, with its non-finite numbers back in place of their nulls (and its
    "nonfinite" key gone); anything else as it is. An entry that names no null it can fill is left out."""
    if isinstance(obj, dict) and isinstance(obj.get(NONFINITE_KEY), dict):
        _restore(obj, obj.pop(NONFINITE_KEY))
    return obj


def _restore(holder, found: dict) -> None:
    for name, what in found.items():
        try:
            key = int(name) if isinstance(holder, list) else name
            if isinstance(what, dict):
                _restore(holder[key], what)
            elif holder[key] is None:
                holder[key] = float(what)
        except (KeyError, IndexError, TypeError, ValueError):  # written by hand, or cut: the null stays
            continue


def read_record(line: str):
    """One metrics.jsonl line as the loop wrote it: NaN and ±inf where it was not finite (ValueError: no JSON)."""
    return restore_nonfinite(json.loads(line))


def read_jsonl(path: Path) -> list:
    """Every record of a metrics.jsonl (read_record), blank lines left out."""
    return [read_record(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the step in flight. Strict JSON:
    a non-finite number is null, named in the line's "nonfinite" (strict_json)."""

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        self.file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        # every line was flushed when written: a close that fails is a write that failed already, which the loop
        # said (it would replace the run's own error with its OSError, in a traceback)
        with contextlib.suppress(OSError):
            self.file.close()


class Progress:
    """A tqdm bar on rank 0 (steps, loss, tokens/s); plain log lines when stderr is not a terminal. A step that
    made no update (an fp16 overflow, a non-finite step under train.on_nonfinite skip) says so, and gets its
    line whatever train.log_every: its loss and grad_norm are not those of a step that trained. A plain line also
    gives the time this process has trained and the time left (tqdm's bar shows its own): the rate is the wall
    clock per step since this process's first step, so evaluations and checkpoints count, the first step's warm-up
    does not."""

    def __init__(self, *, total: int, enabled: bool, log_every: int, clock=time.monotonic):
        self.enabled, self.log_every, self.total = enabled, log_every, total
        self.clock, self.started = clock, clock()
        self.first: tuple[int, float] | None = None  # (step, when) of this process's first step
        self.bar = None
        self.evaluation = ""  # the latest evaluation, until the next one
        self.loss_scale: float | None = None  # the fp16 loss scale after the latest step: the next one runs at it
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        skipped = skip_reason(record, scale_before=self.loss_scale)
        if record.get("loss_scale") is not None:
            self.loss_scale = record["loss_scale"]
        evaluated = record.get("eval_loss") is not None
        if evaluated:
            self.evaluation = " ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("eval_"))
        if self.bar is not None:
            self.bar.update(1)
            shown = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
            if self.evaluation:
                shown["eval"] = self.evaluation
            if skipped:
                shown["skipped"] = skipped
            self.bar.set_postfix(shown)
        elif evaluated or skipped or record["step"] % self.log_every == 0 or record["step"] == self.total:
            evaluation = f" {self.evaluation}" if evaluated else ""
            print(f"step {record['step']}/{self.total} loss {record['loss']:.4f}{evaluation} lr {record['lr']:.2e} "
                  f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} "
                  f"step {record['step_time_s'] * 1000:.0f} ms{self._clock(record['step'])}"
                  + (f" · skipped ({skipped})" if skipped else ""), file=sys.stderr, flush=True)
        if self.first is None:
            self.first = (record["step"], self.clock())

    def _clock(self, step: int) -> str:
        """' · H:MM:SS elapsed, ~H:MM:SS left' after this process's first step ('' at it)."""
        if self.first is None or step <= self.first[0]:
            return ""
        now = self.clock()
        left = (now - self.first[1]) / (step - self.first[0]) * (self.total - step)
        return f" · {_hms(now - self.started)} elapsed" + (f", ~{_hms(left)} left" if step < self.total else "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _hms(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def skip_reason(record: dict, *, scale_before: float | None) -> str:
    """Why a step made no update, for the progress line ('' when it made one): fp16 loss scaling's overflow
    with the scale it lowered (`scale_before`: the scale the step ran at, None when not known: a process's
    first step), or a non-finite loss or gradient norm that train.on_nonfinite skip dropped."""
    if not record.get("skipped"):
        return ""
    if record.get("skipped_nonfinite"):
        return f"non-finite {nonfinite_value(record)[0]}, train.on_nonfinite skip"
    after = record.get("loss_scale")
    if after is None:
        return "fp16 overflow"
    if scale_before is None:
        return f"fp16 overflow, loss scale now {after:g}"
    if scale_before == after:  # DeepSpeed's hysteresis (2 by default): an overflow that skips and keeps the scale
        return f"fp16 overflow, loss scale stays {after:g}"
    return f"fp16 overflow, loss scale {scale_before:g} → {after:g}"
