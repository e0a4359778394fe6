"""A plain PyTorch training script, written without any toolkit code: the independent reference.

Run it with torchrun at 1 or more ranks (gloo): every rank wraps the model in DistributedDataParallel,
takes its part of each global batch, accumulates with no_sync, and rank 0 writes the per-step losses,
grad norms and the final weights. It implements the toolkit's documented semantics from their
definitions, not from the toolkit's code:
  - samples of optimizer step k: positions [k·G, (k+1)·G) of torch.randperm(n) drawn from a generator
    seeded with seed·1000003 + epoch (README "Runs are comparable by construction")
  - loss: the global-batch mean, token-weighted for causal LM (every label token of the global batch
    counts once), sample-weighted for classification
  - AdamW with weight decay on ≥2-D parameters only; linear warm-up lr·(k+1)/(w+1), then cosine to 0
  - clip_grad_norm_ at max_grad_norm, the norm logged before clipping

    torchrun --nproc_per_node N plain_training.py --model DIR --data FILE --task causal-lm --out DIR ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--task", choices=["causal-lm", "sequence-classification"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around forward")
    return p.parse_args()


def global_batch(step: int, *, n: int, size: int, seed: int) -> list[int]:
    per_epoch = n // size
    epoch, pos = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[pos * size:(pos + 1) * size].tolist()


def lr_at(step: int, *, lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [json.loads(line) for line in open(args.data)]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    causal = args.task == "causal-lm"
    torch.manual_seed(args.seed)
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    model = auto.from_pretrained(args.model)
    for module in model.modules():  # dropout off: an exact comparison
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    per_rank = args.global_batch // world
    log = []
    for step in range(args.steps):
        indices = global_batch(step, n=len(rows), size=args.global_batch, seed=args.seed)
        mine = indices[rank * per_rank:(rank + 1) * per_rank]
        micro = [mine[i:i + args.micro_batch] for i in range(0, per_rank, args.micro_batch)]
        batches = []
        for chunk in micro:
            enc = tokenizer([rows[i]["text"] for i in chunk], truncation=True, max_length=args.max_length,
                            padding=True, return_tensors="pt")
            if causal:
                labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
                count = int((labels[:, 1:] != -100).sum())
            else:
                labels = torch.tensor([int(rows[i]["label"]) for i in chunk])
                count = len(chunk)
            batches.append((enc, labels, count))
        total = torch.tensor([float(sum(c for _, _, c in batches))])
        dist.all_reduce(total)  # the loss terms of the whole global batch
        step_loss = torch.zeros(())
        for index, (enc, labels, _) in enumerate(batches):
            sync = index == len(batches) - 1
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                with autocast:
                    logits = ddp(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                logits = logits.float()
                if causal:
                    loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
                else:
                    loss_sum = F.cross_entropy(logits, labels, reduction="sum")
                # DDP averages over ranks: scale by the world size so the result is the global-batch mean
                (loss_sum / total * world).backward()
            step_loss += loss_sum.detach()
        dist.all_reduce(step_loss)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=args.lr, warmup=args.warmup, total=args.steps)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"step": step + 1, "loss": float(step_loss / total), "grad_norm": float(norm)})
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "steps.json"), "w") as handle:
            json.dump(log, handle)
        model.save_pretrained(os.path.join(args.out, "model"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
