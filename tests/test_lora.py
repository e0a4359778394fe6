"""model.lora (peft): the same LoRA training under single, ddp, fsdp, zero2 and zero3 (fp32, same global batch),
only the adapters holding gradients and optimizer state, and exports peft and transformers load."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import losses, write_recipe
from toolkit.cli import main

R, ALPHA, TARGETS = 4, 8, ("q_proj", "v_proj")
LORA = (f"model.lora={{r: {R}, alpha: {ALPHA}, target_modules: [{', '.join(TARGETS)}], merge_on_export: true}}",)
M4 = ("batch.micro_batch_size=4",)
ARMS = {  # name -> (ranks, overrides); global batch 8 everywhere
    "single": (1, ()),
    "ddp": (2, ("strategy.name=ddp", *M4)),
    "fsdp": (2, ("strategy.name=fsdp", *M4)),
    "zero2": (2, ("strategy.name=zero", "strategy.stage=2", *M4)),
    "zero3": (2, ("strategy.name=zero", "strategy.stage=3", *M4)),
    # one rank: ZeRO-3 keeps DeepSpeed's module-by-module gathers where any weight is frozen (engine.py's
    # gather_blocks_whole; a block gathered whole lost its frozen weights before their backward)
    "zero3-1rank": (1, ("strategy.name=zero", "strategy.stage=3")),
}


def lora_run(llama_runs, arm: str):
    ranks, overrides = ARMS[arm]
    return llama_runs.get(f"lora-{arm}", nproc=ranks, overrides=(*overrides, *LORA))


def adapter_numel(model_dir) -> int:
    """Trainable elements, by hand from the model's config: r × (in + out) per adapted layer."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_out = config["num_key_value_heads"] * hidden // heads
    per_block = R * (hidden + hidden) + R * (hidden + kv_out)  # q_proj: hidden → hidden, v_proj: hidden → kv
    return per_block * config["num_hidden_layers"]


@pytest.mark.parametrize("arm", [a for a in ARMS if a != "single"])
def test_lora_trains_the_same_under_every_strategy_fp32(llama_runs, arm):
    reference, run = lora_run(llama_runs, "single"), lora_run(llama_runs, arm)
    torch.testing.assert_close(torch.tensor(losses(run), dtype=torch.float64),
                               torch.tensor(losses(reference), dtype=torch.float64), rtol=1e-5, atol=0)
    ours, theirs = load_file(run / "model" / "adapter_model.safetensors"), \
        load_file(reference / "model" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 2 * 2  # A and B, 2 targets, 2 blocks
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arm", ["fsdp", "zero3"])
def test_merged_export_of_sharded_strategies_equals_single(llama_runs, arm):
    ours = load_file(lora_run(llama_runs, arm) / "model-merged" / "model.safetensors")
    theirs = load_file(lora_run(llama_runs, "single") / "model-merged" / "model.safetensors")
    assert ours.keys() == theirs.keys() and not any("lora" in k or "base_layer" in k for k in ours)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arm", list(ARMS))
def test_only_adapters_hold_gradients_and_optimizer_state(llama_runs, tiny_llama_dir, arm):
    run = json.loads((lora_run(llama_runs, arm) / "run.json").read_text())
    total = adapter_numel(tiny_llama_dir) * 4  # fp32 bytes
    grads = sum(r["grads_bytes"] for r in run["model_state_bytes"])
    if arm in ("single", "ddp"):  # every rank holds all adapters: their gradients and two Adam moments
        assert all(r["grads_bytes"] == total and r["optim_bytes"] == 2 * total for r in run["model_state_bytes"])
    elif arm == "fsdp":  # sharded: the ranks' gradients add up to the adapters (each a multiple of 2 rows)
        assert grads == total
    else:  # ZeRO: fp32 masters + moments of a partition of the adapters; gradients far below the base model
        assert sum(r["optim_bytes"] for r in run["model_state_bytes"]) == 3 * total
    assert all(r["grads_bytes"] < run["model_state_bytes"][0]["params_bytes"] / 100 for r in run["model_state_bytes"])
    assert run["memory_prediction"]["model_state_bytes"] == run["model_state_bytes"]


def test_merged_weights_are_base_plus_scaled_adapter_product_and_peft_loads_the_adapter(llama_runs, tiny_llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = lora_run(llama_runs, "single")
    base, adapter = load_file(tiny_llama_dir / "model.safetensors"), load_file(run / "model" / "adapter_model.safetensors")
    merged = load_file(run / "model-merged" / "model.safetensors")
    for key, weight in base.items():
        layer = key.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{layer}.lora_A.weight")
        # plain PyTorch: W + (alpha / r) · B @ A for adapted layers; every other tensor untouched (frozen)
        want = weight if a is None else weight + (ALPHA / R) * adapter[f"base_model.model.{layer}.lora_B.weight"] @ a
        torch.testing.assert_close(merged[key], want, rtol=1e-6, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(run / "model-merged")(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), run / "model")
        torch.testing.assert_close(adapted(input_ids=ids).logits, plain, rtol=1e-5, atol=1e-5)


CASES = {
    "target that matches nothing": ({"lora": {"target_modules": ["query_proj"]}}, (), "query_proj"),
    "rank zero": ({"lora": {"r": 0}}, (), "model.lora.r must be a positive rank"),
    # an output layer tied to the input embedding (tiny_tied_llama_dir): its merged adapter would change the
    # embedding too, which the trained model never had (and the adapter's export failed on the shared weight)
    "tied output layer": ({"lora": {"target_modules": ["q_proj", "lm_head"]}}, (),
                          "model.lora.target_modules: lm_head shares its weight with the input embedding"),
    "under tensor parallel": ({"lora": {"r": 4}}, ("strategy.name=tp",), "not available with strategy tp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_bad_input_is_one_line(case, tmp_path, tiny_llama_dir, tiny_tied_llama_dir, capsys):
    model, overrides, words = CASES[case]
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_tied_llama_dir if "tied" in case else tiny_llama_dir,
                          output_dir=out, model=model)
    code = main(["validate", str(recipe), *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_the_merged_export_leaves_the_trained_model_as_it_was(tmp_path, tiny_llama_dir):
    """On CPU the export reads the live weights in place: merging the adapters for model-merged must not add
    them into the trained model's own base weights (which would then apply them twice)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.model.export import export_adapter
    from toolkit.model.lora import apply_lora
    from toolkit.config.recipe import LoraOptions
    from toolkit.strategies.base import cpu_state_dict

    options = LoraOptions(r=4, alpha=8, target_modules=("q_proj", "v_proj"), merge_on_export=True)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), options, task="causal-lm")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # a trained adapter: B is zero at start
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_dict = cpu_state_dict(model)
    assert all(state_dict[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())  # in place
    export_adapter(model, state_dict, options=options, task="causal-lm",
                   tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir), adapter_dir=tmp_path / "adapter",
                   merged_dir=tmp_path / "merged")
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[key], before["model.layers.0.self_attn.q_proj.base_layer.weight"])


def test_a_target_that_matches_nothing_names_the_layers_peft_adapts_also_gpt2s_conv1d(capsys):
    """GPT-2's attention and MLP are transformers' Conv1D, which peft adapts: the line named only lm_head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.errors import RecipeError
    from toolkit.model.lora import apply_lora
    from toolkit.config.recipe import LoraOptions

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(RecipeError, match=r"this model's linear layers are named c_attn, c_fc, c_proj, lm_head$"):
        apply_lora(model, LoraOptions(r=4, target_modules=("q_proj",)), task="causal-lm")
    with pytest.raises(RecipeError, match=r"above the width of every layer of the model \(at most 32\)"):
        apply_lora(model, LoraOptions(r=33, target_modules=("c_attn",)), task="causal-lm")
