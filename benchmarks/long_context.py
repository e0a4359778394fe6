"""The longest sequence each layout trains within one per-rank memory budget: single (one process), single with its
loss in tiles (`train.tiled_loss`), and context parallel over 2 ranks (`parallel.cp=2`, the allgather, ulysses and
ring methods, and allgather with its loss in tiles), with tokens/s.

    python benchmarks/long_context.py [--budget-mib 1500] [--start 512] [--max 32768] [--arms single,cp2-allgather,...]
                                      [--layers 4] [--hidden 256] [--steps 2]

The model is a Llama-style decoder built from a config (no download): hidden 256, MLP 688, 8 heads (4 KV: ulysses
splits them over 2 ranks), 4 blocks, the MiniLM tokenizer's vocabulary. The data are the shipped review texts,
repeated into one file long enough to pack `--max` tokens a block several times, written in a temporary folder.
For each arm the sequence length doubles from `--start`: each length is one real `toolkit launch` run (packed
blocks of that length, micro-batch 1, `--steps` steps, fp32, `train.host_memory: predictable` so that the peak
resident set follows what is live) whose run.json gives each rank's peak; the arm's row is the longest length whose
peak stayed within the budget on every rank, its peak and its tokens/s (the last step's: the step's tokens over
its time). A length whose run fails ends the arm's doubling there and is named. Target (issue 47):
cp=2 trains at least a 1.8× longer sequence than single.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from toolkit_runs import REPO, launch, print_table

MiB = 2 ** 20
ARMS = {
    "single": (1, []),
    "single-tiled": (1, ["train.tiled_loss=true"]),  # the loss in tiles: the logits never whole
    "cp2-allgather": (2, ["parallel.cp=2", "parallel.cp_method=allgather"]),
    "cp2-ulysses": (2, ["parallel.cp=2", "parallel.cp_method=ulysses"]),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_method=ring"]),  # two blocks of keys and values at a time
    "cp2-tiled": (2, ["parallel.cp=2", "parallel.cp_method=allgather", "train.tiled_loss=true"]),  # both at once
    "cp2-ring-tiled": (2, ["parallel.cp=2", "parallel.cp_method=ring", "train.tiled_loss=true"]),
}


def model_config(*, layers: int, hidden: int, max_positions: int) -> dict:
    return {"model_type": "llama", "vocab_size": 30522, "hidden_size": hidden, "intermediate_size": hidden * 43 // 16,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
            "max_position_embeddings": max_positions, "tie_word_embeddings": True}


def long_data(folder: Path, *, copies: int) -> Path:
    """The review texts `copies` times over, one file: packing cuts it into blocks of any length asked."""
    text = (REPO / "data" / "reviews-train.jsonl").read_text()
    path = folder / "long.jsonl"
    path.write_text(text * copies)
    return path


def run(arm: str, *, seq: int, config: dict, data: Path, steps: int, out: Path) -> dict | None:
    """One run of `arm` at sequence length `seq`: its peak per rank and last step's tokens/s, or None if it failed."""
    nproc, extra = ARMS[arm]
    sets = [f"model.config={json.dumps(config)}", f"data.train={data}", "data.eval=null", f"data.max_length={seq}",
            "data.packing=true", "batch.micro_batch_size=1", "batch.grad_accum_steps=1",
            "batch.global_batch_size=null", f"train.max_steps={steps}", "train.eval_every=null", "train.progress=false",
            "checkpoint.final=false", "train.host_memory=predictable", f"output_dir={out}", *extra]
    try:
        launch("recipes/llama-tiny.yaml", nproc=nproc, sets=sets, label=f"{arm} at {seq} tokens")
    except SystemExit as failed:
        print(str(failed).splitlines()[0])
        return None
    info = json.loads((out / "run.json").read_text())
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return {"peak": max(p["peak_mem_bytes"] for p in info["peak_memory"]), "tokens_per_s": last["tokens_per_s"]}


def longest(arm: str, *, budget: int, start: int, most: int, config: dict, data: Path, steps: int,
            root: Path) -> list[str]:
    """The arm's row: the longest length within the budget, doubling from `start` up to `most`."""
    best: tuple[int, dict] | None = None
    seq = start
    while seq <= most:
        found = run(arm, seq=seq, config=config, data=data, steps=steps, out=root / f"{arm}-{seq}")
        if found is None or found["peak"] > budget:
            break
        best, seq = (seq, found), seq * 2
    if best is None:
        return [arm, f"none ≥ {start}", "", ""]
    seq, found = best
    return [arm, f"{seq:,}" + (" (the --max)" if seq * 2 > most else ""), f"{found['peak'] / MiB:,.0f}",
            f"{found['tokens_per_s']:,.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=float, default=1500.0, help="peak resident set per rank")
    parser.add_argument("--start", type=int, default=512, help="the first sequence length")
    parser.add_argument("--max", type=int, default=32768, help="the longest sequence length tried")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    config = model_config(layers=args.layers, hidden=args.hidden, max_positions=args.max)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        # ~31.7k tokens a copy: (steps + 1) blocks of the longest length, and one more
        data = long_data(Path(tmp), copies=max(1, (args.steps + 2) * args.max // 30000 + 1))
        for arm in args.arms.split(","):
            table.append(longest(arm, budget=int(args.budget_mib * MiB), start=args.start, most=args.max,
                                 config=config, data=data, steps=args.steps, root=Path(tmp)))
    print(f"per-rank budget {args.budget_mib:,.0f} MiB; sequence lengths from {args.start:,} doubling to {args.max:,}")
    print_table(["arm", "longest sequence", "peak RSS MiB/rank", "tokens/s"], table)


if __name__ == "__main__":
    main()
