"""Pipeline stages run a decoder's blocks by hand (toolkit.model.stages): for every architecture they accept,
one stage holding the whole model gives the model's own logits; architectures whose forward does more, and
sliding windows shorter than the samples, are refused before any rank starts."""

import pytest
import torch

from conftest import write_recipe
from test_cli_errors import _assert_one_line_exit_2
from test_model_errors import TINY_LLAMA_CONFIG
from toolkit.cli import main
from toolkit.errors import RecipeError
from toolkit.model.stages import STAGED_DECODERS, Stage, check_window, family_of, layer_list

SHAPES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def _model(model_type: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SHAPES, **fields})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _stage_and_model_logits(model, length: int = 24):
    ids = torch.randint(3, 128, (2, length))
    mask = torch.ones_like(ids)
    mask[1, length - 6:] = 0  # a padded sample: the stage builds its mask from the padding mask too
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        stage = Stage(model, layer_ids=list(range(len(layer_list(model)))), first=True, last=True)
        got = stage(ids, mask)
    keep = mask.bool()
    return got[keep], want[keep]


@pytest.mark.parametrize("model_type", STAGED_DECODERS)
def test_a_stage_of_every_accepted_decoder_computes_the_models_own_logits(model_type):
    got, want = _stage_and_model_logits(_model(model_type))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type,fields,what", [
    ("cohere", {"logit_scale": 0.0625}, "scales its logits"),
    ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}, "scales its embeddings and logits"),
    ("gemma2", {"final_logit_softcapping": 0.5}, "soft-caps its logits"),
])
def test_a_decoder_whose_forward_does_more_is_refused(model_type, fields, what, monkeypatch):
    from toolkit.model import stages
    model = _model(model_type, **fields)
    # the reason it is refused: a stage of it (let through here) computes another function (measured, not assumed)
    with monkeypatch.context() as patched:
        patched.setattr(stages, "family_of", lambda model: "decoder")
        got, want = _stage_and_model_logits(model)
    assert (got - want).abs().max() > 1e-3, what
    with pytest.raises(RecipeError, match=rf"^pipeline: no stage layout for {type(model).__name__}: stages run "):
        family_of(model)


def test_a_sliding_window_shorter_than_the_samples_is_refused():
    short = _model("mistral", sliding_window=8)
    got, want = _stage_and_model_logits(short)  # stages build the plain causal mask
    assert (got - want).abs().max() > 1e-3
    with pytest.raises(RecipeError, match=r"sliding_window 8\) .* set data.max_length <= 8"):
        check_window(short.config, max_length=24)
    covering = _model("mistral", sliding_window=24)  # a window as long as the samples: the causal mask
    torch.testing.assert_close(*_stage_and_model_logits(covering), rtol=1e-5, atol=1e-6)
    check_window(covering.config, max_length=24)
    # Qwen2 keeps sliding_window in its config but uses it only with use_sliding_window
    check_window(_model("qwen2", sliding_window=8).config, max_length=24)
    with pytest.raises(RecipeError, match="sliding_window 8"):
        check_window(_model("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=0).config,
                     max_length=24)


@pytest.mark.parametrize("fields,words", [
    ({"model_type": "granite", "logits_scaling": 8.0}, "no stage layout for GraniteForCausalLM"),
    ({"model_type": "mistral", "sliding_window": 8}, "(sliding_window 8) is not built by pipeline stages"),
])
def test_validate_refuses_such_a_pipeline_in_one_line(fields, words, tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          model={"path": None, "tokenizer": str(tiny_llama_dir), "config": {**TINY_LLAMA_CONFIG, **fields}},
                          batch={"micro_batch_size": 4, "grad_accum_steps": 2})
    code = main(["validate", str(recipe), "--nproc", "2", "--set", "strategy.name=pipeline"])
    _assert_one_line_exit_2(code, capsys, words, out)
