"""metrics.jsonl and run.json are strict JSON: a non-finite number is written as null beside a "nonfinite" field
that keeps what it was, and the toolkit's reader puts it back. The progress line says which steps made no
update."""

import json
import math

from conftest import strict_loads
from toolkit.observe.metrics import JsonlWriter, Progress, read_jsonl, restore_nonfinite, strict_json


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


def _step(step: int, *, loss: float = 2.0, grad_norm: float = 1.0, scale: float | None = 65536.0,
          skipped: bool = False, nonfinite: bool = False) -> dict:
    record = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": grad_norm, "tokens_per_s": 100.0,
              "step_time_s": 0.5, "loss_scale": scale, "skipped": skipped}
    return {**record, "skipped_nonfinite": True} if nonfinite else record


def test_the_progress_line_says_a_step_was_skipped_and_why(capsys):
    """Before: an fp16 overflow read `step 4/4 loss 19.5835 ... grad_norm inf ...` as if it had trained. A skipped
    step gets its line whatever log_every (here 10), naming fp16's lowered scale or the non-finite value."""
    progress = Progress(total=20, enabled=True, log_every=10)
    for record in (_step(1, grad_norm=math.inf, scale=32768.0, skipped=True),  # the first: the scale before unknown
                   _step(2, scale=32768.0),
                   _step(3, grad_norm=math.inf, scale=16384.0, skipped=True),
                   _step(4, loss=math.nan, grad_norm=math.nan, scale=16384.0, skipped=True, nonfinite=True),
                   _step(5, grad_norm=math.nan, scale=16384.0, skipped=True, nonfinite=True),
                   _step(6, scale=16384.0), _step(10, scale=16384.0)):
        progress.update(record)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["1/20", "3/20", "4/20", "5/20", "10/20"]
    assert lines[0].endswith(" ms · skipped (fp16 overflow, loss scale now 32768)")
    # after the first step, the time (tests/test_metrics.py's clock test) comes between the step time and the skip
    assert lines[1].endswith(" left · skipped (fp16 overflow, loss scale 32768 → 16384)")
    assert lines[2].endswith(" left · skipped (non-finite loss, train.on_nonfinite skip)")
    assert lines[3].endswith(" left · skipped (non-finite gradient norm, train.on_nonfinite skip)")
    assert "skipped" not in lines[4]


def test_a_plain_progress_line_says_the_time_trained_and_left(capsys):
    """A batch job's log (no terminal, so no tqdm bar) had no time left in it. Worked by hand: set-up ends at
    t=0, the first step (warm-up, 10 s) ends at t=10, then 2 s a step, and an evaluation in step 6 costs 3 s
    more; the rate is taken over the steps after the first."""
    ticks = {"now": 0.0}

    def clock() -> float:
        return ticks["now"]

    progress = Progress(total=10, enabled=True, log_every=2, clock=clock)
    for step, ends_at in ((1, 10.0), (2, 12.0), (3, 14.0), (4, 16.0), (5, 18.0), (6, 23.0)):
        ticks["now"] = ends_at
        progress.update(_step(step))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["2/10", "4/10", "6/10"]
    # step 2 at t=12: 2 s over 1 step after the first, 8 steps left -> 16 s; step 4 at t=16: 6 s / 3 steps, 6 left
    # -> 12 s; step 6 at t=23 (the evaluation's 3 s): 13 s / 5 steps = 2.6 s, 4 left -> 10.4 s
    assert lines[0].endswith(" ms · 0:00:12 elapsed, ~0:00:16 left")
    assert lines[1].endswith(" ms · 0:00:16 elapsed, ~0:00:12 left")
    assert lines[2].endswith(" ms · 0:00:23 elapsed, ~0:00:10 left")
    ticks["now"] = 3 * 3600 + 62.4  # the last step: elapsed only
    progress.update(_step(10))
    assert capsys.readouterr().err.strip().endswith(" ms · 3:01:02 elapsed")
