"""Hardware as data: one YAML profile per accelerator (toolkit/cost/profiles/), or a user's own file.

A profile holds what a datasheet states (peak dense FLOP/s per dtype, memory and its bandwidth, the links within and
between nodes, GPUs per node), each value with its source in a comment of the file; `toolkit calibrate` writes a
profile whose `measured:` section holds what it measured on the machine (matmul and attention FLOP/s, memory and
bus bandwidth), which the step-time model prefers where present.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.config.typed import from_plain
from toolkit.config.yaml_files import read_yaml_mapping
from toolkit.errors import RecipeError

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True, kw_only=True)
class PeakFlops:
    """Dense peak FLOP/s (no structured sparsity) per compute dtype; null where the device has no such unit."""
    bf16: float
    fp16: float
    fp32: float  # without TF32: torch's default for fp32 matmuls (torch.backends.cuda.matmul.allow_tf32 False)
    fp8: float | None = None


@dataclass(frozen=True, kw_only=True)
class Link:
    """One GPU's share of a link, in one direction, and the time a message takes to start on it."""
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What `toolkit calibrate` measured on the machine (absent fields: not measured)."""
    matmul_flops_per_s: float | None = None  # forward + backward over the model's GEMM shapes, FLOP-weighted
    matmul_dtype: str | None = None
    attention_flops_per_s: dict[str, float] | None = None  # sequence length (as text) -> FLOP/s, forward + backward
    memory_bandwidth_bytes_per_s: float | None = None  # a large copy: read + write bytes / s
    bus_bandwidth_bytes_per_s: float | None = None  # all-reduce bus bandwidth over the local ranks (nccl-tests' busbw)
    # each collective's own bus bandwidth by message size, where they differ (gloo: a reduce-scatter costs about two
    # all-reduces, and a 1 MiB bucket moves at a fraction of a 64 MiB one's rate): {kind: {bytes per call: bytes/s}}
    bus_bandwidth_by_kind: dict[str, dict[str, float]] | None = None
    bus_latency_s: float | None = None  # a small all-reduce's time
    # a causal LM's loss over its logits, forward + backward (the fp32 copy, log-softmax, its gradient), per logit:
    # memory-bound passes that a GEMM rate does not count (llama-tiny on one CPU thread: a tenth of its step)
    loss_seconds_per_logit: float | None = None
    # CPU: the host's time for each op a step dispatches outside its matmuls and attention kernels (Python,
    # autograd, the dispatcher, small kernels), measured on the model's first block (cost/op_cost.py)
    seconds_per_op: float | None = None
    num_ranks: int | None = None  # the ranks the bus was measured with
    threads: int | None = None  # CPU: the threads each rank computed with (cores / ranks)
    # CPU: the cores the compute rates above are a rank's on (calibrate.at_cores): its threads, or less where the
    # ranks' threads outnumber the machine's cores and time-share them (unset: the threads)
    cores: float | None = None


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    description: str = ""
    peak_flops_per_s: PeakFlops
    memory_bytes: float  # the accelerator's own memory (HBM); on the CPU profile, the host's
    memory_bandwidth_bytes_per_s: float
    intra_node: Link  # NVLink / NVSwitch / Infinity Fabric: between GPUs of one node
    inter_node: Link  # the network between nodes, per GPU
    host_link: Link  # PCIe to host memory (optimizer or parameter offload)
    gpus_per_node: int
    # achieved / dense peak FLOP/s of a training step's compute on this device, where no calibration measured it:
    # fitted on published runs by benchmarks/scale_prediction.py (unset: step_time.MATMUL_EFFICIENCY)
    compute_efficiency: float | None = None
    # whether collectives run beside compute: a GPU's have engines and SMs of their own; gloo on a CPU reduces on the
    # same cores the ranks compute on, so on it nothing hides (calibrate's cpu profile says false)
    overlaps_communication: bool = True
    measured: Measured = field(default_factory=Measured)

    @property
    def on_cpu(self) -> bool:
        """A profile toolkit calibrate measured on a CPU (its ranks' threads recorded)."""
        return self.measured.threads is not None

    def peak(self, dtype: str) -> float:
        value = getattr(self.peak_flops_per_s, dtype)
        if value is None:
            raise RecipeError(f"hardware {self.name}: no {dtype} peak in its profile (the device has no {dtype} "
                              "unit); choose another precision")
        return value


def known() -> list[str]:
    """The profiles the package ships, by name."""
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


def load(name_or_path: str) -> Hardware:
    """A shipped profile by name, or a profile file: a name that is neither, a file that is not a profile, or a
    value missing or not positive is one RecipeError naming the fix."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        if name_or_path not in known():
            raise RecipeError(f"--hardware {name_or_path}: no such profile; known: {', '.join(known())}, or a "
                              "profile file (toolkit calibrate writes one)")
        path = PROFILES / f"{name_or_path}.yaml"
    elif not path.is_file():
        raise RecipeError(f"--hardware {name_or_path}: no such file; known profiles: {', '.join(known())}")
    raw = read_yaml_mapping(path, what="hardware profile", holds="profile fields (name, peak_flops_per_s, ...)")
    try:
        profile = from_plain(Hardware, raw, "")
    except RecipeError as exc:  # its wording speaks of recipe keys: a profile's are keys of the file
        raise RecipeError(f"hardware profile {path}: {str(exc).replace('recipe key', 'key')}") from None
    _check_positive(profile, f"hardware profile {path}")
    _check_measured(profile.measured, f"hardware profile {path}")
    return profile


def _check_measured(measured: Measured, where: str) -> None:
    """The measured section's keys that a plan reads as numbers (sequence lengths, message sizes) are numbers, its
    collective kinds the cost model's and its matmul dtype a peak's."""
    from toolkit.cost.collectives import KINDS

    dtypes = [f.name for f in dataclasses.fields(PeakFlops)]
    if measured.matmul_dtype is not None and measured.matmul_dtype not in dtypes:
        raise RecipeError(f"{where}: measured.matmul_dtype is {measured.matmul_dtype!r}; give one of "
                          f"{', '.join(dtypes)}")
    kinds = sorted(set(KINDS.values()))
    sized = {"measured.attention_flops_per_s": measured.attention_flops_per_s or {}}
    for kind, rates in (measured.bus_bandwidth_by_kind or {}).items():
        if kind not in kinds:
            raise RecipeError(f"{where}: measured.bus_bandwidth_by_kind has {kind!r}; its kinds are "
                              f"{', '.join(kinds)}")
        sized[f"measured.bus_bandwidth_by_kind.{kind}"] = rates
    for key, rates in sized.items():
        for size in rates:
            try:
                number = float(size)
            except (TypeError, ValueError):
                number = math.nan
            if not (math.isfinite(number) and number > 0):
                raise RecipeError(f"{where}: {key} has the key {size!r}; its keys are sizes, positive numbers")


def _check_positive(value, where: str, key: str = "") -> None:
    """Every number of a profile is finite and above 0 (a zero bandwidth would predict an infinite step)."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _check_positive(getattr(value, f.name), where, f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_positive(v, where, f"{key}.{k}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise RecipeError(f"{where}: {key} is {value}; give a positive number")


def write(profile: Hardware, path: Path, *, header: str) -> None:
    """The profile as YAML, `header` as its leading comment (what wrote it, where, when)."""
    import yaml

    from toolkit.atomic import write_text_whole

    body = yaml.safe_dump(dataclasses.asdict(profile), sort_keys=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    write_text_whole(path, comment + body)
