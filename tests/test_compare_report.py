"""A compare's report.md, report.html and console end, rendered from results rows written here (the real runs'
reports: tests/test_compare.py): the verdict table and the recommendation first, then the details; each arm's
recipe as what it changes from the reference's; weights moved by rounding alone listed once, under their own
heading; every console line at most 120 characters."""

import html

import pytest

from toolkit.compare import verdict
from toolkit.compare.console import summary_lines
from toolkit.compare.report_render import render_html, render_markdown

REFERENCE_RECIPE = {"model": {"config": {"hidden_size": 32}, "dropout": 0.0}, "optim": {"lr": 0.001, "betas": [0.9, 0.95]},
                    "strategy": {"name": "single"}, "output_dir": "runs/x/single", "train": {"max_steps": 5}}
KEY_BIAS = "bert.encoder.layer.0.attention.self.key.bias"


def _row(arm, *, verdict_="equivalent", world_size=2, plain=False, recipe=None, noise=None, **extra):
    """A completed arm's row as report.py's build_results writes it (noise: {tensor: largest |Δ|})."""
    weights = {"same_names": True, "outside": [], "max_abs_diff": max((noise or {0: 0}).values()),
               "noise": [{"tensor": t, "max_abs_diff": d} for t, d in (noise or {}).items()]}
    return {"arm": arm, "status": "completed", "verdict": verdict_, "world_size": world_size, "precision": "fp32",
            "plain_data_parallel": plain, "tokens_per_s": 800.0, "speedup_vs_reference": 1.0, "step_time_s": 0.1,
            "step_time_p10_s": 0.09, "step_time_p90_s": 0.11, "num_timed_steps": 5,
            "model_state_bytes_per_rank": [70 * 2 ** 20] * world_size,
            "peak_mem_bytes_per_rank": [800 * 2 ** 20 + i * 2 ** 20 for i in range(world_size)], "losses": [9.5] * 7,
            "final_loss": 9.5, "final_eval_loss": None, "differences": [], "noise_map": True, "weights": weights,
            "noise_note": verdict.noise_line(weights), "recipe": recipe or REFERENCE_RECIPE, **extra}


def _results(*arms, dropout_note=None):
    return {"recipe": "recipes/r.yaml", "reference": "single", "machine": {"device": "cpu", "versions": {}},
            "arms": list(arms), "tolerances": "fp32: relative 1e-5", "plain_data_parallel": ["ddp"],
            "dropout_note": dropout_note}


def _with(**changes):
    """The reference recipe with changes: section__key=value, or a top-level key=value."""
    recipe = {k: dict(v) if isinstance(v, dict) else v for k, v in REFERENCE_RECIPE.items()}
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        recipe[section] = {**recipe[section], key: value} if key else value
    return recipe


def _sections(markdown):
    """The report's level-2 headings, in order."""
    return [line[3:] for line in markdown.splitlines() if line.startswith("## ")]


def test_the_report_opens_with_the_verdict_table_and_the_recommendation_then_the_details():
    results = _results(_row("single", verdict_="reference", world_size=1),
                       _row("ddp", plain=True, recipe=_with(strategy__name="ddp")),
                       _row("fsdp", recipe=_with(strategy__name="fsdp")), dropout_note="dropout is off in every arm")
    markdown = render_markdown(results, [])
    head, _, table = markdown.partition("\n| arm |")
    assert head.endswith("Note: dropout is off in every arm.\n")  # the title, the reference line and the note above it
    assert table.startswith(" world | precision | verdict | tokens/s | × ref | peak MiB/rank | final loss |\n")
    assert "| ddp | 2 | fp32 | equivalent | 800 | 1.00 | 801 | 9.5000 |" in table  # the largest rank's peak
    sections = _sections(markdown)
    assert sections[:3] == ["Recommendation", "All measurements", "Why arms differ"]
    assert sections[-2:] == ["Recipes: what each arm changes from the reference",
                             "Appendix: the reference arm's resolved recipe (single)"]
    advice = markdown.split("## Recommendation\n", 1)[1].split("\n## ", 1)[0]
    assert "- least memory per rank: **" in advice and "- each arm below is set against **ddp**" in advice
    assert "| step ms (p10–p90) |" in markdown.split("## All measurements", 1)[1]  # the full table, in the details
    page = render_html(results, [])
    order = [page.index(mark) for mark in ("<h1>", "Note: dropout is off", "id='verdicts'", "id='recommendation'",
                                           "id='summary'", "Why arms differ", "id='recipe-changes'", "<details>")]
    assert order == sorted(order), order


def test_the_console_prints_the_verdict_table_and_the_recommendation_in_120_characters():
    """A failed arm's error was the last cell of a 17-column table some 210 characters wide; the recommendation was
    not printed."""
    error = "RuntimeError: " + " ".join(["the rank's process group could not be set up"] * 12) + " /tmp/" + "x" * 150
    long_name = "fsdp@strategy.reshard_after_forward=false@optim.weight_decay=0.05@batch.micro_batch_size=2"
    results = _results(_row("single", verdict_="reference", world_size=1),
                       _row("ddp", plain=True, recipe=_with(strategy__name="ddp")),
                       _row(long_name, verdict_="equivalent within precision noise"),
                       _row("dp", world_size=1, fallback="strategy dp needs 2+ CUDA devices; this machine has 0, so "
                                                         "it runs as one process, like single " * 3),
                       {"arm": "zero3", "status": "failed", "world_size": 2, "error": error, "verdict": "failed"})
    lines = summary_lines(results)
    assert max(len(line) for line in lines) <= 120, [line for line in lines if len(line) > 120]
    assert lines[0].split() == ["arm", "world", "precision", "verdict", "tokens/s", "×", "ref", "peak", "MiB/rank",
                                "final", "loss"]
    text = " ".join(line.strip() for line in lines)
    assert f"zero3 failed: {error[:60]}" in text and "x" * 100 in text.replace(" ", "")  # all of it, wrapped
    assert "dp did not run as its strategy on this machine:" in text
    assert lines[lines.index("recommendation:") + 1].startswith("- fastest equivalent arm:")
    assert "- each arm below is set against ddp: plain data parallelism" in text  # markdown's ** left out
    rows = lines[2:2 + len(results["arms"])]
    assert rows[2].startswith("fsdp@strat") and "…" in rows[2].split()[0]  # cut in its middle to fit
    assert rows[2].split()[0].endswith("size=2")


def test_each_arm_shows_only_what_its_recipe_changes_from_the_reference():
    changed = _with(optim__lr=0.002, strategy__name="ddp", output_dir="runs/x/ddp")
    del changed["train"]
    results = _results(_row("single", verdict_="reference", world_size=1), _row("ddp", plain=True, recipe=changed))
    markdown = render_markdown(results, [])
    changes = markdown.split("## Recipes: what each arm changes from the reference", 1)[1].split("\n## ", 1)[0]
    assert changes.strip().splitlines()[-4:] == [
        "- **ddp**", "  - `optim.lr: 0.001 → 0.002`", "  - `strategy.name: single → ddp`",
        "  - `train.max_steps: 5 → (not set)`"]  # output_dir, each arm's own folder, left out
    appendix = markdown.split("## Appendix: the reference arm's resolved recipe (single)", 1)[1]
    assert "betas:\n  - 0.9\n  - 0.95" in appendix and "betas" not in markdown.split("## Appendix", 1)[0]
    page = render_html(results, [])
    assert "<li><code>optim.lr: 0.001 → 0.002</code></li>" in page
    assert "<details><summary>single</summary><pre>model:" in page.split("Appendix", 1)[1]


def test_weights_moved_by_rounding_alone_are_listed_once_under_their_own_heading():
    """They were listed per arm under "Why arms differ", after "every arm matches the reference", with "|Δ| up to 0"
    where an arm had not moved them."""
    other = "bert.encoder.layer.1.attention.self.key.bias"
    results = _results(_row("single", verdict_="reference", world_size=1),
                       _row("ddp", plain=True, recipe=_with(strategy__name="ddp"), noise={KEY_BIAS: 0.0, other: 0.0}),
                       _row("fsdp", recipe=_with(strategy__name="fsdp"), noise={KEY_BIAS: 3.1e-5, other: 0.0}))
    markdown = render_markdown(results, [])
    why = markdown.split("## Why arms differ\n", 1)[1].split("\n## ", 1)[0]
    assert why.strip() == "- every arm matches the reference"
    section = markdown.split("## Not judged: weights moved by rounding alone\n", 1)[1].split("\n## ", 1)[0]
    assert "exact gradient is zero by construction" in section and "steps of ~lr" in section
    assert f"- {KEY_BIAS}: ddp unchanged, fsdp |Δ| 3.1e-05" in section and f"- {other}: ddp unchanged, fsdp unchanged"
    assert markdown.count(KEY_BIAS) == 1 and "up to 0" not in markdown
    page = render_html(results, [])
    assert page.count(KEY_BIAS) == 1 and "up to 0" not in page and "id='not-judged'" in page
    assert "up to 0" not in " ".join(summary_lines(results))
    quiet = render_markdown(_results(_row("single", verdict_="reference", world_size=1)), [])
    assert "## Not judged" not in quiet  # nothing set aside: no section


def test_a_diverged_arm_is_why_arms_differ_and_nothing_says_every_arm_matches():
    diverged = _row("single@optim.lr=0.002", world_size=1, verdict_="diverged at step 2",
                    differences=["step 2: loss 9.1 vs 9.2", "optim.lr: 0.002 vs 0.001"], noise={KEY_BIAS: 1e-4},
                    recipe=_with(optim__lr=0.002))
    results = _results(_row("single", verdict_="reference", world_size=1), diverged)
    markdown, page = render_markdown(results, []), render_html(results, [])
    why = markdown.split("## Why arms differ\n", 1)[1].split("\n## ", 1)[0]
    assert why.strip() == "- **single@optim.lr=0.002** (diverged at step 2) vs single: step 2: loss 9.1 vs 9.2; " \
                          "optim.lr: 0.002 vs 0.001"
    assert "every arm matches" not in markdown and "every arm matches" not in page
    assert html.escape(f"{KEY_BIAS}: single@optim.lr=0.002 |Δ| 0.0001") in page


def test_a_mixture_of_experts_arm_shows_its_routing_and_token_traffic():
    experts = {"layers": 2, "experts": 4, "tokens_per_expert": [[30, 10, 10, 10], [15, 15, 15, 15]],
               "spread_mean": 1.7, "spread_max": 2.5, "steps": 5}
    comm = {"step": 3, "includes_setup": False, "total_bytes": 3 * 2 ** 20, "calls_by_op": {"all_to_all_single": 8},
            "bytes_by_op": {"all_to_all_single": 2 ** 20}}
    results = _results(_row("single", verdict_="reference", world_size=1, experts=experts),
                       _row("fsdp-ep2", experts=experts, comm=comm), _row("ddp"))
    markdown, page = render_markdown(results, []), render_html(results, [])
    section = markdown.split("## Mixture of experts\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("- ")]
    # layer 0: 30 of 60 tokens on one expert, twice an even 15; layer 1 even; ddp (a dense arm here) not listed
    assert lines == [
        "- single: load spread 1.70 mean over 5 steps (largest 2.50); over the run, the busiest expert per layer took "
        "2.00×, 1.00× an even share; token all-to-all none (every rank runs every expert)",
        "- fsdp-ep2: load spread 1.70 mean over 5 steps (largest 2.50); over the run, the busiest expert per layer took "
        "2.00×, 1.00× an even share; token all-to-all 1.00 MiB/step at rank 0"]
    assert "id='experts'" in page and "fsdp-ep2: load spread 1.70" in page
    assert "## Mixture of experts" not in render_markdown(_results(_row("single", verdict_="reference")), [])


def test_a_failed_reference_and_a_fallback_arm_leave_the_report_whole_and_say_why():
    """The reference arm failed and another completed: the verdict table read the failed arm's timed steps (a
    KeyError in compare and in toolkit report, and no report written). An arm that ran as one process here was
    "not recommended: equivalent"."""
    ddp = _row("ddp", verdict_="no reference (reference arm failed)", plain=True, recipe=_with(strategy__name="ddp"))
    del ddp["speedup_vs_reference"]
    failed = {"arm": "single", "status": "failed", "world_size": 1, "verdict": "failed",
              "error": "toolkit: non-finite gradient norm (nan) at step 2"}
    lines = summary_lines(_results(failed, ddp))
    assert "single failed: toolkit: non-finite gradient norm (nan) at step 2" in " ".join(lines)
    assert next(line for line in lines if line.startswith("ddp ")).split()[3:5] == ["no", "reference"]
    assert "## " in render_markdown(_results(failed, ddp), []) and "<table" in render_html(_results(failed, ddp), [])
    fallback = _row("dp", world_size=1, fallback="strategy dp needs 2+ CUDA devices; it runs as one process here")
    text = " ".join(summary_lines(_results(_row("single", verdict_="reference", world_size=1), fallback)))
    assert "dp: not recommended: it did not run as its strategy on this machine" in text
    assert "not recommended: equivalent" not in text


def test_a_lever_set_against_a_one_process_reference_states_its_bytes_not_a_ratio():
    """No arm of the lever's strategy ran without it, so its bytes were set against single's none: "+nan %"."""
    reference = _row("single", verdict_="reference", world_size=1, strategy="single",
                     comm={"total_bytes": 0, "includes_setup": False})
    lever = _row("ddp-bf16c", verdict_=f"{verdict.BY_DESIGN} (gradient_compression=bf16)", strategy="ddp",
                 lever="gradient_compression=bf16", comm={"total_bytes": 9 * 2 ** 20, "includes_setup": False},
                 distance={"final_relative": 0.0},
                 recipe=_with(strategy__name="ddp", strategy__gradient_compression="bf16"))
    text = " ".join(" ".join(summary_lines(_results(reference, lever))).split())
    assert "nan" not in text
    assert "ddp-bf16c: gradient_compression=bf16: 9.0 MiB per step (no arm of its strategy ran without the lever; " \
           "single moves none)" in text, text


@pytest.mark.parametrize("start, idle", [(5, True), (9, True), (4, False)])
def test_a_powersgd_arm_that_starts_past_its_last_step_is_said_to_have_compressed_nothing(start, idle):
    """PowerSGD from step start + 1: at --steps 5 and start 5 it never ran, and the arm was "equivalent" with no
    word in the report (its run said so only in its own launch.log)."""
    recipe = _with(strategy__name="ddp", strategy__gradient_compression="powersgd",
                   strategy__powersgd_start_step=start)
    text = " ".join(" ".join(summary_lines(_results(_row("single", verdict_="reference", world_size=1),
                                                    _row("ddp-powersgd", recipe=recipe)))).split())
    said = (f"ddp-powersgd compressed nothing: strategy.powersgd_start_step {start} is not below its 5 steps, so it "
            f"ran as ddp without the lever; run --steps {start + 1} or more to measure it")
    assert (said in text) == idle, text
