"""The DeepSpeed JSON passthrough: "auto" values take the recipe's numbers; a contradiction exits 2."""

import json

import pytest

from conftest import REPO, write_recipe
from toolkit.cli import main
from toolkit.config.files import load_recipe
from toolkit.config.recipe import plan_batch
from toolkit.errors import RecipeError
from toolkit.strategies.zero.config import resolve_ds_config


def _recipe(tmp_path, tiny_llama_dir, ds_config, *, optim=None, **sections):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                        strategy={"name": "zero", "ds_config": str(ds_config)},
                        batch={"micro_batch_size": 2, "grad_accum_steps": 3}, precision="bf16",
                        optim={"max_grad_norm": 0.5, **(optim or {})}, **sections)
    return path, load_recipe(path)


def test_shipped_json_autos_resolve_to_the_recipe(tmp_path, tiny_llama_dir):
    _, recipe = _recipe(tmp_path, tiny_llama_dir, REPO / "ds_configs" / "zero3-offload.json")
    config = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=2))
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload"])
def test_shipped_jsons_size_their_buckets_as_the_generated_config_does(tmp_path, tiny_llama_dir, name):
    """Left out, a bucket size is DeepSpeed's 5e8 elements: ZeRO-3 held a 2,009,265,920-byte fp32 gradient bucket
    per rank for the 4.6M-parameter Llama (the plan: 2,997 MiB a rank, where the generated config's 1,102). The
    shipped JSONs say "auto", filled from the model's hidden size (here 256) as the config the recipe generates."""
    _, recipe = _recipe(tmp_path, tiny_llama_dir, REPO / "ds_configs" / f"{name}.json")
    zero = resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=2), hidden_size=256)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 256 * 256
    if zero["stage"] == 3:
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 256 * 256)
        assert zero["stage3_param_persistence_threshold"] == 10 * 256


@pytest.mark.parametrize("key, value, words", [
    ("gradient_accumulation_steps", 4, "gradient_accumulation_steps is 4 but the recipe gives 3"),
    ("train_micro_batch_size_per_gpu", 8, "train_micro_batch_size_per_gpu is 8 but the recipe gives 2"),
    ("bf16", {"enabled": False}, "bf16.enabled is False but the recipe gives True"),
])
def test_contradicting_json_exits_2(tmp_path, tiny_llama_dir, capsys, key, value, words):
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config[key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    path, recipe = _recipe(tmp_path, tiny_llama_dir, bad)
    with pytest.raises(RecipeError, match=words):
        resolve_ds_config(recipe, plan_batch(recipe.batch, world_size=2))
    assert main(["validate", "--nproc", "2", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and str(bad) in err[0]


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", "holds list, not a JSON object"),
    ('{"zero_optimization": [2]}', "zero_optimization must be a JSON object"),
    ('{"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}',
     "zero_optimization.offload_optimizer must be a JSON object"),
])
def test_a_json_of_the_wrong_shape_is_one_line(tmp_path, tiny_llama_dir, capsys, text, words):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    path, _ = _recipe(tmp_path, tiny_llama_dir, bad)
    assert main(["validate", "--nproc", "2", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_recipe_stage_contradicting_json_exits_2(tmp_path, tiny_llama_dir, capsys):
    path, _ = _recipe(tmp_path, tiny_llama_dir, REPO / "ds_configs" / "zero2.json")
    assert main(["validate", "--nproc", "2", str(path), "--set", "strategy.stage=3"]) == 2
    assert "strategy.stage is 3 but" in capsys.readouterr().err


def test_a_json_from_the_transformers_docs_runs_as_it_is(tmp_path, tiny_llama_dir):
    """The ZeRO-2 offload JSON of transformers' DeepSpeed documentation, unchanged: DeepSpeed builds the AdamW and
    WarmupLR it names, every "auto" filled from the recipe, and the run says what really ran."""
    from conftest import run_cli

    config = REPO / "ds_configs" / "hf-docs-zero2-offload.json"
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          strategy={"name": "zero", "ds_config": str(config)},
                          optim={"lr": 1.0e-3, "warmup_steps": 3}, train={"max_steps": 5})
    result = run_cli("train", str(recipe))  # one rank: DeepSpeed gets a process group of one
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"DeepSpeed builds the optimizer AdamW and scheduler WarmupLR of {config}" in result.stderr
    # WarmupLR's constructor reads its lr before step 1 and logs (DeepSpeed's logger: stdout) that it did, every
    # rank, every run: left out
    assert "before it has started" not in result.stdout + result.stderr, result.stdout[-3000:]
    audit = json.loads((out / "run.json").read_text())["precision_audit"]
    assert audit["optimizer"] == "DeepSpeed fused CPU Adam (AdamW), offloaded"
    assert audit["scheduler"] == "DeepSpeed WarmupLR"
    # DeepSpeed's WarmupLR (log warm-up, its default): lr = max_lr · ln(k + 1) / ln(warmup) at its k-th step,
    # k = -1 before the first (lr 0), then max_lr from k = warmup on; max_lr was "auto": the recipe's 1e-3
    import math

    expected = [0.0] + [1e-3 * min(1.0, math.log(k + 1) / math.log(3)) for k in range(4)]
    assert [m["lr"] for m in metrics_of(out)] == pytest.approx(expected, rel=1e-9, abs=1e-15)


def metrics_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("block, words", [
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 1e-3}}},
     "scheduler.params.cycle_min_lr is \"auto\", which the toolkit cannot fill"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}}, "optimizer.params.lr is 3e-05 but the recipe gives"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, "optimizer.params.betas is [0.9, 0.95]"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}},
     "scheduler.params.warmup_num_steps is 100 but the recipe gives 0"),
    ({"communication_data_type": "auto"}, "communication_data_type is \"auto\""),
    # the recipe's warm-up (0) where the JSON says "auto": DeepSpeed's WarmupLR refused it in every rank at set-up
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
     "DeepSpeed's WarmupLR needs scheduler.params.warmup_num_steps of 1 or more (it warms up over at least 2 "
     "steps), not 0; set optim.warmup_steps to 1 or more"),
])
def test_json_blocks_the_recipe_cannot_fill_or_that_contradict_it_are_one_line(tmp_path, tiny_llama_dir, capsys,
                                                                               block, words):
    config = {**json.loads((REPO / "ds_configs" / "zero2.json").read_text()), **block}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(config))
    path, _ = _recipe(tmp_path, tiny_llama_dir, bad, optim={"warmup_steps": 0})
    assert main(["validate", "--nproc", "2", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and str(bad) in err[0], err


def test_a_compare_names_the_optimizer_and_scheduler_that_differ():
    from toolkit.compare.verdict import setting_differences

    recipe = {"strategy": {"name": "zero"}, "optim": {"lr": 1e-3}}
    ours = {"recipe": recipe, "audit": {"optimizer": "DeepSpeed fused CPU Adam (AdamW), offloaded",
                                        "scheduler": "DeepSpeed WarmupLR"}}
    reference = {"recipe": recipe, "audit": {"optimizer": "torch AdamW (fused)",
                                             "scheduler": "toolkit: 2 warm-up steps, then cosine (LambdaLR)"}}
    assert setting_differences(ours, reference) == [
        "audit optimizer: DeepSpeed fused CPU Adam (AdamW), offloaded vs torch AdamW (fused)",
        "audit scheduler: DeepSpeed WarmupLR vs toolkit: 2 warm-up steps, then cosine (LambdaLR)"]


@pytest.mark.parametrize("launched, count", [({"LOCAL_WORLD_SIZE": "3"}, 3), ({}, 1)])
def test_deepspeeds_cpu_accelerator_counts_the_ranks_without_a_subprocess(monkeypatch, launched, count):
    """Without LOCAL_SIZE (DeepSpeed's own launcher sets it), the CPU accelerator's device_count runs `numactl` in a
    subprocess, and ZeRO-3 asks it once per gradient bucket it reduces: a ZeRO process tells it this machine's ranks
    (torch.distributed.run's LOCAL_WORLD_SIZE, or 1 without a launcher), so that no step forks a subprocess."""
    import os
    import subprocess

    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from toolkit.strategies.zero.comm import tell_local_size

    environ = {k: v for k, v in os.environ.items() if k not in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE")}
    monkeypatch.setattr(os, "environ", {**environ, **launched})

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "check_output", no_subprocess)
    tell_local_size()
    assert CPU_Accelerator().device_count() == count


def test_zero3_takes_blocks_as_units_only_where_the_step_keeps_the_whole_model_gathered_either_way():
    """order.block_units (one rank; engine.gather_blocks_whole marks them, the plan predicts with them): each block
    a DeepSpeed leaf where the plan's gathered bytes hold both ways (the model within half the reuse distance and
    the live limit); DeepSpeed's own units past that, where a ds_config sets the granularity, parameters go to
    NVMe or any is frozen, and at 2+ ranks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.strategies.zero.engine import gather_blocks_whole
    from toolkit.strategies.zero.order import block_units

    def built():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                            num_attention_heads=2, num_key_value_heads=1))

    def leaves(model) -> list[str]:
        return [name for name, m in model.named_modules() if getattr(m, "_z3_leaf", False)]

    def said(model, zero: dict, world_size: int = 1) -> str:
        blocks, text = block_units(model, {"zero_optimization": {"stage": 3, **zero}}, world_size=world_size)
        assert bool(blocks) == text.startswith("a block's"), text
        return text

    model = built()
    numel = sum(p.numel() for p in model.parameters())
    assert gather_blocks_whole(model, {"zero_optimization": {"stage": 3}}, world_size=1) == \
        "a block's parameters at once (3 LlamaDecoderLayer)"
    assert leaves(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    model = built()
    assert gather_blocks_whole(model, {"zero_optimization": {"stage": 3}}, world_size=2) == "" and not leaves(model)
    # the whole model within half the reuse distance: blocks; one element past it, or past the live limit: not
    for zero, start in [({"stage3_max_reuse_distance": 2 * numel}, "a block's parameters at once"),
                        ({"stage3_max_reuse_distance": 2 * numel - 2}, f"module by module ({numel:,} parameters"),
                        ({"stage3_max_live_parameters": numel - 1}, f"module by module ({numel:,} parameters"),
                        ({"stage3_module_granularity_threshold": 0}, "module by module (the ds_config's"),
                        ({"offload_param": {"device": "nvme"}}, "module by module (parameters offloaded to NVMe)")]:
        assert said(built(), zero).startswith(start), zero
    # a model built inside zero.Init holds empty tensors; DeepSpeed keeps each parameter's size in ds_numel
    model = built()
    for param in model.parameters():
        param.ds_numel = param.numel()
        param.data = torch.empty(0)
    assert said(model, {"stage3_max_reuse_distance": 2 * numel - 2}).startswith(f"module by module ({numel:,} param")
    model = built()
    model.model.embed_tokens.weight.requires_grad_(False)
    assert said(model, {}) == "module by module (frozen parameters)"


def test_a_leaf_blocks_gradients_reach_the_buckets_together_where_its_backward_ends():
    """order.leaf_backward (DeepSpeed 0.19's hook on a leaf module's backward): a block's gradients in the
    optimizer's group order (matrices, then norms), where backward finishes its last, after the next block's and
    before the embedding's; a block parameter backward never reaches (DeepSpeed zero-fills its gradient) stays
    with its block, not at the end, where ParamOrder puts what backward left unfinished."""
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.config.recipe import OptimConfig
    from toolkit.strategies.optim.adamw import param_groups
    from toolkit.strategies.zero.order import leaf_backward, whole_order

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    model.model.layers[0].unused = nn.Parameter(torch.zeros(3, 3))
    names = [name for name, _ in model.named_parameters()]
    order = whole_order(model)
    assert names[order.backward[-1]] == "model.layers.0.unused"  # left unfinished: last
    got = [names[i] for i in leaf_backward(model, order, list(model.model.layers),
                                           [g["params"] for g in param_groups(model, OptimConfig())])]
    assert sorted(got) == sorted(names)
    layer = [[n for n in got if n.startswith(f"model.layers.{b}.")] for b in (0, 1)]
    start = got.index(layer[1][0])
    assert got[start:start + len(layer[1]) + len(layer[0])] == layer[1] + layer[0]  # block 1's, then block 0's
    assert got[-1] == "model.embed_tokens.weight"  # its gradient finishes after the first block's backward
    # the matrices (the unused one first: a module's own parameters come before its children's), then the norms
    assert layer[0] == ["model.layers.0.unused", *(f"model.layers.0.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"))]
