"""Memory per rank by strategy on a model big enough to show it, with `toolkit plan`'s prediction beside each
measurement.

    python benchmarks/memory_scaling.py [--nproc 2] [--steps 3] [--arms ddp,fsdp,...] [--layers 24] [--from-config]
                                        [--micro-batch 1] [--seq 128]

The model is a Llama-style decoder built from a config (no download): hidden 1024, MLP 2816, 16 heads (4 KV),
24 blocks, the MiniLM tokenizer's 30522-token vocabulary, tied embeddings: ~300M parameters. It is written once
with save_pretrained and every arm fine-tunes it from that folder, as a user fine-tunes a pretrained model
(`--from-config`: each run builds it from the config instead, seeded). Each arm is one real `toolkit launch` run
on the review texts (packed; micro-batch 1 × 128 tokens by default, fp32) of `--steps` steps; run.json holds what
it measured (model-state bytes counted from the live tensors, peak resident set size per rank) and the
prediction the run made before setup (the same arithmetic as `toolkit plan`), with `train.host_memory:
predictable` (freed tensors leave the resident set; `fast` keeps its high-water mark). fsdp and zero3 load with
low-memory loading (the recipe's default); `fsdp-whole` and `zero3-whole` build the whole model on every rank
first, for comparison. `pp-gpipe` and `pp-1f1b` run a 2-stage pipeline of 4 micro-batches a step and get a row
per rank (their stages differ); their activations show at a longer sequence (`--seq 512 --micro-batch 2`).
`tp` splits heads and MLP over the ranks (planned with each rank's share of them), `tp-sp` adds sequence
parallelism (planned with each rank's share of the tokens between its split layers).
Targets (issue 11): model states within ±1 % of the prediction (they are exact); peak within ±15 % on CPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from toolkit_runs import launch, print_table

MODEL = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 1024, "intermediate_size": 2816,
         "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 1024,
         "tie_word_embeddings": True}
ARMS = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "zero0": ["strategy.name=zero", "strategy.stage=0"],
    "zero1": ["strategy.name=zero", "strategy.stage=1"],
    "zero2": ["strategy.name=zero", "strategy.stage=2"],
    "zero3": ["strategy.name=zero", "strategy.stage=3"],
    "zero3-offload": ["strategy.name=zero", "strategy.stage=3", "strategy.offload_optimizer=true",
                      "strategy.offload_param=true"],
    "fsdp+ac": ["strategy.name=fsdp", "train.activation_checkpointing=true"],
    "fsdp+sac": ["strategy.name=fsdp", "train.activation_checkpointing=selective"],
    "fsdp+lora": ["strategy.name=fsdp", 'model.lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}'],
    "fsdp-whole": ["strategy.name=fsdp", "model.low_memory_loading=false"],
    "zero3-whole": ["strategy.name=zero", "strategy.stage=3", "model.low_memory_loading=false"],
    # a pipeline's ranks differ (one row each): gpipe keeps every micro-batch of the step in flight, 1f1b fewer
    "pp-gpipe": ["strategy.name=pipeline", "strategy.schedule=gpipe", "batch.grad_accum_steps=4"],
    "pp-1f1b": ["strategy.name=pipeline", "strategy.schedule=1f1b", "batch.grad_accum_steps=4"],
    # a TP rank is planned with its share of heads and MLP columns; under sequence parallelism of the tokens too
    "tp": ["strategy.name=tp"],
    "tp-sp": ["strategy.name=tp", "strategy.sequence_parallel=true"],
}
DEFAULT_ARMS = ("ddp", "fsdp", "zero2", "zero3", "zero3-offload", "fsdp+ac", "fsdp+lora")
MiB = 2 ** 20


def save_model(folder: Path, *, layers: int) -> Path:
    """The benchmark's model, seeded from its config and written by save_pretrained (what `model.path` loads)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**MODEL, "num_hidden_layers": layers}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def run(arm: str, *, model: list[str], nproc: int, steps: int, micro: int, seq: int, out: Path) -> dict:
    sets = [*model, f"train.max_steps={steps}", "train.eval_every=null",
            "data.eval=null", f"data.max_length={seq}", "data.packing=true", f"batch.micro_batch_size={micro}",
            "batch.grad_accum_steps=1", "batch.global_batch_size=null", "train.progress=false",
            "checkpoint.final=false", "train.host_memory=predictable",  # the resident set the plan predicts
            f"output_dir={out}", *ARMS[arm]]  # the arm's own settings last: they win
    launch("recipes/llama-tiny.yaml", nproc=nproc, sets=sets, label=arm)
    return json.loads((out / "run.json").read_text())


def rows(arm: str, run: dict) -> list[list[str]]:
    """One row, or one per rank where the prediction differs by rank (a pipeline's stages)."""
    states = [sum(r.values()) for r in run["model_state_bytes"]]
    predicted = run["memory_prediction"]
    want = [sum(r.values()) for r in predicted["model_state_bytes"]]
    peaks = [p["peak_mem_bytes"] for p in run["peak_memory"]]  # in rank order
    want_peaks = predicted.get("peak_bytes_per_rank") or [predicted["peak_bytes"]] * len(peaks)
    other = max(o["bytes"] for o in run["other_live_tensor_bytes"]) / MiB
    if len(set(want_peaks)) == 1 or len(want_peaks) != len(peaks):
        ranks = [(arm, max(states), max(want), max(peaks), max(want_peaks))]
    else:
        ranks = [(f"{arm} rank {r}", states[r], want[r], peaks[r], want_peaks[r]) for r in range(len(peaks))]
    state_error = max(abs(m - p) / p for m, p in zip(states, want))
    return [[label, f"{run['num_params'] / 1e6:.0f}M", f"{state / MiB:,.0f}", f"{state_want / MiB:,.0f}",
             f"{state_error * 100:.2f} %", f"{peak / MiB:,.0f}", f"{peak_want / MiB:,.0f}",
             f"{(peak - peak_want) / peak_want * 100:+.1f} %", f"{other:,.1f}"]
            for label, state, state_want, peak, peak_want in ranks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--from-config", action="store_true", help="build the model from its config in each run")
    parser.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample (packed: no padding)")
    args = parser.parse_args()
    head = ["arm", "params", "model states MiB/rank", "predicted", "error", "peak RSS MiB/rank", "predicted",
            "error", "other live MiB"]
    table: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.from_config:
            model = f"model.config={json.dumps({**MODEL, 'num_hidden_layers': args.layers})}"
        else:  # the folder is read by every arm; the recipe's model.config gives way to model.path
            model = f"model.path={save_model(Path(tmp) / 'model', layers=args.layers)}"
        for arm in args.arms.split(","):
            sets = [model] if args.from_config else ["model.config=null", model]
            table += rows(arm, run(arm, model=sets, nproc=args.nproc, steps=args.steps, micro=args.micro_batch,
                                   seq=args.seq, out=Path(tmp) / arm.replace("+", "-")))
    print_table(head, table)


if __name__ == "__main__":
    main()
