"""The report's recommendation, read from the results' rows: the fastest equivalent arm (only when measured apart),
the one with the least memory per rank, and what each arm buys and costs against a baseline."""

from __future__ import annotations

from toolkit.compare import measure

# the verdicts of an arm that computed what the reference did
from toolkit.compare.verdict import BY_DESIGN, ROUTE_FLIP, levers

EQUIVALENT = ("reference", "equivalent", "equivalent within precision noise")


def equivalent(verdict: str) -> bool:
    """Whether a verdict says the arm computed what the reference did (compare/verdict.py), up to a route flip."""
    return verdict in EQUIVALENT or verdict.startswith(ROUTE_FLIP)


def _state_mib(r: dict) -> float:
    return max(r["model_state_bytes_per_rank"] or [0]) / 2 ** 20


def recommendations(results: dict) -> list[str]:
    """Read from the table: the fastest equivalent arm (when its speed is told apart from every other's: see
    measure.speed_doubt), the one with the least memory per rank, and what each arm buys and costs next to a
    baseline, named in a line of its own with why it (see _baseline)."""
    done = [r for r in results["arms"] if r["status"] == "completed" and "verdict" in r]
    ok = [r for r in done if equivalent(r["verdict"]) and not r.get("fallback")]  # fallback: another's numbers
    if not ok:
        return ["no arm finished with an equivalent result: nothing to recommend"]
    leanest = min(ok, key=_state_mib)
    base, why = _baseline(results, done=done, ok=ok)
    lines = [_fastest_line(ok),
             f"least memory per rank: **{leanest['arm']}** ({_state_mib(leanest):.0f} MiB of params + grads + "
             f"optimizer state per rank)",
             f"each arm below is set against **{base['arm']}**: {why}"]
    for r in done:
        if r is base:
            continue
        if r.get("fallback"):  # its verdict is right, its numbers another strategy's: not why it is left out
            lines.append(f"{r['arm']}: not recommended: it did not run as its strategy on this machine (see the "
                         "table's notes)")
            continue
        if r["verdict"].startswith(BY_DESIGN):
            lines.append(_lever_line(r, done, base))
            continue
        if r not in ok:
            cost = r.get("distance")  # a lever beyond its loss budget
            lines.append(f"{r['arm']}: not recommended: {r['verdict']}" + (
                f" (its lever moves the final loss by {cost['final_relative']:+.1%}, beyond its budget)"
                if cost else ""))
            continue
        memory = (_state_mib(r) / _state_mib(base) - 1) * 100 if _state_mib(base) else float("nan")
        doubt = measure.speed_doubt(r, base)
        lines.append(f"{r['arm']}: {memory:+.0f} % model-state memory per rank vs {base['arm']}, "
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}× its tokens/s"
                     + (f" ({doubt[0]})" if doubt else ""))
    return lines


def _lever_line(r: dict, done: list[dict], base: dict) -> str:
    """What a lever that changes the maths on purpose bought and cost: bytes per step and step time against the same
    strategy without a lever (else the baseline), loss against the reference (its verdict's distance)."""
    plain = next((o for o in done if o is not r and o.get("strategy") == r.get("strategy")
                  and not levers(o.get("recipe") or {}, {}) and not o.get("fallback")), base)
    every = ((r.get("recipe") or {}).get("strategy") or {}).get("sync_every") or 1  # counted at a sync: 1/H a step
    if r.get("comm") and plain.get("comm") and plain["comm"]["total_bytes"]:
        moved = f"{(r['comm']['total_bytes'] / every / plain['comm']['total_bytes'] - 1) * 100:+.0f} % bytes per step"
    else:  # against a one-process baseline, which moves nothing: no ratio (it printed +nan %)
        mib = f"{r['comm']['total_bytes'] / every / 2 ** 20:,.1f} MiB" if r.get("comm") else "its bytes"
        moved = f"{mib} per step (no arm of its strategy ran without the lever; {plain['arm']} moves none)"
    time_change = (plain["tokens_per_s"] / r["tokens_per_s"] - 1) * 100  # the same tokens per step
    loss = (r.get("distance") or {}).get("final_relative", float("nan"))
    doubt = measure.speed_doubt(r, plain)
    return (f"{r['arm']}: {r['lever']}: {moved} and {time_change:+.0f} % step time vs "
            f"{plain['arm']} here" + (f" ({doubt[0]})" if doubt else "") + f", final loss {loss:+.2%} vs the "
            "reference (within its budget): accuracy traded for communication, worth it where the network is the "
            "bottleneck (`toolkit plan --hardware` predicts the step time there)")


def _baseline(results: dict, *, done: list[dict], ok: list[dict]) -> tuple[dict, str]:
    """The arm the others' memory and tokens/s are set against, and why it: plain data parallelism (its first
    equivalent arm), what every other strategy is a trade against; without one, the reference arm (else the first
    equivalent arm). It was the multi-rank arm with the most model-state memory: with no ddp arm that was tp or a
    pipeline, neither of them data parallelism, and nothing said why."""
    plain = [r for r in done if r.get("plain_data_parallel") and not levers(r.get("recipe") or {}, {})]
    base = next((r for r in plain if r in ok), None)
    if base is not None:
        return base, (f"plain data parallelism (a full replica on each of its {base['world_size']} rank(s), the batch "
                      "split over them), what the other strategies trade memory and speed against")
    missing = (f"plain data parallelism ({', '.join(r['arm'] for r in plain)}) is not recommended" if plain else
               f"no arm ran plain data parallelism ({', '.join(results['plain_data_parallel'])})")
    reference = next((r for r in ok if r["arm"] == results["reference"]), None)
    if reference is not None:
        return reference, f"the reference arm, as {missing}"
    return ok[0], f"the first equivalent arm, as {missing} and the reference arm is not recommended"


def _fastest_line(ok: list[dict]) -> str:
    """The equivalent arm with the highest median tokens/s, named fastest only when it is told apart from each other
    equivalent arm (the closest first); else which difference is not measured enough or within noise, and why."""
    fastest, *others = sorted(ok, key=lambda r: r["tokens_per_s"], reverse=True)
    speed = (f"{fastest['tokens_per_s']:.0f} tokens/s, "
             f"{fastest.get('speedup_vs_reference', float('nan')):.2f}× the reference")
    against, doubt = next(((r, d) for r in others if (d := measure.speed_doubt(fastest, r))), (None, None))
    if against is None or doubt is None:
        return f"fastest equivalent arm: **{fastest['arm']}** ({speed})"
    return (f"fastest equivalent arm: not told apart: {fastest['arm']} has the highest median ({speed}), but its "
            f"difference to {against['arm']} is {doubt[0]} ({doubt[1]})")
