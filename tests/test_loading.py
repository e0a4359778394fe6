"""Low-memory loading: fsdp and zero stage 3 build the model empty (FSDP2: on the meta device, sharded, then
each rank loads its shards) or partitioned as it is created (ZeRO-3: zero.Init through transformers), and no
rank holds the whole model. What they start from must be exactly what a plain transformers build gives: one
torchrun job sets each case up and compares its gathered weights with from_pretrained / from_config, element
for element (tests/reference/loaded_weights.py). Training from those weights equals single: the fsdp and zero3
equivalence tests (test_sharded.py, test_tensor_parallel.py, test_checkpoints.py) all run through this path."""

import json
import subprocess
import sys

from conftest import MINILM, REPO, toolkit_env, write_recipe

SLICES = "each rank read only its slices of the pretrained safetensors files"
RANK0 = "rank 0 built the whole model and broadcast it tensor by tensor"
ZERO_INIT = "each parameter partitioned as it was created (zero.Init), filled one module at a time"
# name -> (recipe, overrides, how the weights must have been loaded)
CASES = {
    "fsdp-tied": ("tied", ("strategy.name=fsdp",), SLICES),  # the tied head is read once, as the embedding
    "fsdp-tp2-bf16": ("tied", ("strategy.name=fsdp", "strategy.tp_degree=2", "model.load_dtype=bf16"), SLICES),
    "fsdp-minilm": ("minilm", ("strategy.name=fsdp",), RANK0),  # from_pretrained adds a seeded head: rank 0's
    "fsdp-config": ("config", ("strategy.name=fsdp",), RANK0),  # a model from a config: seeded on rank 0
    "zero3-tied": ("tied", ("strategy.name=zero", "strategy.stage=3"), ZERO_INIT),
    "zero3-minilm": ("minilm", ("strategy.name=zero", "strategy.stage=3"), ZERO_INIT),
    "zero3-config": ("config", ("strategy.name=zero", "strategy.stage=3"), ZERO_INIT),
}


def test_sharded_strategies_start_from_exactly_the_weights_transformers_loads(tmp_path, tiny_tied_llama_dir):
    recipes = {
        "tied": write_recipe(tmp_path / "tied.yaml", model_dir=tiny_tied_llama_dir, output_dir=tmp_path / "o"),
        "minilm": write_recipe(tmp_path / "minilm.yaml", model_dir=MINILM, task="sequence-classification",
                               output_dir=tmp_path / "o"),
        "config": write_recipe(tmp_path / "config.yaml", model_dir=tiny_tied_llama_dir, output_dir=tmp_path / "o",
                               model={"path": None, "tokenizer": str(tiny_tied_llama_dir), "config": {
                                   "model_type": "llama", "vocab_size": 30522, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "tie_word_embeddings": True}}),
    }
    cases = {name: [str(recipes[recipe]), *overrides] for name, (recipe, overrides, _) in CASES.items()}
    out = tmp_path / "loaded.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests" / "reference" / "loaded_weights.py"), str(out), json.dumps(cases)],
                          cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    results = json.loads(out.read_text())
    for name, (_, _, how) in CASES.items():
        weights = results[name]["weights"]
        assert results[name]["layout"].endswith(f"weights: {how}"), (name, results[name]["layout"])
        assert weights["compared"] >= 20 and not weights["missing"] and not weights["extra"], (name, weights)
        assert weights["num_differing"] == 0, (name, weights)
        # the export names each tensor as transformers' own save does: ZeRO-3 wrote MiniLM's LayerNorm.weight as
        # the legacy LayerNorm.gamma (transformers' ZeRO-3 load keeps renamings it did not use)
        assert results[name]["export_names"] == results[name]["want_export_names"], name
        # the optimizer's weight-decay groups see each parameter's own shape, also ZeRO-3's empty placeholders
        assert results[name]["param_groups"] == results[name]["want_groups"], (name, results[name])
