"""The pipeline schedules side by side: tokens/s against one process, each rank's measured idle fraction against its
schedule's theory, and what the split gives each stage.

    python benchmarks/pipeline_efficiency.py [--model tiny|302m] [--arms single,pp-gpipe,...] [--steps 12]
                                             [--from-files]

One real `toolkit compare` of recipes/llama-tiny.yaml (or the same recipe with the 302M Llama of memory_scaling.py
built from its config) on 2 ranks with 8 micro-batches a step (micro 4 × 8 = the recipe's global batch 32), as a
user runs it, in a subprocess; the table is read from its results.json. tokens/s: the median of the timed steps.
idle: 1 − (time a rank spent in its stages' forward and backward chunks and the loss, and posting its sends and
receives) ÷ (the span of the pipeline's step, from its first rank's start to its last rank's end): the time it
waited on other stages, the median over steady steps (steps that built a padded length's stages left out); theory:
the schedule's own order simulated (toolkit/strategies/pipeline/schedules.py), equal stages; this split's: the same
order with each stage's actions as long as its FLOPs (toolkit/strategies/pipeline/split.py; under
strategy.split_by=time the blocks' weighted by the measured ratio), the idle the split itself leaves; p2p: the
fraction of the step spent posting sends and receives (on gloo the rank's own thread copies into the sockets).

`--from-files` saves the model (seeded from its config) with save_pretrained first and trains it from that folder
(`model.path`), where each pipeline rank builds and reads only its own stages; a second table gives each rank's
setup peak (run.json peak_memory setup_peak_bytes: the build, load and setup, before the first step) above the
process's runtime, beside toolkit plan's prediction of it and the rank's own parameters.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from memory_scaling import MODEL, save_model
from toolkit_runs import compare, print_table

MiB = 2 ** 20

RECIPE = "recipes/llama-tiny.yaml"
ARMS = ("single,pp-gpipe,pp-1f1b,pp-interleaved,pp-interleaved-zb,pp-zbv,pp-dualpipev,pp-gpipe-head,pp-1f1b-head,"
        "pp-gpipe-head@strategy.split_by=time,pp-1f1b-head@strategy.split_by=time,pp-zbv@strategy.split_head=true")
BIG = [f"model.config.{key}={value}" for key, value in MODEL.items() if key != "model_type"] + \
    ["model.config.num_hidden_layers=24"]  # the 302M Llama of memory_scaling.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "302m"), default="tiny")
    parser.add_argument("--arms", default=ARMS, help=f"comma-separated compare arms, first = reference ({ARMS})")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--set", action="append", default=[], dest="sets", help="a recipe override (repeatable)")
    parser.add_argument("--output", help="keep the experiment folder here (default: a temporary one)")
    parser.add_argument("--from-files", action="store_true",
                        help="train the model from a saved folder (each stage reads only its own weights)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipeline-") as tmp:
        sets = ["batch.micro_batch_size=4", "data.eval=null", *(BIG if args.model == "302m" else []), *args.sets]
        if args.from_files:
            folder = save_model(Path(tmp) / "model", layers=24) if args.model == "302m" else tiny_model(Path(tmp))
            sets = [s for s in sets if not s.startswith("model.config.")] + \
                ["model.config=null", f"model.path={folder}"]
        output = Path(args.output) if args.output else Path(tmp) / "exp"
        results = compare(RECIPE, arms=args.arms, nproc=2, steps=args.steps, sets=sets, output=str(output))
        speed_table(results)
        if args.from_files:
            setup_table(results, output)


def tiny_model(tmp: Path) -> Path:
    """llama-tiny's model from its recipe's config, seeded and saved."""
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(yaml.safe_load((Path(__file__).parent.parent / RECIPE).read_text())["model"]["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
    return tmp / "model"


def setup_table(results: dict, output: Path) -> None:
    rows = []
    for r in results["arms"]:
        if r["status"] != "completed":
            continue
        info = json.loads((output / r["arm"] / "run.json").read_text())
        predicted = info["memory_prediction"]
        runtime = predicted["runtime_bytes"]
        for rank, (peak, want, states) in enumerate(zip(info["peak_memory"], predicted["setup_peak_bytes_per_rank"],
                                                        predicted["model_state_bytes"])):
            measured = peak["setup_peak_bytes"] - runtime
            rows.append([r["arm"], str(rank), f"{measured / MiB:,.0f}", f"{(want - runtime) / MiB:,.0f}",
                         f"{states['params_bytes'] / MiB:,.0f}", f"{measured / states['params_bytes']:.2f}"])
    print_table(["arm", "rank", "setup peak above runtime MiB", "plan MiB", "own parameters MiB",
                 "measured / own"], rows)


def speed_table(results: dict) -> None:
    rows = []
    single = next((r for r in results["arms"] if r["arm"] == "single" and r["status"] == "completed"), None)
    for r in results["arms"]:
        if r["status"] != "completed":
            rows.append([r["arm"], "failed", "", "", "", "", "", (r.get("error") or "")[:100]])
            continue
        speed = r["tokens_per_s"]
        versus = f"{speed / single['tokens_per_s']:.2f}x" if single else ""
        p = r.get("pipeline") or {}
        idle = ", ".join(f"{x:.2f}" if x is not None else "n/a" for x in p.get("bubble_measured_per_rank", []))
        p2p = ", ".join(f"{x:.2f}" if x is not None else "n/a" for x in p.get("p2p_measured_per_rank") or [])
        theory = ", ".join(f"{x:.2f}" for x in p.get("bubble_theory_per_rank", []) if x is not None)
        split = ", ".join(f"{x:.2f}" for x in p.get("bubble_predicted_per_rank", []) if x is not None)
        rows.append([r["arm"], f"{speed:,.0f}", versus, idle, theory, split, p2p, r["verdict"]])
    print_table(["arm", "tokens/s", "vs single", "idle per rank", "theory per rank", "this split's", "p2p per rank",
                 "verdict"], rows)


if __name__ == "__main__":
    main()
