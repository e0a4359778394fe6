"""One rank of compare_overhead.py: the toolkit's training step and a minimal hand-written step of the same
strategy (plain DDP / fully_shard / deepspeed.initialize), on two identical models, alternating step by
step on the same micro-batches, so that machine noise hits both alike.

The toolkit side is the loop's own `train_step` plus its metrics.jsonl write; the minimal side is the
shortest correct step: forward, per-rank mean loss, backward, clip, AdamW, zero grads, one `.item()`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def minimal_setup(model, recipe, plan, *, zero_optimization: dict | None = None):
    """(module to call, engine or None, optimizer) for the hand-written side. It names strategies on
    purpose: it is the hand-written baseline a user would write without the toolkit, not toolkit code.
    `zero_optimization`: the toolkit's own block (its bucket sizes and persistence threshold), so that both sides
    run the same ZeRO: with DeepSpeed's defaults a small model's parameters stay whole on every rank (persistence
    threshold 1e5 elements), which is less work than the ZeRO-3 the toolkit runs, not less overhead."""
    strategy, optim = recipe.strategy, recipe.optim
    if strategy.name == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif strategy.name == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=strategy.reshard_after_forward)
        fully_shard(model, reshard_after_forward=strategy.reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, foreach=False)
    if strategy.name != "zero":
        return model, None, optimizer
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": plan.micro_batch_size, "gradient_accumulation_steps": 1,
        "zero_optimization": zero_optimization or {"stage": strategy.stage}, "gradient_clipping": optim.max_grad_norm,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9})
    return engine, engine, optimizer


def minimal_step(model, engine, optimizer, batch: dict, *, max_grad_norm: float) -> float:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    if engine is not None:
        engine.backward(loss)
        engine.step()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()  # the one device sync per step a loop needs to log its loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from toolkit.data.splits import Collator, train_loader
    from toolkit.process.dist import exit_process, init_distributed, shutdown
    from toolkit.launch.launcher import prepare_environment
    from toolkit.checkpoint.loading import ModelSource, num_parameters
    from toolkit.train.loop import setup_strategy, train_step
    from toolkit.train.prepare import prepare
    from toolkit.train import runinfo
    from toolkit.observe.metrics import JsonlWriter, process_bytes, synchronize
    from toolkit.model.build import build_model, padding_id
    from toolkit.config.files import load_recipe

    prepare_environment()
    recipe = load_recipe(args.recipe, args.overrides)
    env = init_distributed()
    prepared = prepare(recipe, env)
    plan, layout, strategy, tokenizer = prepared.plan, prepared.layout, prepared.strategy, prepared.tokenizer
    train_ds, sampler, total_steps = prepared.train_ds, prepared.sampler, prepared.total_steps
    assert plan.grad_accum_steps == 1, "the minimal step does not accumulate"
    # the allocator a rank of this recipe runs with (train.host_memory), for both sides
    prediction = runinfo.predict_memory(recipe, env, runtime_bytes=process_bytes())
    runinfo.set_host_memory(recipe, env, prediction=prediction)
    source = ModelSource(recipe=recipe, tokenizer=tokenizer)
    setup_strategy(strategy, strategy.build_model(source, env=env), source=source, env=env, plan=plan,
                   total_steps=total_steps)
    minimal = minimal_setup(build_model(recipe.model, tokenizer=tokenizer, seed=recipe.seed), recipe, plan,
                            zero_optimization=getattr(strategy, "config", {}).get("zero_optimization"))
    loader = train_loader(train_ds, sampler=sampler, start=0, stop=total_steps, data=recipe.data,
                          collator=Collator(pad_token_id=padding_id(tokenizer), task=recipe.model.task))
    scratch = Path(tempfile.mkdtemp(prefix="overhead-"))
    writer = JsonlWriter(scratch / "metrics.jsonl") if env.is_main else None
    # run.json as a run starts it (the first step's notes land there), in scratch
    info = runinfo.start(recipe, env=env, plan=plan, total_steps=total_steps, model=strategy.state.export_module(),
                         num_params=num_parameters(strategy.model), out_dir=scratch, prediction=prediction)
    times = {"toolkit": [], "minimal": []}

    def run_toolkit(step: int, batch: dict) -> None:
        record = train_step(strategy, [batch], recipe=recipe, env=env, layout=layout, step=step, info=info,
                            count_comm=False, gradient_scale=None, first=step == 1)
        if writer:
            writer.write(record)

    def run_minimal(step: int, batch: dict) -> None:
        minimal_step(*minimal, batch, max_grad_norm=recipe.optim.max_grad_norm)

    sides = [("toolkit", run_toolkit), ("minimal", run_minimal)]
    for step, batch in enumerate(loader, start=1):
        for name, run in sides if step % 2 else sides[::-1]:  # alternate who goes first
            synchronize(env.device)
            start = time.perf_counter()
            run(step, batch)
            synchronize(env.device)
            times[name].append(time.perf_counter() - start)
    if writer:
        writer.close()
    if env.is_main:
        Path(args.out).write_text(json.dumps({**times, "world_size": env.world_size}))
    shutdown(completed=True, release=strategy.close)
    exit_process(0)  # the toolkit's own end of a rank (see toolkit/process/dist.py)


if __name__ == "__main__":
    main()
