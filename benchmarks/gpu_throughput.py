"""Tokens/s, MFU and peak GPU memory of single, fsdp and zero3 on one GPU, each plain, with activation
checkpointing and with `train.compile`, with `toolkit plan`'s predictions beside each measurement: the peak, and the
step time `toolkit plan --hardware` gives for the arm's layout on one such GPU (a subprocess per arm).

    python benchmarks/gpu_throughput.py [--arms single,fsdp+ac,...] [--steps 12] [--micro-batch 4] [--seq 2048]
                                        [--profile-dir DIR] [--hardware NAME|FILE]

The model is a Llama-style decoder of ~1B parameters built from a config (no download): hidden 2048, MLP 5632,
32 heads (4 KV), 22 blocks, the MiniLM tokenizer's 30522-token vocabulary, tied embeddings. Each arm is one real
`toolkit launch --nproc 1` run, bf16, on the review texts packed into `--seq`-token samples (no padding), of
`--steps` steps; tokens/s is the median over the steps after the first fifth, MFU is against the GPU's datasheet
dense bf16 peak (`toolkit compare`'s own numbers, read from the run's metrics.jsonl and run.json). fsdp and zero3
run at world size 1: their hooks, casts and optimizer paths, without sharding.
On a GPU machine without internet: `bash benchmarks/offline_wheels.sh` here gathers DeepSpeed, datasets and the
tokenizer into .whl/ (it says how to install them there); then `--tokenizer .whl/tokenizer`.
Issue 11's goal: >= 50 % MFU for the best arm. An arm that fails (out of memory, say) is a row saying so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit_runs import REPO, print_table

sys.path.insert(0, str(REPO))

from toolkit.compare import measure  # noqa: E402
from toolkit.observe.metrics import read_jsonl  # noqa: E402

MODEL = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 2048, "intermediate_size": 5632,
         "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
         "max_position_embeddings": 4096, "tie_word_embeddings": True}
STRATEGIES = {"single": ["strategy.name=single"], "fsdp": ["strategy.name=fsdp"],
              "zero3": ["strategy.name=zero", "strategy.stage=3"],
              # ZeRO-3 keeping the whole 1B model gathered (reuse distance and live limit 4e9, the same buckets), so
              # that on one rank it gathers a block at a time (zero/order.py's block_units); zero3 at
              # DeepSpeed's defaults (1e9) gathers this model module by module
              "zero3-blocks": ["strategy.name=zero", f"strategy.ds_config={REPO}/benchmarks/data/zero3-blocks.json"]}
VARIANTS = {"": [], "+ac": ["train.activation_checkpointing=true"], "+compile": ["train.compile=true"],
            "+ac+compile": ["train.activation_checkpointing=true", "train.compile=true"],
            "+sac": ["train.activation_checkpointing=selective"],
            "+sac+compile": ["train.activation_checkpointing=selective", "train.compile=true"]}
ARMS = {s + v: STRATEGIES[s] + VARIANTS[v] for s in STRATEGIES for v in VARIANTS}
DEFAULT_ARMS = [s + v for s in STRATEGIES if s != "zero3-blocks" for v in ("", "+ac", "+compile")]
GiB = 2 ** 30


def job(arm: str, args) -> list[str]:
    """The recipe changes an arm's run and its plan share: the model, the batch, the arm's variant."""
    model = {**MODEL, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
             "intermediate_size": args.intermediate, "num_attention_heads": args.heads}
    sets = [*ARMS[arm], f"model.config={json.dumps(model)}", "precision=bf16", f"train.max_steps={args.steps}",
            f"data.max_length={args.seq}", "data.packing=true", f"batch.micro_batch_size={args.micro_batch}",
            "batch.grad_accum_steps=1", "batch.global_batch_size=null"]
    return sets + ([f"model.tokenizer={args.tokenizer}"] if args.tokenizer else [])


def predicted_step_s(arm: str, *, args) -> float | None:
    """`toolkit plan --hardware` of the arm's layout on one GPU of `args.hardware`: the step time it predicts (a
    compiled arm predicted as eager, as the plan does), or None where the plan fails (its last line printed)."""
    if not args.hardware:
        return None
    layout = arm.split("+")[0]
    if layout == "zero3-blocks":  # no layout of its own: zero3 with the arm's ds_config
        layout = "zero3@" + STRATEGIES[layout][1]
    cmd = [sys.executable, "-m", "toolkit", "plan", "recipes/llama-tiny.yaml", "--hardware", args.hardware,
           "--nodes", "1", "--gpus-per-node", "1", "--layouts", layout, "--json"]
    for item in job(arm, args):
        if not item.startswith("strategy."):
            cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"[benchmark] {arm}: toolkit plan failed: {result.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(result.stdout)[0]["step_time_s"]


def gpu_profile_name() -> str | None:
    """The shipped profile of this machine's GPU, by its name (an H100 is taken as SXM), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()  # e.g. "nvidia h100 pcie", "nvidia a100-pcie-40gb"
    for key, profile in (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("b200", "b200"),
                         ("l40s", "l40s"), ("mi300x", "mi300x")):
        if key in name:
            return profile
    return ("a100-40gb" if "40gb" in name else "a100-80gb") if "a100" in name else None


def run(arm: str, *, args, out: Path) -> dict:
    """One arm; the run's numbers, or {"error": the last line it printed}."""
    sets = [*job(arm, args), "train.eval_every=null", "data.eval=null", "train.progress=false",
            "checkpoint.final=false", f"output_dir={out}"]
    if args.profile_dir:  # two late steps, past the first (the compile); they are left out of tokens/s
        last = max(3, args.steps - 2)
        sets.append(f"train.profile_steps=[{last - 1}, {min(last, args.steps)}]")
    cmd = [sys.executable, "-m", "toolkit", "launch", "--nproc", "1", "recipes/llama-tiny.yaml"]
    for item in sets:
        cmd += ["--set", item]
    print(f"[benchmark] {arm} ...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.arm_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.arm_timeout} s"}
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        print(result.stderr[-4000:], file=sys.stderr)
        return {"error": next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "?")}
    run_info = json.loads((out / "run.json").read_text())
    if args.profile_dir:
        kept = args.profile_dir / arm.replace("+", "-")
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(out / "profile", kept)
        print("\n".join((kept / "ops.txt").read_text().splitlines()[:20]), file=sys.stderr, flush=True)
    speed = measure.throughput(read_jsonl(out / "metrics.jsonl"))
    return {"run": run_info, **speed, **measure.mfu(run_info, speed["tokens_per_s"]), **measure.memory(run_info),
            "predicted_step_s": predicted_step_s(arm, args=args)}


def row(arm: str, r: dict) -> list[str]:
    if "error" in r:
        return [arm, "failed: " + r["error"][:90], *[""] * 10]
    run_info = r["run"]
    peak = max(r["peak_mem_bytes_per_rank"])
    reserved = max(x or 0 for x in r["peak_reserved_bytes_per_rank"])
    predicted = r.get("predicted_peak_bytes")
    step, step_predicted = r["step_time_s"], r.get("predicted_step_s")
    return [arm, f"{run_info['num_params'] / 1e6:,.0f}M", f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu'] * 100:.1f} %" if r["mfu"] is not None else "n/a", f"{step * 1000:.0f}",
            f"{step_predicted * 1000:.3g}" if step_predicted else "n/a",
            f"{(step_predicted - step) / step * 100:+.1f} %" if step_predicted else "n/a",
            f"{run_info.get('compile_s') or 0:.0f}", f"{peak / GiB:.1f}", f"{reserved / GiB:.1f}",
            f"{predicted / GiB:.1f}" if predicted else "n/a",
            f"{(peak - predicted) / predicted * 100:+.1f} %" if predicted else "n/a"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sample (packed: no padding)")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=MODEL["intermediate_size"])
    parser.add_argument("--heads", type=int, default=MODEL["num_attention_heads"],
                        help="attention heads (head dim = hidden / heads: 16 gives 128, flash attention's best)")
    parser.add_argument("--tokenizer", help="a tokenizer folder instead of the recipe's (the MiniLM package's)")
    parser.add_argument("--arm-timeout", type=int, default=600, help="seconds before an arm counts as failed")
    parser.add_argument("--hardware", default=None, metavar="NAME|FILE",
                        help="the profile toolkit plan predicts each arm's step time with (default: the shipped "
                             "profile of this GPU's name, e.g. h200; a file toolkit calibrate wrote)")
    parser.add_argument("--json", type=Path, help="also write every arm's numbers here")
    parser.add_argument("--profile-dir", type=Path, help="profile two late steps of each arm (train.profile_steps) "
                        "and keep each arm's trace and op table in DIR/<arm>")
    args = parser.parse_args()
    args.hardware = args.hardware or gpu_profile_name()
    head = ["arm", "params", "tokens/s", "MFU", "step ms", "predicted ms", "error", "compile s", "peak GiB",
            "reserved GiB", "predicted GiB", "error"]
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms.split(","):
            results[arm] = run(arm, args=args, out=Path(tmp) / arm.replace("+", "-"))
            rows.append(row(arm, results[arm]))
            print("| " + " | ".join(rows[-1]) + " |", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print_table(head, rows)


if __name__ == "__main__":
    main()
