#!/usr/bin/env bash
# The GPU checks of the open issues in one script, for one short lease of a one-GPU machine without internet
# (the device tool): the wheels and tokenizer that benchmarks/offline_wheels.sh gathers into .whl/ travel with it.
#
#     bash benchmarks/gpu_checks.sh [calibrate,ring,throughput,more] [DEADLINE_S]    # results under $OUT
#
# calibrate   toolkit calibrate --hardware h200 on gpu_throughput.py's 1B model (issue 48): hardware-h200-measured.yaml
# ring        parallel.cp_method ring (issue 47) on CUDA's flash kernel in bf16 at cp 2 and 4, every rank on the one
#             GPU over gloo, against plain transformers on the whole sequence; allgather beside it (tests/reference/
#             context_parallel.py ... cuda): ring.txt. Its CPU twin (`bf16` for `cuda`) gave ring: loss 2.4e-5
#             relative, gradients 0.023 of 4.16; allgather: 2e-6, 0.016 of 4.06. The earlier probe of torch's
#             context_parallel at cp=1 on an H200 (torch 2.11, 2026-12-04): flash and cuDNN equal to the plain step
# throughput  gpu_throughput.py's single, fsdp, zero3, single+ac, single+compile with a profile of two late steps
#             each (issues 44 and 48): throughput.json, ops.txt, and host.txt: single's and zero3's host view of
#             those steps (the span, the device's busy time, the host's waits at synchronisations, the ops of most
#             host time): zero3 at world size 1 ran 584 ms a step with 180 ms of kernels on an H200 (2026-12-04),
#             gathering module by module; zero3-blocks keeps the model gathered and so gathers a block at a time
# more        the remaining arms and micro-batch 8 of the best arm: more.json
# Each step stops by DEADLINE_S seconds after the start (default 420), so that the lease's time is known ahead.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
steps=${1:-calibrate,ring,throughput}
deadline=$((SECONDS + ${2:-420}))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/install.txt" 2>&1 || { tail -5 "$OUT/install.txt"; exit 1; }
export PYTHONPATH=/tmp/site
left() { echo $((deadline - SECONDS)); }
# gpu_throughput.py's 1B Llama, for calibrate's GEMM shapes
model=$(cd benchmarks && python3 -c "import json, gpu_throughput; print(json.dumps(gpu_throughput.MODEL))")
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, deepspeed, datasets, accelerate, toolkit.cli
print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__,
      'datasets', datasets.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/versions.txt"
if [[ ,$steps, == *,calibrate,* ]]; then
    echo "== calibrate ($(left) s left)"
    timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m toolkit calibrate recipes/llama-tiny.yaml --hardware h200 \
        --nproc 1 --output "$OUT/hardware-h200-measured.yaml" --set "model.config=$model" --set precision=bf16 \
        --set data.max_length=2048 --set batch.micro_batch_size=4 --set model.tokenizer=.whl/tokenizer
    echo "calibrate rc $?"
fi
if [[ ,$steps, == *,ring,* ]]; then
    echo "== ring ($(left) s left)"
    # the toolkit's ring method on CUDA's flash kernel (bf16), 2 and 4 ranks sharing the one GPU over gloo, against
    # plain transformers on the whole sequence; allgather beside it, as the size of bf16's noise here
    for cp in 2 4; do
        PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node $cp \
            tests/reference/context_parallel.py "$OUT/cp$cp.json" ring,allgather cuda >"$OUT/cp$cp.log" 2>&1
        echo "cp $cp (rc $?): $(cat "$OUT/cp$cp.json" 2>/dev/null || grep -m3 -E "Error|error" "$OUT/cp$cp.log")"
    done 2>&1 | tee "$OUT/ring.txt"
fi
throughput() {  # ARMS JSON [more gpu_throughput.py options]
    local arms=$1 json=$2; shift 2
    echo "== throughput $arms $* ($(left) s left)"
    timeout $(left) python3 benchmarks/gpu_throughput.py --tokenizer .whl/tokenizer --arms "$arms" --steps 10 \
        --arm-timeout 200 --json "$OUT/$json" "$@"
    echo "throughput rc $?"
}
if [[ ,$steps, == *,throughput,* ]]; then
    throughput single,zero3,zero3-blocks,single+compile,fsdp,single+ac throughput.json --profile-dir /tmp/profile
    for f in /tmp/profile/*/ops.txt; do echo "== $f"; head -45 "$f"; done >"$OUT/ops.txt" 2>&1
    cat >/tmp/host_view.py <<'VIEW'
"""Where a profiled step's host time goes, from a torch.profiler chrome trace: the wall span of the profiled steps,
the host's synchronisations with the device (their count and the time they waited), the device's busy time, and
the user annotations and CPU ops of most total time. Issue 44: zero3 at world size 1 ran 584 ms a step on an H200
with 180 ms of kernels; a host that waits at each sync runs in series with the device."""
import json
import sys
from collections import defaultdict

events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
start = min(e["ts"] for e in timed)
end = max(e["ts"] + e["dur"] for e in timed)
print(f"profiled span {(end - start) / 1e3:.1f} ms")
by = defaultdict(lambda: [0, 0.0])
for e in timed:
    key = (e.get("cat"), e["name"])
    by[key][0] += 1
    by[key][1] += e["dur"] / 1e3
kernels = sum(v[1] for (cat, _), v in by.items() if cat in ("kernel", "gpu_memcpy", "gpu_memset"))
print(f"device busy {kernels:.1f} ms (kernels, copies, sets; overlaps not removed)")
syncs = [(k, v) for k, v in by.items() if k[0] == "cuda_runtime" and "ynchronize" in k[1]]
for (cat, name), (n, ms) in syncs:
    print(f"sync {name}: {n} calls, {ms:.1f} ms waited")
for cat in ("user_annotation", "cpu_op", "cuda_runtime"):
    top = sorted(((v[1], v[0], k[1]) for k, v in by.items() if k[0] == cat), reverse=True)[:15]
    print(f"-- {cat}: total ms, calls, name")
    for ms, n, name in top:
        print(f"{ms:10.1f} {n:7d}  {name[:100]}")
VIEW
    for arm in single zero3; do
        echo "== $arm"; python3 /tmp/host_view.py /tmp/profile/$arm/rank0.trace.json
    done >"$OUT/host.txt" 2>&1
fi
if [[ ,$steps, == *,more,* ]]; then
    throughput single+compile more-micro8.json --micro-batch 8
    throughput fsdp+compile,zero3+ac,fsdp+ac,zero3+compile more.json
fi
echo "done, $(left) s to the deadline"
