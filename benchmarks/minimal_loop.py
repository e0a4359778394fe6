"""A minimal hand-written training loop (plain DDP / fully_shard / deepspeed.initialize) for
compare_overhead.py: the same model config, batch and AdamW as the recipe, nothing else."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml


def batches(recipe: dict, tokenizer, *, micro: int, steps: int, rank: int):
    texts = [json.loads(l)["text"] for l in open(recipe["data"]["train"])]
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        picks = torch.randint(len(texts), (micro,), generator=generator).tolist()
        yield tokenizer([texts[i] for i in picks], truncation=True, max_length=recipe["data"]["max_length"],
                        padding=True, return_tensors="pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from toolkit.model import resolve_path  # only to find the packaged tokenizer folder

    recipe = yaml.safe_load(open(args.recipe))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_path(recipe["model"]["tokenizer"])))
    fields = dict(recipe["model"]["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    micro, lr = recipe["batch"]["micro_batch_size"], recipe["optim"]["lr"]
    engine = None
    if args.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if args.strategy.startswith("zero"):
        import deepspeed

        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(args.strategy[-1])}, "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9})
        model = engine
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    times = []
    for batch in batches(recipe, tokenizer, micro=micro, steps=args.steps, rank=rank):
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # the same one sync per step the toolkit makes for its logged loss
        times.append(time.perf_counter() - start)
    if rank == 0:
        json.dump({"step_time_s": times, "world_size": world}, open(args.out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
