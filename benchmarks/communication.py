"""The communication levers on the default job: what each sends per step, how long a step takes, where the loss
ends and the compare's verdict, exact DDP and FSDP beside them.

    python benchmarks/communication.py [--arms ddp,ddp-bf16c,...] [--steps 60]

One real `toolkit compare` of recipes/minilm-sst.yaml (the first arm the reference) on 2 ranks, as a user runs it, in
a subprocess; the table is read from its results.json. bytes/step: the collective counter's input bytes on rank 0 in
one steady step (PowerSGD's: its first compressed step, the recipe's powersgd_start_step + 1; local SGD's: its first
sync, divided by sync_every, as the steps between send nothing: the mean over a window). step ms: the median
of the timed steps. final eval loss: the recipe's eval split after the last step. loss vs ref: the mean of the last
tenth of the steps' losses against the reference's (the verdict's distance; the same batches in both).
"""

from __future__ import annotations

import argparse

from toolkit_runs import compare, print_table

RECIPE = "recipes/minilm-sst.yaml"
ARMS = "ddp,ddp-fp16c,ddp-bf16c,ddp-powersgd,ddp-localsgd4,ddp-diloco8,fsdp,fsdp-bf16reduce,zero2,zero2-bf16reduce"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=ARMS, help=f"comma-separated compare arms, first = reference ({ARMS})")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--set", action="append", default=[], dest="sets", help="a recipe override (repeatable)")
    parser.add_argument("--output", help="keep the experiment folder here (default: a temporary one)")
    args = parser.parse_args()
    results = compare(RECIPE, arms=args.arms, nproc=2, steps=args.steps, sets=args.sets, output=args.output)
    rows = []
    plain = {r["strategy"]: r for r in results["arms"] if r["status"] == "completed" and "-" not in r["arm"]}
    for r in results["arms"]:
        if r["status"] != "completed":
            rows.append([r["arm"], "failed", "", "", "", "", (r.get("error") or "")[:100]])
            continue
        every = ((r.get("recipe") or {}).get("strategy") or {}).get("sync_every") or 1
        sent = (r["comm"]["total_bytes"] if r.get("comm") else 0) / every
        base = plain.get(r["strategy"])
        versus = f"{(sent / base['comm']['total_bytes'] - 1) * 100:+.0f} %" if base and base is not r and \
            (base.get("comm") or {}).get("total_bytes") else ""
        distance = r.get("distance")
        loss = f"{distance['final_relative']:+.3%}" if distance else ""
        eval_loss = f"{r['final_eval_loss']:.4f}" if r.get("final_eval_loss") is not None else "n/a"
        rows.append([r["arm"], f"{sent / 2 ** 20:.2f}", versus, f"{r['step_time_s'] * 1e3:.0f}", eval_loss, loss,
                     r["verdict"]])
    print_table(["arm", "bytes/step MiB", "vs exact", "step ms", "final eval loss", "loss vs ref", "verdict"], rows)


if __name__ == "__main__":
    main()
