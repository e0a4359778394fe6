"""Did two arms compute the same thing? From per-step loss and grad-norm trajectories and final weights.

Tolerances come from the precision, not from a hand-picked number:
  fp32   loss: relative 1e-5 per step. grad norm: relative 1e-5 + 4·√N·2⁻²⁴ (clip_grad_norm_ reduces N
         squared fp32 values; its rounding error grows like √N·2⁻²⁴ and strategies sum in different
         orders). Final weights: |Δ| ≤ 1e-5 + 1e-5·|w| per element, except noise-driven tensors (below).
  bf16/fp16  calibrated: the reference strategy is run twice at that precision with different
         reduction orders (micro-batch split halved). Their per-step relative difference is pure
         rounding noise; the bound at step k is 4 × the largest calibration difference up to step k
         (one pair is one sample of that noise; ×4 covers its spread), never below the compute dtype's
         unit roundoff (bf16 2⁻⁸, fp16 2⁻¹¹).
Noise-driven weights: a tensor whose gradient, in every step of the reference run, is no larger than
  2⁻²⁴ × that step's global gradient norm (max |g| ≤ u·‖g‖, u the fp32 unit roundoff) is moved by
  rounding noise alone; its exact gradient is zero by construction (an attention key bias: softmax
  ignores a constant added to every score of a query). Adam turns that noise into steps of ~lr with
  random sign, which follow the strategy's summation order, not the maths: such tensors are listed
  with their |Δ| and not judged. The reference arm records the gradient scale (run.json).
Rounding reference: fp32 bounds alone can be flipped by rounding: single vs tp on a 4-block Qwen2 (hidden 256,
  4 steps at lr 1e-3) "diverged in final weights" on 2 of 3 seeds by the fixed bound alone (one element of a
  v_proj or o_proj, |Δ| 1.2-1.7e-5), and the same run started from weights × (1 + 1e-7·N(0,1)) moved weights by
  up to 2.5e-5-1.1e-4 (docs/compare.md). So compare runs the reference once more from such a start (train.init_perturbation 1e-7, about
  fp32's unit roundoff; one single-process run). Per step, the loss and grad-norm bound is the larger of the
  fp32 one and 4 × the largest relative difference the perturbed run showed up to that step; per tensor, the
  element bound is the larger of the fp32 one and 4 × the largest |Δ| the perturbation moved that tensor by
  (one perturbed run is one sample of rounding's effect; ×4 covers its spread, as for calibration).
Route flips (mixture-of-experts models): a router sends each token to its top-k experts, a choice that jumps where two
  experts' scores tie, so an arm whose sums run in another order can send a near-tied token elsewhere, and from then
  on the two runs train on different gradients and drift apart past any rounding bound (measured: recipes/moe-tiny.yaml,
  fsdp, fsdp ep 2 and hf_native ep 2 against single, 60 steps: the first token moved expert at step 38, 44 pairs
  had by step 46, where the loss left the 1e-5 bound; ddp kept single's routing exactly). Each step's tokens per
  expert (metrics.jsonl expert_tokens) show where: when the first step whose routing differs from the reference's
  comes before the first step outside the bound, and at most ROUTE_FLIP_SHARE of that step's (token, expert) pairs
  moved (a misrouting bug moves many at once, and the loss with them), the verdict is "equivalent until a route flip
  at step k": the arm computed the same thing until rounding decided a tie.
Levers (strategy.gradient_compression, strategy.reduce_dtype, strategy.sync_every): an arm whose recipe turns one
  on changes the maths on purpose, and outside the bounds above is judged by what the lever costs instead: the loss
  curve's distance to the
  reference (mean and max relative difference per step), the final loss (the mean of the last tenth of the steps,
  the same batches in both runs) and the final eval loss. The budget: LEVER_BUDGET (2 %) of the reference's loss
  drop over the run (the mean of its first tenth minus that of its last) or of its final loss, whichever is smaller,
  never below ROUNDING_FACTOR × the largest relative loss difference the rounding reference showed, times the
  final loss (what rounding alone moves). Two hundredths of what training achieved is a cost a user does not notice
  in the curve, and one the report names in numbers; the final loss caps it where the loss ends near zero, where 2 % of the drop can exceed
  the final loss itself (measured: MiniLM-SST, 60 steps, drop 0.68 to a final 0.009: PowerSGD r=4 ended 16 % above
  the reference, within 2 % of the drop). Beyond the budget the lever costs accuracy and the verdict is "diverged",
  naming the lever. Only the lever's own keys may differ: any other
  setting that differs (a planted weight decay) is judged as without the lever, "diverged", naming that setting.
Verdicts: "equivalent" (fp32 tolerance, or the rounding reference's where larger), "equivalent within precision noise" (calibrated bound),
"equivalent until a route flip at step k" (above), "differs by design (LEVER)" (within the lever's budget), "diverged
at step k" (first step outside the bound), "diverged in final weights" (the trajectories agree, some judged tensor does not), each naming what differs between the two arms.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FP32_RTOL = 1e-5
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24}
NOISE_FACTOR = 4.0
ROUNDING_PERTURBATION = 1e-7  # the rounding reference's train.init_perturbation
ROUNDING_FACTOR = 4.0
ROUTE_FLIP = "equivalent until a route flip at step"
ROUTE_FLIP_SHARE = 0.01  # at most this share of a step's routed pairs moved: a flip rounding can explain
NOISE_GRADIENT_RATIO = UNIT_ROUNDOFF["fp32"]  # max|g| / ‖g‖ at or below this in every step: noise-driven
WEIGHT_TOLERANCE = f"|Δ| ≤ {FP32_RTOL:g} + {FP32_RTOL:g}·|w|"
BY_DESIGN = "differs by design"
DEEPSPEED_DEFAULT = "DeepSpeed's default"  # a lever zero turns on by itself (verdict._effective)
LEVER_BUDGET = 0.02  # of the reference's loss drop (see the module's doc)
# a lever's recipe key -> its settings that change nothing (the first: its default)
LEVERS = {"strategy.gradient_compression": ("none",), "strategy.reduce_dtype": (None, "fp32"),
          "strategy.sync_every": (1,)}
# keys expected to differ between arms of one experiment, or that cannot change what is computed: not a cause
EXPECTED_DIFFERENT = ("output_dir", "strategy.", "batch.micro_batch_size", "batch.grad_accum_steps",
                      "train.record_gradient_scale", "checkpoint.")


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _differs(a: float, b: float, tol: float) -> bool:
    """Outside tolerance. A value only one side has (nan: a norm the arm did not measure) or a non-finite one
    differs: a relative difference of nan compared as within any tolerance. The same on both sides (two fp16
    runs that overflowed at the same step) does not."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return False
    return not relative(a, b) <= tol


def grad_norm_rtol(num_params: int) -> float:
    return FP32_RTOL + 4.0 * math.sqrt(num_params) * UNIT_ROUNDOFF["fp32"]


def running_max(steps: Iterable[tuple[float, ...]]) -> list[float]:
    """Per step, the largest of its values and every earlier step's, from 0 (a nan is passed over: max(0.0, nan)
    is 0.0)."""
    return list(itertools.accumulate(steps, lambda worst, values: max(worst, *values), initial=0.0))[1:]


def noise_envelope(calib_a: list[dict], calib_b: list[dict], precision: str) -> list[float]:
    """Per-step bound from two reference runs that differ only in reduction order."""
    worst = running_max((relative(a["loss"], b["loss"]), relative(a["grad_norm"], b["grad_norm"]))
                        for a, b in zip(calib_a, calib_b))
    return [max(NOISE_FACTOR * w, UNIT_ROUNDOFF[precision]) for w in worst]


def first_difference(arm: list[dict], ref: list[dict], *, loss_tol, norm_tol) -> dict | None:
    """The first step (1-based) whose loss or grad norm is outside tolerance (a float, or one per step),
    with what differs there; None when every step is within."""
    if len(arm) != len(ref):
        step = min(len(arm), len(ref)) + 1
        return {"step": step, "what": f"the arm logged {len(arm)} steps, the reference {len(ref)}"}
    for index, (a, r) in enumerate(zip(arm, ref)):
        lt = loss_tol[index] if isinstance(loss_tol, list) else loss_tol
        nt = norm_tol[index] if isinstance(norm_tol, list) else norm_tol
        parts = []
        if _differs(a["loss"], r["loss"], lt):
            parts.append(f"loss {a['loss']:.7g} vs {r['loss']:.7g} (relative {relative(a['loss'], r['loss']):.2g} "
                         f"> {lt:.2g})")
        if _differs(a["grad_norm"], r["grad_norm"], nt):
            parts.append(f"grad norm {a['grad_norm']:.7g} vs {r['grad_norm']:.7g} (relative "
                         f"{relative(a['grad_norm'], r['grad_norm']):.2g} > {nt:.2g})")
        if parts:
            return {"step": a["step"], "what": f"step {a['step']}: " + ", ".join(parts)}
    return None


def first_route_flip(arm: list[dict], ref: list[dict]) -> dict | None:
    """The first step whose tokens per expert differ from the reference's: {"step", "moved": (token, expert) pairs
    routed to another expert, "pairs": the step's routed pairs}; None where they never differ or a run has no
    routing counts (a dense model)."""
    for a, r in zip(arm, ref):
        mine, theirs = a.get("expert_tokens"), r.get("expert_tokens")
        if mine is None or theirs is None:
            return None
        if mine != theirs:
            moved = sum(abs(x - y) for row_a, row_r in zip(mine, theirs) for x, y in zip(row_a, row_r)) // 2
            return {"step": a["step"], "moved": moved, "pairs": sum(sum(row) for row in theirs)}
    return None


def noise_driven_tensors(reference_run: dict | None) -> set[str] | None:
    """Tensors the reference moved by rounding noise alone, from its recorded gradient scale (None: not
    recorded, e.g. a reference strategy that cannot read full gradients)."""
    scale = (reference_run or {}).get("gradient_scale")
    if not scale or not scale.get("num_steps"):
        return None
    return {name for name, ratio in scale["max_abs_over_norm"].items() if ratio <= NOISE_GRADIENT_RATIO}


def rounding_scale(perturbed: dict, ref: dict) -> dict | None:
    """What rounding alone moves (see the module's doc): the reference run again from a perturbed start, against
    the reference. Per step the largest relative loss and grad-norm difference up to it, per tensor the largest
    |Δ| of the final weights; None where the two did not log the same steps or export the same tensors."""
    from safetensors.torch import load_file

    if len(perturbed["metrics"]) != len(ref["metrics"]):
        return None
    pairs = list(zip(perturbed["metrics"], ref["metrics"]))
    loss = running_max((relative(a["loss"], r["loss"]),) for a, r in pairs)
    norm = running_max((relative(a["grad_norm"], r["grad_norm"]),) for a, r in pairs)
    moved_weights = load_file(str(_weights_file(Path(perturbed["dir"]) / "model")))
    ref_weights = load_file(str(_weights_file(Path(ref["dir"]) / "model")))
    if moved_weights.keys() != ref_weights.keys():
        return None
    weights = {key: float((moved_weights[key].double() - want.double()).abs().max()) if want.numel() else 0.0
               for key, want in ref_weights.items()}
    return {"loss": loss, "grad_norm": norm, "weights": weights}


def _finite(value: float) -> float:
    """A difference the rounding reference showed, as a bound: nan or inf (it overflowed) widens nothing."""
    return value if math.isfinite(value) else 0.0


def step_bounds(ref: dict, rounding: dict | None) -> tuple[list[float] | float, list[float] | float]:
    """The fp32 loss and grad-norm bounds, per step where the rounding reference widens them."""
    norm_tol = grad_norm_rtol(ref["num_params"])
    if rounding is None:
        return FP32_RTOL, norm_tol
    return ([max(FP32_RTOL, ROUNDING_FACTOR * _finite(d)) for d in rounding["loss"]],
            [max(norm_tol, ROUNDING_FACTOR * _finite(d)) for d in rounding["grad_norm"]])


def compare_weights(arm_dir: Path, ref_dir: Path, *, noise: set[str], moved: dict[str, float] | None = None) -> dict:
    """Per tensor of the exported weights: elements outside the fp32 tolerance, or ROUNDING_FACTOR × what the
    rounding reference moved that tensor by (`moved`) where larger; largest |Δ|."""
    import torch
    from safetensors.torch import load_file

    arm = load_file(str(_weights_file(Path(arm_dir) / "model")))
    ref = load_file(str(_weights_file(Path(ref_dir) / "model")))
    if arm.keys() != ref.keys():
        only = sorted(set(arm) ^ set(ref))
        return {"same_names": False, "outside": [], "noise": [], "max_abs_diff": float("inf"),
                "names_note": f"the two model files hold different tensor names (e.g. {only[0]})"}
    outside, noisy, worst = [], [], 0.0
    for key, want in ref.items():
        got, want = arm[key].double(), want.double()
        diff = (got - want).abs()
        largest = float(diff.max()) if diff.numel() else 0.0
        worst = max(worst, largest)
        if key in noise:
            noisy.append({"tensor": key, "max_abs_diff": largest})
            continue
        rounding = ROUNDING_FACTOR * _finite((moved or {}).get(key, 0.0))
        bad = int((diff > torch.clamp(FP32_RTOL + FP32_RTOL * want.abs(), min=rounding)).sum())
        if bad:
            outside.append({"tensor": key, "elements": bad, "numel": diff.numel(), "max_abs_diff": largest,
                            "rounding_bound": rounding})
    return {"same_names": True, "outside": outside, "noise": noisy, "max_abs_diff": worst}


def weight_lines(check: dict) -> list[str]:
    """Each judged tensor outside tolerance: name, how many elements, the largest |Δ|, the tolerance."""
    if not check["same_names"]:
        return [f"exported weights: {check['names_note']}"]
    return [f"final weights: {o['tensor']}: {o['elements']} of {o['numel']} elements outside {WEIGHT_TOLERANCE}"
            + (f" and {ROUNDING_FACTOR:g} × the rounding reference's {o['rounding_bound'] / ROUNDING_FACTOR:.2g}"
               if o.get("rounding_bound") else "")
            + f" (largest |Δ| {o['max_abs_diff']:.2g})" for o in check["outside"]]


def noise_line(check: dict) -> str | None:
    if not check["noise"]:
        return None
    worst = max(check["noise"], key=lambda n: n["max_abs_diff"])
    names = ", ".join(n["tensor"] for n in check["noise"])
    return (f"noise-driven (gradient ≈ 0 by construction: max |g| ≤ 2⁻²⁴·‖g‖ in every reference step), not "
            f"judged: {len(check['noise'])} tensor(s), |Δ| up to {worst['max_abs_diff']:.2g} ({worst['tensor']}): "
            f"{names}")


def setting_differences(arm: dict, ref: dict) -> list[str]:
    """Resolved-recipe keys and precision-audit rows that differ (strategy plumbing left out)."""
    out = []
    flat_a, flat_r = flatten(arm["recipe"]), flatten(ref["recipe"])
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


def judge(arm: dict, ref: dict, *, envelope: list[float] | None, rounding: dict | None = None) -> dict:
    """arm/ref: {"name", "dir", "metrics", "recipe", "audit", "precision", "num_params", "run"}; rounding: what
    the rounding reference moved (rounding_scale), None where it did not run."""
    norm_tol = grad_norm_rtol(ref["num_params"])
    settings = setting_differences(arm, ref)
    noise = noise_driven_tensors(ref.get("run"))
    weights = compare_weights(arm["dir"], ref["dir"], noise=noise or set(),
                              moved=rounding["weights"] if rounding else None)
    out = {"settings": settings, "weights": weights, "noise_map": noise is not None,
           "noise_note": noise_line(weights), "max_weight_diff": weights["max_abs_diff"]}
    loss_tol, step_norm_tol = step_bounds(ref, rounding)
    first = first_difference(arm["metrics"], ref["metrics"], loss_tol=loss_tol, norm_tol=step_norm_tol)
    judged_weights_ok = weights["same_names"] and not weights["outside"]
    if first is None and judged_weights_ok:
        return {**out, "verdict": "equivalent", "step": None, "differences": settings}
    flip = first_route_flip(arm["metrics"], ref["metrics"])
    if flip is not None and (first is None or first["step"] > flip["step"]) and \
            flip["moved"] <= ROUTE_FLIP_SHARE * flip["pairs"]:
        after = f"; {first['what']}" if first is not None else "; the final weights differ"
        return {**out, "verdict": f"{ROUTE_FLIP} {flip['step']}", "step": flip["step"], "differences": [
            f"step {flip['step']}: {flip['moved']} of {flip['pairs']} (token, expert) pairs went to another expert "
            f"(a router near-tie rounding decides), every step before it within the bound{after}", *settings]}
    if envelope is not None:
        noisy = first_difference(arm["metrics"], ref["metrics"], loss_tol=envelope,
                                 norm_tol=[max(e, norm_tol) for e in envelope])
        if noisy is None:
            return {**out, "verdict": "equivalent within precision noise", "step": None, "differences": settings}
        first = noisy
    on = levers(arm["recipe"], ref["recipe"])
    if on:
        return {**out, **_judge_lever(arm, ref, on=on, first=first, settings=settings, rounding=rounding)}
    if first is not None:
        return {**out, "verdict": f"diverged at step {first['step']}", "step": first["step"],
                "differences": [first["what"], *settings]}
    return {**out, "verdict": "diverged in final weights", "step": None,
            "differences": [*weight_lines(weights), *settings]}


def levers(arm_recipe: dict, ref_recipe: dict) -> str | None:
    """The levers the arm turns on and the reference does not, in words ("gradient_compression=powersgd (r=4, from
    step 11)"), or None."""
    arm, ref = flatten(arm_recipe), flatten(ref_recipe)
    out = []
    for key, noops in LEVERS.items():
        value = _effective(arm, key, noops[0])
        if value not in noops and value != _effective(ref, key, noops[0]):
            words = f"{key.split('.', 1)[1]}={value}"
            if arm.get(key, noops[0]) in noops:
                words += f" ({DEEPSPEED_DEFAULT} under {value})"
            if value == "powersgd":
                start = arm.get("strategy.powersgd_start_step", 0) + 1
                words += f" (r={arm.get('strategy.powersgd_rank')}, from step {start})"
            if key == "strategy.sync_every" and arm.get("strategy.outer_optimizer") == "nesterov":
                words += " (DiLoCo)"
            out.append(words)
    return ", ".join(out) or None


def _effective(flat: dict, key: str, default: Any) -> Any:
    """A lever's setting as the arm runs it: zero without strategy.reduce_dtype keeps and reduces its gradients in
    the compute dtype under bf16 and fp16 (DeepSpeed's default; the precision audit's "gradients bf16"), which is
    reduce_dtype=bf16 by another name: judged as that lever, not as a fault."""
    value = flat.get(key, default)
    if key == "strategy.reduce_dtype" and value is None and flat.get("strategy.name") == "zero" \
            and flat.get("precision") in ("bf16", "fp16"):
        return flat["precision"]
    return value


def loss_distance(arm: list[dict], ref: list[dict], *, rounding: dict | None = None) -> dict:
    """What a lever cost against the reference (see the module's doc): per-step relative loss difference (mean,
    max), the final loss difference (mean of the last tenth of the steps) and eval loss difference, and the budget."""
    pairs = [(a["loss"], r["loss"]) for a, r in zip(arm, ref)]
    per_step = [relative(a, r) for a, r in pairs] or [math.inf]
    window = max(1, len(pairs) // 10)
    first_ref = sum(r for _, r in pairs[:window]) / window
    last_ref = sum(r for _, r in pairs[-window:]) / window
    last_arm = sum(a for a, _ in pairs[-window:]) / window
    drop = first_ref - last_ref
    floor = ROUNDING_FACTOR * _finite(rounding["loss"][-1]) * abs(last_ref) if rounding and rounding["loss"] else 0.0
    evals = [next((m["eval_loss"] for m in reversed(run) if "eval_loss" in m), None) for run in (arm, ref)]
    return {"mean_relative": sum(per_step) / len(per_step), "max_relative": max(per_step),
            "final_difference": last_arm - last_ref,
            "final_relative": (last_arm - last_ref) / max(abs(last_ref), 1e-30),
            "window": window, "drop": drop,
            "eval_difference": evals[0] - evals[1] if None not in evals else None,  # type: ignore[operator]
            "budget": max(LEVER_BUDGET * max(min(drop, abs(last_ref)), 0.0), floor)}


def _distance_line(d: dict) -> str:
    evals = f", eval loss {d['eval_difference']:+.3g}" if d["eval_difference"] is not None else ""
    return (f"loss curve {d['mean_relative']:.2%} from the reference on average (at most "
            f"{d['max_relative']:.2%}), final loss {d['final_difference']:+.3g} (last {d['window']} step(s)){evals}; "
            f"budget ±{d['budget']:.3g}: {LEVER_BUDGET:.0%} of the reference's loss drop {d['drop']:.3g} or of its "
            f"final loss, the smaller")


def _judge_lever(arm: dict, ref: dict, *, on: str, first: dict | None, settings: list[str],
                 rounding: dict | None) -> dict:
    """The verdict of an arm outside the exact bounds that turns a lever on (see the module's doc)."""
    # the precision audit's reduction row names the lever itself (its dtype on the wire): not another setting; nor,
    # where the lever is DeepSpeed's default under 16-bit precision, the gradients' row (it keeps them in that dtype)
    lever_rows = ("audit grad_reduction", "audit gradients") if DEEPSPEED_DEFAULT in on else ("audit grad_reduction",)
    others = [s for s in settings if not s.startswith(lever_rows)]
    step = first["step"] if first is not None else None
    where = f"diverged at step {step}" if step is not None else "diverged in final weights"
    if others:
        return {"verdict": where, "step": step, "differences": [
            *([first["what"]] if first else []), *others,
            f"besides the lever {on}, these settings differ: judged as without it"]}
    if len(arm["metrics"]) != len(ref["metrics"]) or not arm["metrics"]:  # its curve cannot be set beside the other
        return {"verdict": where, "step": step, "differences": [*([first["what"]] if first else []),
                                                                f"with the lever {on}"]}
    distance = loss_distance(arm["metrics"], ref["metrics"], rounding=rounding)
    costs = [abs(distance["final_difference"])] + ([abs(distance["eval_difference"])]
                                                   if distance["eval_difference"] is not None else [])
    line = _distance_line(distance)
    if all(math.isfinite(cost) and cost <= distance["budget"] for cost in costs):  # a NaN loss is no small cost
        return {"verdict": f"{BY_DESIGN} ({on})", "step": None, "distance": distance, "lever": on,
                "differences": [f"{on}: {line}"]}
    return {"verdict": where, "step": step, "distance": distance, "lever": on,
            "differences": [f"{on} moves the loss by more than its budget: {line}",
                            *([first["what"]] if first else [])]}


def audit_key(row: str, value) -> str | None:
    """What of an audit cell must match between arms: for the reduction its dtype, the parenthesised
    suffix (the collective itself is the strategy's plumbing; no suffix: nothing is reduced), elsewhere
    the cell without its parenthesised detail (stage, device)."""
    if not isinstance(value, str):
        return value
    if row == "grad_reduction":
        return value[value.rfind("(") + 1:-1] if value.endswith(")") else None
    if row == "optimizer":
        return value.split(",")[0]  # class and implementation; where its step runs is plumbing
    return value.split(" (")[0]


def flatten(tree: dict, prefix: str = "") -> dict:
    """A resolved recipe as {"optim.lr": 0.001, ...} (a model's `config` stays one value)."""
    out = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "config":
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _weights_file(model_dir: Path) -> Path:
    """What an arm trained: the model's weights, or a LoRA run's adapter (its frozen base did not move)."""
    plain = model_dir / "model.safetensors"
    return plain if plain.is_file() else model_dir / "adapter_model.safetensors"
