"""Two sections of the report read from the results' rows, shared by report.md and report.html: what each arm's
resolved recipe changes from the reference arm's, and the weights that rounding alone moved (listed once, not
judged)."""

from __future__ import annotations

import json

from toolkit.compare import verdict

# each arm writes to its own folder, and the reference alone records its gradient scale (for the verdict): differences
# compare itself makes, that say nothing about what an arm computed
OWN_FOLDER_KEYS = ("output_dir", "train.record_gradient_scale")

NOT_JUDGED_HEADING = "Not judged: weights moved by rounding alone"
NOT_JUDGED_NOTE = (
    "These tensors' exact gradient is zero by construction (e.g. attention key biases: softmax ignores a constant "
    "added to every score of a query): in every step of the reference run their largest |gradient| was at most "
    "2⁻²⁴ of the global gradient norm, i.e. rounding noise. Adam turns that noise into steps of ~lr with the sign "
    "of each strategy's summation order, so they differ between arms that compute the same thing; their largest "
    "|Δ| per arm is listed here and no verdict reads them.")
RECIPES_NOTE = ("Each arm's resolved recipe set against the reference arm's, key by key (`key: reference → arm`; "
                "output_dir, each arm's own folder, and train.record_gradient_scale, on for the reference alone, left out). The reference's whole recipe is in the appendix; "
                "every arm's whole recipe is in results.json (arms[i].recipe) and in its folder's recipe.yaml.")
NO_NOISE_MAP = "the reference arm recorded no gradient scale, so no weight was set aside as moved by rounding alone"


def _shown(value) -> str:
    """A recipe value as the recipe's YAML would read it (null, true, 0.001, a string bare)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def recipe_changes(arm_recipe: dict, reference_recipe: dict) -> list[str]:
    """`key: reference value → arm value` for each flattened recipe key that differs (a key only one side has:
    `(not set)` on the other), the arms' own folders left out."""
    arm, ref = verdict.flatten(arm_recipe), verdict.flatten(reference_recipe)
    missing = "(not set)"
    keys = sorted((set(arm) | set(ref)) - set(OWN_FOLDER_KEYS))
    return [f"{key}: {_shown(ref[key]) if key in ref else missing} → {_shown(arm[key]) if key in arm else missing}"
            for key in keys if (key in arm) != (key in ref) or arm.get(key) != ref.get(key)]


def reference_recipe(results: dict) -> dict | None:
    reference = next((r for r in results["arms"] if r["arm"] == results["reference"]), None)
    return (reference or {}).get("recipe")


def arm_recipe_lines(results: dict) -> list[tuple[str, list[str]]]:
    """Per arm other than the reference: (its name, what its recipe changes, or why nothing is listed)."""
    ref = reference_recipe(results)
    out = []
    for r in results["arms"]:
        if r["arm"] == results["reference"]:
            continue
        if not r.get("recipe"):
            out.append((r["arm"], [f"no resolved recipe ({r['verdict']})"]))
        elif ref is None:
            out.append((r["arm"], ["the reference arm has no resolved recipe to set it against"]))
        else:
            out.append((r["arm"], recipe_changes(r["recipe"], ref) or ["nothing but its output folder"]))
    return out


def _largest(diff: float) -> str:
    return "unchanged" if diff == 0 else f"|Δ| {diff:.2g}"


def not_judged_section(results: dict) -> tuple[str, list[str]]:
    """The explanation (empty when no tensor is listed) and one line per tensor set aside as moved by rounding
    alone, named once with every arm that has it and that arm's largest |Δ| (`unchanged` where it is 0); a
    reference that recorded no gradient scale is said there too. Both empty: the report has no such section."""
    arms_of: dict[str, list[str]] = {}
    for r in results["arms"]:
        for noisy in (r.get("weights") or {}).get("noise") or []:
            arms_of.setdefault(noisy["tensor"], []).append(f"{r['arm']} {_largest(noisy['max_abs_diff'])}")
    lines = [f"{tensor}: {', '.join(arms)}" for tensor, arms in arms_of.items()]
    if any(r.get("noise_map") is False for r in results["arms"]):
        lines.append(NO_NOISE_MAP)
    return (NOT_JUDGED_NOTE if arms_of else ""), lines
