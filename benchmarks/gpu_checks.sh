#!/usr/bin/env bash
# The GPU checks of the open issues in one script, for one short lease of a one-GPU machine without internet
# (the device tool): the wheels and tokenizer that benchmarks/offline_wheels.sh gathers into .whl/ travel with it.
#
#     bash benchmarks/gpu_checks.sh [calibrate,ring,throughput,more] [DEADLINE_S]    # results under $OUT
#
# calibrate   toolkit calibrate --hardware h200 on gpu_throughput.py's 1B model (issue 48): hardware-h200-measured.yaml
# ring        torch's context_parallel (the ring method) over a HF Llama's SDPA at cp=1 on CUDA, against the plain
#             forward and backward (issue 47): ring.txt. Seen on an H200 (torch 2.11, 2026-12-04): flash and cuDNN
#             equal to the plain step (cuDNN bit-equal, flash 3e-5 of 1.2e-2 in bf16); the memory-efficient kernel
#             refuses GQA's unequal head counts in the plain step too
# throughput  gpu_throughput.py's single, fsdp, zero3, single+ac, single+compile with a profile of two late steps
#             each (issues 44 and 48): throughput.json, ops.txt, and host.txt: single's and zero3's host view of
#             those steps (the span, the device's busy time, the host's waits at synchronisations, the ops of most
#             host time): zero3 at world size 1 ran 584 ms a step with 180 ms of kernels on an H200 (2026-12-04)
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
    cat >/tmp/ring_probe.py <<'PROBE'
"""Does torch's context_parallel (ring attention) run a HF Llama's SDPA attention on CUDA at cp=1, and equal the
plain forward/backward? Issue 47's GPU check of the ring path's wiring."""
import os, sys, traceback
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1)
from torch.distributed.tensor.experimental import context_parallel
from transformers import LlamaConfig, LlamaForCausalLM
print("torch", torch.__version__)
cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
ids = torch.randint(0, 1000, (2, 1024), device="cuda")
labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
pos = torch.arange(1024, device="cuda").expand(2, -1).contiguous()
mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))

def step(cp, backend):
    model.zero_grad(set_to_none=True)
    i, l, p = ids.clone(), labels.clone(), pos.clone()
    with sdpa_kernel(backend):
        if cp:
            with context_parallel(mesh, buffers=[i, l, p], buffer_seq_dims=[1, 1, 1]):
                logits = model(input_ids=i, position_ids=p).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), l.flatten(), ignore_index=-100)
                loss.backward()
        else:
            logits = model(input_ids=i, position_ids=p).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), l.flatten(), ignore_index=-100)
            loss.backward()
    return loss.item(), torch.cat([q.grad.float().flatten() for q in model.parameters()])

for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                      ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
    try:
        base_loss, base_grad = step(False, backend)
        loss, grad = step(True, backend)
        print(f"ring cp=1 {name}: loss {loss:.6f} vs plain {base_loss:.6f}; grad max|diff| "
              f"{(grad - base_grad).abs().max().item():.3e} of max {base_grad.abs().max().item():.3e}", flush=True)
    except Exception as exc:
        print(f"ring cp=1 {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        traceback.print_exc(limit=3)
dist.destroy_process_group()
PROBE
    timeout 90 python3 /tmp/ring_probe.py 2>&1 | tee "$OUT/ring.txt" | grep -v Warning | tail -30
fi
throughput() {  # ARMS JSON [more gpu_throughput.py options]
    local arms=$1 json=$2; shift 2
    echo "== throughput $arms $* ($(left) s left)"
    timeout $(left) python3 benchmarks/gpu_throughput.py --tokenizer .whl/tokenizer --arms "$arms" --steps 10 \
        --arm-timeout 200 --json "$OUT/$json" "$@"
    echo "throughput rc $?"
}
if [[ ,$steps, == *,throughput,* ]]; then
    throughput single,zero3,single+compile,fsdp,single+ac throughput.json --profile-dir /tmp/profile
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
