"""The resident-memory cost of one micro-batch's forward + loss + backward, measured without any toolkit code.

    python activation_peak.py --config JSON --micro 4 --seq 256 --cases fp32,autocast,cast,fp32+checkpointing
    (fp32+selective: selective checkpointing)

Big tensors are given their own mappings (M_MMAP_THRESHOLD 64 KiB), so memory freed is memory returned and the
peak resident set tracks the live tensors. One warm-up pass loads kernels and thread pools; the peak resident
set is then reset (/proc/self/clear_refs) and one more pass measured: its peak above the resident set before
it, gradients dropped as they arrive (the planner counts them as model states). The loss: the fp32 causal LM
cross-entropy sum over the next tokens, written here from its definition. Modes: fp32; autocast (fp32 weights,
bf16 autocast); cast (bf16 weights). Prints {case: bytes} as JSON, each case a model of its own.
"""

import argparse
import ctypes
import json

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM


def status(key: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ":"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    print(json.dumps({case: measure(case, args) for case in args.cases.split(",")}))


def keep_every_other_matmul():
    """Selective checkpointing from its definition: a block's forward keeps the output of its attention kernel and
    of its 1st, 3rd, ... matmul (mm or addmm), everything else is recomputed in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default}
    attention = {aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_attention_math.default}
    seen = {False: 0, True: 0}  # forward's matmuls, and a recomputation's (torch before 2.13 asks again there)

    def policy(ctx, func, *args, **kwargs):
        if func in matmuls:
            seen[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if seen[ctx.is_recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def measure(case: str, args) -> int:
    mode, _, checkpointing = case.partition("+")
    torch.manual_seed(0)
    config = AutoConfig.for_model(**json.loads(args.config))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if mode == "cast" else torch.float32)
    model.train()
    if checkpointing == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif checkpointing == "selective":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": keep_every_other_matmul})
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = torch.randint(0, config.vocab_size, (args.micro, args.seq))

    def one_pass() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = model(input_ids=ids).logits
        targets = torch.cat([ids[:, 1:], torch.full((args.micro, 1), -100)], dim=1)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), targets.reshape(-1), reduction="sum")
        del logits
        loss.backward()

    one_pass()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak resident set starts again from now
    one_pass()
    return status("VmHWM") - before


if __name__ == "__main__":
    main()
