"""The exported folder loads with plain transformers and gives the trained model's logits."""

import torch
from transformers import AutoModelForCausalLM

from conftest import write_recipe
from toolkit.dist import DistEnv
from toolkit.loop import train
from toolkit.recipe import load_recipe


def test_exported_model_loads_with_plain_transformers(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                                      train={"max_steps": 3}))
    result = train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    trained = result.strategy.export_module().eval()
    loaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert (out / "model" / "model.safetensors").is_file() and not (out / ".model.partial").exists()
    ids = torch.tensor([[101, 2023, 3185, 2001, 2307, 102]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)
    # and it really trained: the export is not the initial checkpoint
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        assert not torch.equal(initial(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert (out / "recipe.yaml").is_file() and (out / "run.json").is_file()


def test_tied_embedding_is_exported_once_and_reloads_tied(tmp_path, tiny_tied_llama_dir):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_tied_llama_dir, output_dir=out,
                                      train={"max_steps": 2}))
    result = train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    names = set(load_file(str(out / "model" / "model.safetensors")))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    loaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.tensor([[101, 2023, 3185, 2001, 2307, 102]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   result.strategy.export_module().eval()(input_ids=ids).logits, rtol=0, atol=0)


def test_an_export_that_dies_midway_leaves_the_previous_model_in_place(tmp_path, tiny_llama_dir, monkeypatch):
    """A resumed run exports over the model/ a previous export wrote: the new folder is written beside it and
    swapped in, so some complete model is at model/ whenever the process dies."""
    from toolkit import export

    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                                      train={"max_steps": 1}))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    strategy = train(recipe, env).strategy
    before = (out / "model" / "model.safetensors").read_bytes()
    with torch.no_grad():  # what a later export writes: other weights
        for param in strategy.export_module().parameters():
            param.add_(1.0)

    class Died(Exception):
        pass

    def dies(*args, **kwargs):
        raise Died  # the process dying after the weights, before the tokenizer files

    tokenizer = type("Tokenizer", (), {"save_pretrained": staticmethod(dies)})()
    try:
        export.export_model(strategy, tokenizer=tokenizer, out_dir=out, env=env)
    except Died:
        pass
    assert (out / "model" / "model.safetensors").read_bytes() == before  # the complete previous one
    AutoModelForCausalLM.from_pretrained(out / "model")
    # the same export, completed: the new folder takes model/'s place, nothing is left beside it; also where
    # the one-step exchange (Linux renameat2) is missing and the old folder is moved aside first
    for exchange in (export._exchange, lambda a, b: False):
        monkeypatch.setattr(export, "_exchange", exchange)
        from transformers import AutoTokenizer

        export.export_model(strategy, tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir), out_dir=out, env=env)
        assert (out / "model" / "model.safetensors").read_bytes() != before
        assert sorted(p.name for p in out.iterdir() if "model" in p.name) == ["model"]
        with torch.no_grad():
            for param in strategy.export_module().parameters():
                param.add_(1.0)
