"""Did two arms compute the same thing? From per-step loss and grad-norm trajectories and final weights.

Tolerances come from the precision, not from a hand-picked number:
  fp32   loss: relative 1e-5 per step. grad norm: relative 1e-5 + 4·√N·2⁻²⁴ (clip_grad_norm_ reduces N
         squared fp32 values; its rounding error grows like √N·2⁻²⁴ and strategies sum in different
         orders). Final weights: |Δ| ≤ 1e-5 + 1e-5·|w| per element.
  bf16/fp16  calibrated: the reference strategy is run twice at that precision with different
         reduction orders (micro-batch split halved). Their per-step relative difference is pure
         rounding noise; the bound at step k is 4 × the largest calibration difference up to step k
         (one pair is one sample of that noise; ×4 covers its spread), never below the compute dtype's
         unit roundoff (bf16 2⁻⁸, fp16 2⁻¹¹).
Verdicts: "equivalent" (fp32 tolerance), "equivalent within precision noise" (calibrated bound),
"diverged at step k" (first step outside the bound), naming what differs between the two arms.
"""

from __future__ import annotations

import math
from pathlib import Path

FP32_RTOL = 1e-5
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24}
NOISE_FACTOR = 4.0
# keys expected to differ between arms of one experiment: not a cause
EXPECTED_DIFFERENT = ("output_dir", "strategy.", "batch.micro_batch_size", "batch.grad_accum_steps")


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def grad_norm_rtol(num_params: int) -> float:
    return FP32_RTOL + 4.0 * math.sqrt(num_params) * UNIT_ROUNDOFF["fp32"]


def noise_envelope(calib_a: list[dict], calib_b: list[dict], precision: str) -> list[float]:
    """Per-step bound from two reference runs that differ only in reduction order."""
    bound, worst = [], 0.0
    for a, b in zip(calib_a, calib_b):
        worst = max(worst, relative(a["loss"], b["loss"]), relative(a["grad_norm"], b["grad_norm"]))
        bound.append(max(NOISE_FACTOR * worst, UNIT_ROUNDOFF[precision]))
    return bound


def first_step_outside(arm: list[dict], ref: list[dict], *, loss_tol, norm_tol) -> int | None:
    """1-based step of the first loss/grad-norm outside tolerance (tol: float or per-step list)."""
    if len(arm) != len(ref):
        return min(len(arm), len(ref)) + 1
    for index, (a, r) in enumerate(zip(arm, ref)):
        lt = loss_tol[index] if isinstance(loss_tol, list) else loss_tol
        nt = norm_tol[index] if isinstance(norm_tol, list) else norm_tol
        if relative(a["loss"], r["loss"]) > lt or relative(a["grad_norm"], r["grad_norm"]) > nt:
            return a["step"]
    return None


def weights_close(arm_dir: Path, ref_dir: Path, *, rtol: float) -> tuple[bool, float]:
    """(all elements within |Δ| ≤ rtol + rtol·|w|, largest |Δ|) over the exported weights."""
    from safetensors.torch import load_file

    arm, ref = load_file(str(arm_dir / "model" / "model.safetensors")), load_file(str(ref_dir / "model" / "model.safetensors"))
    if arm.keys() != ref.keys():
        return False, float("inf")
    worst, ok = 0.0, True
    for key, want in ref.items():
        got, want = arm[key].double(), want.double()
        diff = (got - want).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        ok = ok and bool((diff <= rtol + rtol * want.abs()).all())
    return ok, worst


def setting_differences(arm: dict, ref: dict) -> list[str]:
    """Resolved-recipe keys and precision-audit rows that differ (strategy plumbing left out)."""
    out = []
    flat_a, flat_r = _flatten(arm["recipe"]), _flatten(ref["recipe"])
    for key in sorted(set(flat_a) | set(flat_r)):
        if key.startswith(EXPECTED_DIFFERENT) or key in EXPECTED_DIFFERENT:
            continue
        if flat_a.get(key) != flat_r.get(key):
            out.append(f"{key}: {flat_a.get(key)!r} vs {flat_r.get(key)!r}")
    audit_a, audit_r = arm.get("audit") or {}, ref.get("audit") or {}
    for row in sorted(set(audit_a) | set(audit_r)):
        key_a, key_r = audit_key(row, audit_a.get(row)), audit_key(row, audit_r.get(row))
        if key_a is not None and key_r is not None and key_a != key_r:
            out.append(f"audit {row}: {audit_a.get(row)} vs {audit_r.get(row)}")
    return out


def judge(arm: dict, ref: dict, *, envelope: list[float] | None) -> dict:
    """arm/ref: {"name", "dir", "metrics", "recipe", "audit", "precision", "num_params"}."""
    norm_tol = grad_norm_rtol(ref["num_params"])
    diffs = setting_differences(arm, ref)
    step = first_step_outside(arm["metrics"], ref["metrics"], loss_tol=FP32_RTOL, norm_tol=norm_tol)
    close, worst = weights_close(arm["dir"], ref["dir"], rtol=FP32_RTOL)
    if worst == float("inf"):
        diffs = [*diffs, "exported weights: the two model files hold different tensor names"]
    if step is None and close:
        return {"verdict": "equivalent", "step": None, "max_weight_diff": worst, "differences": diffs}
    if envelope is not None:
        noisy = first_step_outside(arm["metrics"], ref["metrics"], loss_tol=envelope,
                                   norm_tol=[max(e, norm_tol) for e in envelope])
        if noisy is None:
            return {"verdict": "equivalent within precision noise", "step": None, "max_weight_diff": worst,
                    "differences": diffs}
        step = noisy
    label = f"diverged at step {step}" if step is not None else "diverged in final weights"
    return {"verdict": label, "step": step, "max_weight_diff": worst, "differences": diffs}


def audit_key(row: str, value) -> str | None:
    """What of an audit cell must match between arms: for the reduction its dtype (the collective itself
    is the strategy's plumbing), elsewhere the cell without its parenthesised detail (stage, device)."""
    if not isinstance(value, str):
        return value
    if row == "grad_reduction":
        return value[value.rfind("(") + 1:-1] if value.endswith(")") and "one process" not in value else None
    return value.split(" (")[0]


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "config":
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out
