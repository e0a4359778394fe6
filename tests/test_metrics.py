"""metrics.jsonl and run.json are strict JSON: a non-finite number is written as null beside a "nonfinite" field
that keeps what it was, and the toolkit's reader puts it back."""

import json
import math

from conftest import strict_loads
from toolkit.metrics import JsonlWriter, read_jsonl, restore_nonfinite, strict_json


def test_a_non_finite_step_is_strict_json_and_reads_back_as_written(tmp_path):
    """Before: `"loss": NaN`, which JSON.parse and jq refuse."""
    steps = [{"step": 1, "loss": 2.5, "grad_norm": 1.0, "skipped": False},
             {"step": 2, "loss": math.nan, "grad_norm": math.inf, "eval_perplexity": -math.inf, "skipped": True}]
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    for record in steps:
        writer.write(record)
    writer.close()
    first, second = map(strict_loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first == steps[0]  # a finite step is written as it was, no field added
    assert second == {"step": 2, "loss": None, "grad_norm": None, "eval_perplexity": None, "skipped": True,
                      "nonfinite": {"loss": "nan", "grad_norm": "inf", "eval_perplexity": "-inf"}}
    back = read_jsonl(tmp_path / "metrics.jsonl")
    assert back[0] == steps[0] and math.isnan(back[1]["loss"]) and back[1]["grad_norm"] == math.inf
    assert back[1]["eval_perplexity"] == -math.inf and "nonfinite" not in back[1]


def test_nested_non_finite_numbers_keep_their_place_and_hand_edits_leave_nulls():
    # run.json nests (per-parameter gradient scales keyed by dotted names, per-rank lists)
    info = {"final_loss": math.nan, "gradient_scale": {"model.embed.weight": {"max": math.inf}}, "ranks": [1.0, math.nan]}
    written = strict_json(info)
    assert json.dumps(written, allow_nan=False)
    assert written["nonfinite"] == {"final_loss": "nan", "gradient_scale": {"model.embed.weight": {"max": "inf"}},
                                    "ranks": {"1": "nan"}}
    back = restore_nonfinite(json.loads(json.dumps(written)))
    assert math.isnan(back["final_loss"]) and back["gradient_scale"]["model.embed.weight"]["max"] == math.inf
    assert back["ranks"][0] == 1.0 and math.isnan(back["ranks"][1])
    # an entry naming nothing, or no number, is passed over: the reader still gets the record
    assert restore_nonfinite({"loss": None, "nonfinite": {"loss": "many", "gone": "nan", "ranks": {"4": "nan"}}}) == \
        {"loss": None}
