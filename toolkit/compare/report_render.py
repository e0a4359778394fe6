"""A compare experiment's results (report.py's build_results) as text: the terminal table, report.md and the
self-contained report.html, with the sections both share (why arms differ, audit, communication, pipeline,
recommendation)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import yaml

from toolkit.compare import measure, verdict
from toolkit.compare import predictions as predicted
from toolkit.compare.predictions import MEMORY_NOTE, memory_lines
from toolkit.compare.recommend import equivalent, recommendations
from toolkit.compare.report_sections import (NOT_JUDGED_HEADING, RECIPES_NOTE, arm_recipe_lines, not_judged_section,
                                             reference_recipe)
from toolkit.observe.routing import busiest_share

AUDIT_ROWS = ("forward_params", "master_weights", "gradients", "grad_reduction", "optimizer_state",
              "loss_scaling", "optimizer")


# An arm of a 1- or 2-step run has no steady step: its speed is the first step's (allocation, caches, a pipeline's shape
# exchange) and the collective-counting step's (a Python hook per op), and its collectives were counted on a step
# that also set things up (a pipeline's shapes on step 1, DDP's bucket rebuild on step 2). Its cells are marked, not
# refused: `--steps 1` is a real smoke test of every arm (does it run, does it agree with the reference), and its
# numbers, said to be what they are, still tell an arm that runs 10× slower.
UNSTEADY = " (no steady step)"
SETUP = " (incl. set-up)"


def _unsteady(r: dict) -> str:
    return UNSTEADY if r["num_timed_steps"] == 0 else ""


def _setup(comm: dict) -> str:
    return SETUP if comm["includes_setup"] else ""


def _bubble(r: dict) -> str:
    pipeline = r.get("pipeline")
    if not pipeline or pipeline["bubble_measured"] is None:
        return "–"
    return f"{pipeline['bubble_measured']:.2f} (theory {pipeline['bubble_theory']:.2f}){_unsteady(r)}"


def _mib(values) -> str:
    return " / ".join(f"{v / 2 ** 20:.0f}" for v in values if v is not None) or "n/a"


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    head = ["arm", "world", "precision", "tokens/s", "× ref", "step ms (p10–p90)", "timed steps", "peak MiB/rank",
            "peak vs plan", "model-state MiB/rank", "comm MiB/step", "bubble", "MFU", "final loss", "eval loss",
            "eval metric", "verdict"]
    reference = next(r for r in results["arms"] if r["arm"] == results["reference"])
    rows = []
    for r in results["arms"]:
        if r["status"] != "completed":
            blank = [""] * (len(head) - 3)
            rows.append([r["arm"], str(r["world_size"]), *blank, f"{r['verdict']}: {r['error']}"[:120]])
            continue
        unsteady = _unsteady(r)
        rows.append([
            r["arm"], str(r["world_size"]), r["precision"], f"{r['tokens_per_s']:.0f}{unsteady}",
            f"{r['speedup_vs_reference']:.2f}{unsteady or _unsteady(reference)}" if "speedup_vs_reference" in r
            else "–",
            f"{r['step_time_s'] * 1e3:.0f} ({r['step_time_p10_s'] * 1e3:.0f}–{r['step_time_p90_s'] * 1e3:.0f})"
            f"{unsteady}",
            str(r["num_timed_steps"]) if r["num_timed_steps"] else f"0 (all {len(r['losses'])}, warm-up included)",
            _mib(r["peak_mem_bytes_per_rank"]),
            _peak_vs_plan(r),
            _mib(r["model_state_bytes_per_rank"]),
            f"{r['comm']['total_bytes'] / 2 ** 20:.2f}{_setup(r['comm'])}" if r.get("comm") else "n/a", _bubble(r),
            f"{r['mfu'] * 100:.2f}%{unsteady}" if r.get("mfu") is not None else "n/a",
            f"{r['final_loss']:.4f}", f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "n/a",
            r.get("final_eval_metric") or "n/a", r["verdict"]])
    return head, rows


def _peak_vs_plan(row: dict) -> str:
    """The measured peak against the plan's at data.max_length, and against its prediction at the run's longest
    micro-batch where every batch was shorter (the memory section says more)."""
    if row.get("peak_prediction_error") is None:
        return "n/a"
    cell = f"{row['peak_prediction_error'] * 100:+.0f}%"
    if row.get("peak_prediction_error_at_longest") is not None:
        lengths = "/".join(str(t) for t in row["longest_micro_batch_tokens_per_rank"])
        cell += f"; {row['peak_prediction_error_at_longest'] * 100:+.0f}% at length {lengths}"
    return cell


def table_notes(results: dict, *, compact: bool = False) -> list[str]:
    """Below the table: why `× ref` shows – (the reference arm has no throughput to divide by), and which arms'
    speeds were timed over too few steps to be set against each other. compact: below the verdict table, whose
    unsteady cells carry UNSTEADY_MARK and which has no comm column (its set-up note left out)."""
    notes = []
    reference = next(r for r in results["arms"] if r["arm"] == results["reference"])
    if reference["status"] != "completed":
        notes.append(f"× ref –: the reference arm {reference['arm']} has no measurement ({reference['status']}), so "
                     "no arm's tokens/s is shown relative to it")
    done = [r for r in results["arms"] if r["status"] == "completed"]
    few = [r for r in done if r["num_timed_steps"] < measure.MIN_TIMED_STEPS]
    if few:
        notes.append(f"timed steps: the steady steps the medians are over (the warm-up, the step that counts "
                     f"collectives and profiled steps are left out); {', '.join(r['arm'] for r in few)}: fewer than "
                     f"{measure.MIN_TIMED_STEPS}, too few to tell arms' speeds apart (run --steps "
                     f"{_steps_for(few, measure.MIN_TIMED_STEPS)} or more)")
    unsteady = [r for r in done if _unsteady(r)]
    if unsteady:
        notes.append(f"{UNSTEADY_MARK + ' ' if compact else ''}{UNSTEADY.strip()}: {', '.join(r['arm'] for r in unsteady)} ran no step past the warm-up and "
                     "the step that counts collectives, so their tokens/s, × ref, step time, bubble and MFU are "
                     "those steps' (allocation, caches, a hook per collective), no steady speed (run --steps "
                     f"{_steps_for(unsteady, 1)} to time one steady step)")
    setup = [r for r in done if r.get("comm") and r["comm"]["includes_setup"] and not compact]
    if setup:
        steps = " or ".join(sorted({str(r["comm"]["step"]) for r in setup}))
        notes.append(f"{SETUP.strip()}: {', '.join(r['arm'] for r in setup)} counted collectives on step {steps}, "
                     "before the first step without set-up traffic, so their comm MiB/step includes it (a "
                     "pipeline's first-step shape exchange, DDP's bucket rebuild on step 2, ZeRO-3's first "
                     f"parameter fetches; run --steps {_steps_for(setup, 1)} or more to count a steady step)")
    return notes


def _steps_for(rows: list[dict], num_timed: int) -> int:
    """The --steps that time `num_timed` steady steps in every one of these arms (their profile windows too)."""
    return max(measure.steps_for_timed(num_timed, measure.profile_window(r)) for r in rows)


VERDICT_HEAD = ["arm", "world", "precision", "verdict", "tokens/s", "× ref", "peak MiB/rank", "final loss"]
UNSTEADY_MARK = "†"  # the verdict table's short (no steady step): the full table spells it out in each cell


def verdict_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """The narrow table read first, what a person choosing a strategy needs: does the arm compute the same thing,
    how fast, how much memory (the largest rank's peak). A failed arm's error goes below it (below_verdicts),
    never in a cell: one error would make every row as wide as itself."""
    reference = next(r for r in results["arms"] if r["arm"] == results["reference"])
    rows = []
    for r in results["arms"]:
        if r["status"] != "completed":
            rows.append([r["arm"], str(r["world_size"]), "", r["verdict"], "", "", "", ""])
            continue
        mark = UNSTEADY_MARK if _unsteady(r) else ""
        ref_mark = mark or (UNSTEADY_MARK if reference["status"] == "completed" and _unsteady(reference) else "")
        peaks = [b for b in r["peak_mem_bytes_per_rank"] if b is not None]
        rows.append([r["arm"], str(r["world_size"]), r["precision"], r["verdict"], f"{r['tokens_per_s']:.0f}{mark}",
                     f"{r['speedup_vs_reference']:.2f}{ref_mark}" if "speedup_vs_reference" in r else "–",
                     _mib([max(peaks)]) if peaks else "n/a", f"{r['final_loss']:.4f}"])
    return VERDICT_HEAD, rows


def below_verdicts(results: dict) -> list[str]:
    """The long texts of the verdict table, each a line of its own: why an arm failed or ran as another strategy,
    then the table's notes."""
    out = [f"{r['arm']} {r['verdict']}: {r['error']}" for r in results["arms"] if r["status"] != "completed"]
    out += [f"{r['arm']} did not run as its strategy on this machine: {r['fallback']}" for r in results["arms"]
            if r.get("fallback")]
    out += [line for line in map(_idle_lever, results["arms"]) if line]
    return out + table_notes(results, compact=True)


def _idle_lever(r: dict) -> str | None:
    """An arm whose PowerSGD starts past its last step: it ran without the lever, and its verdict (equivalent) is
    that of its strategy alone, said here (its run said so only in its own log)."""
    recipe = r.get("recipe") or {}
    strategy, steps = recipe.get("strategy") or {}, (recipe.get("train") or {}).get("max_steps")
    start = strategy.get("powersgd_start_step")
    if strategy.get("gradient_compression") != "powersgd" or not isinstance(steps, int) or not isinstance(start, int) \
            or steps > start:
        return None
    return (f"{r['arm']} compressed nothing: strategy.powersgd_start_step {start} is not below its {steps} steps, so "
            f"it ran as {strategy.get('name')} without the lever; run --steps {start + 1} or more to measure it")


def audit_table(results: dict) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Rows = audit fields, columns = arms; each cell (text, differs-from-reference)."""
    arms = [r for r in results["arms"] if r.get("audit")]
    rows = []
    for field in AUDIT_ROWS:
        values = [r["audit"].get(field, "n/a") for r in arms]
        keys = [verdict.audit_key(field, v) for v in values]
        base = next((k for k in keys if k is not None), None)
        rows.append([(field, False)] + [(v, k is not None and k != base) for v, k in zip(values, keys)])
    return ["setting"] + [r["arm"] for r in arms], rows




def _explanations(results: dict) -> list[str]:
    """One line per arm that failed, diverged, or agrees although some setting differs: built from the same
    judgement as the table's verdict column, so the two cannot disagree."""
    out = []
    for r in results["arms"]:
        if r["status"] != "completed":
            out.append(f"**{r['arm']}** {r['verdict']}: {r['error']}")
            continue
        if r.get("fallback"):  # dp without 2+ GPUs: its numbers are another strategy's
            out.append(f"**{r['arm']}** did not run as its strategy on this machine: {r['fallback']}")
        if r["verdict"] == "reference":
            continue
        details = r.get("differences") or []
        if equivalent(r["verdict"]):
            if details:
                out.append(f"**{r['arm']}** ({r['verdict']}) vs {results['reference']}, although these differ: "
                           + "; ".join(details))
            continue
        details = details or ["no recipe key or precision-audit row differs"]
        out.append(f"**{r['arm']}** ({r['verdict']}) vs {results['reference']}: " + "; ".join(details))
    return out


def _comm_lines(results: dict) -> list[str]:
    out = []
    for r in results["arms"]:
        comm = r.get("comm")
        if not comm:
            continue
        ops = ", ".join(f"{op} {b / 2 ** 20:.2f} MiB in {comm['calls_by_op'][op]} call(s)"
                        for op, b in comm["bytes_by_op"].items()) or "no collectives"
        out.append(f"{r['arm']} (step {comm['step']}{', incl. set-up' if comm['includes_setup'] else ''}, rank 0): "
                   f"{ops}")
    return out


EXPERTS_NOTE = ("A mixture-of-experts model's routing per arm (run.json `experts`, each step in metrics.jsonl "
                "`expert_tokens`): the tokens each expert of each layer was routed over the run, padding left out, "
                "and the load-balance spread (per step the worst layer's busiest expert over an even share; 1.0 is "
                "even), beside the bytes the arm's token all-to-alls handed over at rank 0 in the counted step.")


def _experts_lines(results: dict) -> list[str]:
    out = []
    for r in results["arms"]:
        e = r.get("experts")
        if not e or e.get("spread_mean") is None:
            continue
        moved = ((r.get("comm") or {}).get("bytes_by_op") or {}).get("all_to_all_single")
        busiest = [busiest_share(layer) for layer in e["tokens_per_expert"]]
        out.append(f"{r['arm']}: load spread {e['spread_mean']:.2f} mean over {e['steps']} steps (largest "
                   f"{e['spread_max']:.2f}); over the run, the busiest expert per layer took "
                   + ", ".join(f"{b:.2f}×" for b in busiest) + " an even share; token all-to-all "
                   + (f"{moved / 2 ** 20:.2f} MiB/step at rank 0" if moved else "none (every rank runs every expert)"))
    return out


def _pipeline_lines(results: dict) -> list[str]:
    out = []
    for r in results["arms"]:
        p = r.get("pipeline")
        if not p:
            continue
        count = len(p["stages_per_rank"])
        theory = p.get("bubble_theory_per_rank") or [None] * count
        split = p.get("bubble_predicted_per_rank") or [None] * count
        p2p = p.get("p2p_measured_per_rank") or [None] * count
        ranks = "; ".join(
            f"rank {i} stage{'s' if len(stages or []) > 1 else ''} {', '.join(map(str, stages or []))}: idle "
            + (f"{idle:.2f}" if idle is not None else "n/a") + (f" (theory {ideal:.2f}" if ideal is not None else "")
            + (f", this split {ahead:.2f}" if ideal is not None and ahead is not None else "")
            + (")" if ideal is not None else "") + (f", p2p {posting:.2f}" if posting is not None else "")
            + (f", peak {peak / 2 ** 20:.0f} MiB" if peak else "")
            for i, (stages, idle, ideal, ahead, posting, peak) in enumerate(
                zip(p["stages_per_rank"], p["bubble_measured_per_rank"], theory, split, p2p,
                    p["peak_mem_bytes_per_rank"] + [None] * count)))
        sent = p["p2p_send_bytes_per_step"]
        out.append(f"{r['arm']}{_unsteady(r)}: {ranks}; schedule's theoretical bubble {p['bubble_theory']:.2f}; "
                   + (f"{sent / 2 ** 20:.2f} MiB sent between stages per step (activations forward, gradients back, "
                      f"all ranks{', incl. set-up' if r['comm']['includes_setup'] else ''})" if sent is not None
                      else "stage-to-stage bytes not counted"))
    return out


PIPELINE_NOTE = ("Idle fraction = 1 − (time a rank spent in its stages' forward and backward chunks and the loss, "
                 "and posting its sends and receives) ÷ (span of the pipeline's step: its first rank's start to its "
                 "last rank's end, on one host's clock; ranks on several hosts: the rank's own schedule call), "
                 "median over steady steps: the time it waited on other stages; p2p = the fraction spent posting "
                 "sends and receives (on gloo the rank's own thread copies into the sockets there); "
                 "theory = the schedule's own order "
                 "simulated with a forward, an input gradient and a weight gradient one unit each: (p−1)/(v·m+p−1) "
                 "for p stages, m micro-batches, v stages per rank under gpipe, 1f1b and interleaved-1f1b, less under "
                 "the zero-bubble schedules; this split = the same with each stage's actions as long as its FLOPs "
                 "(its blocks' and the head's), the idle the split leaves.")


COMM_NOTE = ("Bytes each rank handed to collectives (the inputs of all-reduce / all-gather / reduce-scatter / "
             "broadcast), counted at the c10d dispatcher during one steady step (step 3, past the set-up; a run "
             "of fewer steps counts its last, marked incl. set-up); wire traffic depends on the backend's algorithm "
             "(a ring all-reduce sends about 2(N-1)/N of its input).")


def flops_note(results: dict) -> str:
    first = next((r for r in results["arms"] if r.get("flops")), None)
    if not first:
        return ""
    f = first["flops"]
    return (f"FLOPs per token = {f['formula']} = 6×{f['matmul_params']:,} + {f['attention_flops_per_token']:,} "
            f"= {f['flops_per_token']:,} (seq_len {f['seq_len']}); MFU = tokens/s × FLOPs/token ÷ "
            f"(peak × world); {_peaks_used(results)}." + "".join(
                f" {r['arm']}: {r['peak_source']}." for r in results["arms"]
                if r.get("peak_source") and "unreliable" in r["peak_source"]))


def _peaks_used(results: dict) -> str:
    """Which peak each arm's MFU divides by: one line, each peak named once with the arms that use it."""
    users: dict[str, list[str]] = {}
    for r in results["arms"]:
        peak = r.get("peak_used")
        if peak:
            users.setdefault(peak, []).append(r["arm"])
    if len(users) == 1:
        return f"peak: {next(iter(users))}"
    return "peaks: " + "; ".join(f"{', '.join(arms)}: {peak}" for peak, arms in users.items())


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *["| " + " | ".join(r) + " |" for r in rows]]


def render_markdown(results: dict, plots: list[Path]) -> str:
    """The verdict table and the recommendation first, then the details; the reference's whole recipe last."""
    lines = [f"# Strategy comparison: {results['recipe']}", "",
             f"Reference arm: **{results['reference']}** · machine: {results['machine'].get('device')} · "
             f"versions: {results['machine'].get('versions')}", "",
             *([f"Note: {results['dropout_note']}.", ""] if results.get("dropout_note") else []),
             *_md_table(*verdict_rows(results)), ""]
    lines += [*[f"- {text}" for text in below_verdicts(results)], *([""] if below_verdicts(results) else [])]
    lines += ["## Recommendation", ""] + [f"- {line}" for line in recommendations(results)]
    lines += ["", "## All measurements", "", *_md_table(*table_rows(results)), ""]
    lines += [*[part for note in table_notes(results) for part in (note, "")], flops_note(results), "",
              "## Why arms differ", "",
              *([f"Note: {results['rounding_note']}.", ""] if results.get("rounding_note") else [])]
    lines += [f"- {e}" for e in _explanations(results)] or ["- every arm matches the reference"]
    note, not_judged = not_judged_section(results)
    if not_judged:
        lines += ["", f"## {NOT_JUDGED_HEADING}", "", *([note, ""] if note else []), *[f"- {n}" for n in not_judged]]
    a_head, a_rows = audit_table(results)
    lines += ["", "## Precision audit (read from the live objects; **bold** = differs from the reference)", "",
              "| " + " | ".join(a_head) + " |", "|" + "---|" * len(a_head)]
    lines += ["| " + " | ".join(f"**{t}**" if d else t for t, d in row) + " |" for row in a_rows]
    lines += ["", "## Memory: predicted and measured", "", MEMORY_NOTE, ""]
    lines += [f"- {m}" for m in memory_lines(results)] or ["- n/a"]
    steps = predicted.step_lines(results)
    if steps:
        lines += ["", "## Step time: predicted and measured", "", predicted.STEP_NOTE, ""] + [f"- {t}" for t in steps]
    lines += ["", "## Communication per step", "", COMM_NOTE, ""]
    lines += [f"- {c}" for c in _comm_lines(results)] or ["- n/a"]
    experts = _experts_lines(results)
    if experts:
        lines += ["", "## Mixture of experts", "", EXPERTS_NOTE, ""] + [f"- {e}" for e in experts]
    pipeline = _pipeline_lines(results)
    if pipeline:
        lines += ["", "## Pipeline stages", "", PIPELINE_NOTE, ""] + [f"- {p}" for p in pipeline]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    lines += ["", "## Tolerances", "", "```", results["tolerances"], "```"]
    lines += ["", "## Recipes: what each arm changes from the reference", "", RECIPES_NOTE, ""]
    for arm, changes in arm_recipe_lines(results):
        lines += [f"- **{arm}**", *[f"  - `{c}`" for c in changes]]
    reference = reference_recipe(results)
    if reference:
        lines += ["", f"## Appendix: the reference arm's resolved recipe ({results['reference']})", "", "```yaml",
                  yaml.safe_dump(reference, sort_keys=False).strip(), "```"]
    return "\n".join(lines) + "\n"


def _html_table(table_id: str, head: list[str], rows: list[list[str]]) -> str:
    """Rows whose verdict (the column named so) is a failure or a divergence are marked bad, the others ok."""
    esc, verdict_at = html.escape, head.index("verdict")
    out = f"<table id='{table_id}'><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
    for row in rows:
        cls = "bad" if row[verdict_at].startswith(("failed", "damaged", "diverged", "no reference")) else "ok"
        out += f"<tr class='{cls}'>" + "".join(
            f"<td{' class=verdict' if i == verdict_at else ''}>{esc(c)}</td>" for i, c in enumerate(row)) + "</tr>"
    return out + "</table>"


def _items(texts: list[str], empty: str = "") -> str:
    return "".join(f"<li>{html.escape(t.replace('**', ''))}</li>" for t in texts) or (
        f"<li>{html.escape(empty)}</li>" if empty else "")


def render_html(results: dict, plots: list[Path]) -> str:
    """report.md's order, in one file (plots inlined); the reference's whole recipe in a collapsed <details>."""
    esc = html.escape
    dropout = f"<p>Note: {esc(results['dropout_note'])}.</p>" if results.get("dropout_note") else ""
    rounding = f"<p>Note: {esc(results['rounding_note'])}.</p>" if results.get("rounding_note") else ""
    below = f"<ul id='below-verdicts'>{_items(below_verdicts(results))}</ul>" if below_verdicts(results) else ""
    note = "".join(f"<p class='table-note'>{esc(note)}</p>" for note in table_notes(results))
    a_head, a_rows = audit_table(results)
    audit = "<table id='audit'><tr>" + "".join(f"<th>{esc(h)}</th>" for h in a_head) + "</tr>"
    for cells in a_rows:
        audit += "<tr>" + "".join(f"<td class='{'diff' if d else ''}'>{esc(str(t))}</td>" for t, d in cells) + "</tr>"
    audit += "</table>"
    images = "".join(f"<img alt='{p.stem}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'>"
                     for p in plots)
    why = _items(_explanations(results), "every arm matches the reference")
    judged_note, judged_lines = not_judged_section(results)
    not_judged = (f"<h2>{esc(NOT_JUDGED_HEADING)}</h2>" + (f"<p>{esc(judged_note)}</p>" if judged_note else "")
                  + f"<ul id='not-judged'>{_items(judged_lines)}</ul>") if judged_lines else ""
    experts = _items(_experts_lines(results))
    if experts:
        experts = f"<h2>Mixture of experts</h2><p>{esc(EXPERTS_NOTE)}</p><ul id='experts'>{experts}</ul>"
    step_items = predicted.step_lines(results)
    steps = (f"<h2>Step time: predicted and measured</h2><p>{esc(predicted.STEP_NOTE)}</p><ul id='steps'>"
             f"{_items(step_items)}</ul>") if step_items else ""
    pipeline = _items(_pipeline_lines(results))
    if pipeline:
        pipeline = f"<h2>Pipeline stages</h2><p>{esc(PIPELINE_NOTE)}</p><ul id='pipeline'>{pipeline}</ul>"
    changes = "".join(f"<li><b>{esc(arm)}</b><ul>{''.join(f'<li><code>{esc(c)}</code></li>' for c in lines)}</ul></li>"
                      for arm, lines in arm_recipe_lines(results))
    reference = reference_recipe(results)
    appendix = (f"<h2>Appendix: the reference arm's resolved recipe</h2><details><summary>{esc(results['reference'])}"
                f"</summary><pre>{esc(yaml.safe_dump(reference, sort_keys=False))}</pre></details>" if reference else "")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Strategy comparison</title><style>
body{{font-family:sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:4px 8px;font-size:13px}} th{{background:#eee}}
tr.bad td.verdict{{color:#b00;font-weight:bold}} tr.ok td.verdict{{color:#070}}
td.diff{{background:#ffe08a;font-weight:bold}} img{{max-width:100%;display:block;margin:1em 0}}
pre{{background:#f6f6f6;padding:8px}}</style></head><body>
<h1>Strategy comparison: {esc(results['recipe'])}</h1>
<p>Reference arm: <b>{esc(results['reference'])}</b> · {esc(str(results['machine'].get('device')))} ·
{esc(str(results['machine'].get('versions')))}</p>{dropout}{_html_table('verdicts', *verdict_rows(results))}{below}
<h2>Recommendation</h2><ul id='recommendation'>{_items(recommendations(results))}</ul>
<h2>All measurements</h2>{_html_table('summary', *table_rows(results))}{note}<p>{esc(flops_note(results))}</p>
<h2>Why arms differ</h2>{rounding}<ul>{why}</ul>{not_judged}
<h2>Precision audit</h2><p>Read from the live objects after setup; highlighted cells differ from the reference.</p>
{audit}<h2>Memory: predicted and measured</h2><p>{esc(MEMORY_NOTE)}</p><ul id='memory'>{_items(memory_lines(results), "n/a")}</ul>
{steps}<h2>Communication per step</h2><p>{esc(COMM_NOTE)}</p><ul>{_items(_comm_lines(results), "n/a")}</ul>{experts}{pipeline}
<h2>Plots</h2>{images}<h2>Tolerances</h2><pre>{esc(results['tolerances'])}</pre>
<h2>Recipes: what each arm changes from the reference</h2><p>{esc(RECIPES_NOTE)}</p><ul id='recipe-changes'>{changes}</ul>
{appendix}</body></html>
"""
