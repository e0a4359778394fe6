"""A minimal hand-written training loop for compare_overhead.py: plain DDP / fully_shard /
deepspeed.initialize around the same model, the same AdamW and the same micro-batches as the toolkit.

Only the inputs come from the toolkit (resolved recipe, model build, and the sampler + collator, so
both loops see identical batches step for step); the step itself is the shortest correct one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from toolkit.data import Collator, GlobalBatchSampler, load_split, train_loader
    from toolkit.dist import init_distributed
    from toolkit.model import build_model, load_tokenizer
    from toolkit.recipe import load_recipe, plan_batch

    recipe = load_recipe(args.recipe, args.overrides)
    env = init_distributed()
    plan = plan_batch(recipe.batch, world_size=env.world_size)
    assert plan.grad_accum_steps == 1, "the minimal loop does not accumulate"
    tokenizer = load_tokenizer(recipe.model)
    dataset = load_split(recipe.data.train, data=recipe.data, task=recipe.model.task, tokenizer=tokenizer, env=env)
    sampler = GlobalBatchSampler(num_samples=len(dataset), plan=plan, rank=env.rank, seed=recipe.seed)
    steps = recipe.train.max_steps
    loader = train_loader(dataset, sampler=sampler, start=0, stop=steps, data=recipe.data,
                          collator=Collator(pad_token_id=tokenizer.pad_token_id, task=recipe.model.task))
    model = build_model(recipe.model, tokenizer=tokenizer, seed=recipe.seed)
    strategy, lr = recipe.strategy, recipe.optim.lr
    engine = None
    if strategy.name == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif strategy.name == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=strategy.reshard_after_forward)
        fully_shard(model, reshard_after_forward=strategy.reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=recipe.optim.weight_decay, foreach=False)
    if strategy.name == "zero":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": plan.micro_batch_size, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": strategy.stage}, "gradient_clipping": recipe.optim.max_grad_norm,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9})
        model = engine
    times = []
    for batch in loader:  # fetched outside the timed region, as in the toolkit
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # the one device sync per step a loop needs to log its loss
        times.append(time.perf_counter() - start)
    if env.is_main:
        with open(args.out, "w") as f:
            json.dump({"step_time_s": times, "world_size": env.world_size}, f)
    dist.destroy_process_group()
    if engine is not None:
        os._exit(0)  # DeepSpeed's CPU comm threads can abort interpreter teardown (see toolkit/cli.py)


if __name__ == "__main__":
    main()
