"""The token ids a model and its batches take from the tokenizer: a tokenizer with no pad token still pads (id 0,
masked), and a model built from model.config gets the tokenizer's bos/eos ids, not its config class's."""

import json

import pytest

from conftest import write_recipe
from test_model_errors import TINY_LLAMA_CONFIG
from toolkit.cli import main
from toolkit.errors import RecipeError


def _tokenizer_without_special_tokens(tiny_llama_dir, path):
    """The tests' tokenizer with no pad, eos, unk or bos: its tokenizer.json pipeline alone, as a tokenizer trained
    with `tokenizers` and saved without special tokens is."""
    path.mkdir()
    pipeline = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    pipeline["padding"] = None  # TokenizersBackend would take its pad token from here
    (path / "tokenizer.json").write_text(json.dumps(pipeline))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    return path


def test_a_tokenizer_with_no_pad_eos_or_unk_token_trains_with_padding_id_0(tmp_path, tiny_llama_dir, capsys):
    """load_tokenizer's pad fallback (eos, then unk) was None, and the first step died in the collator on a
    TypeError after `validate` said ok."""
    from transformers import AutoTokenizer

    folder = _tokenizer_without_special_tokens(tiny_llama_dir, tmp_path / "bare")
    bare = AutoTokenizer.from_pretrained(str(folder))
    assert (bare.pad_token, bare.eos_token, bare.unk_token) == (None, None, None)
    out = tmp_path / "out"
    model = {"path": None, "tokenizer": str(folder), "config": TINY_LLAMA_CONFIG}
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, model=model,
                          data={"eval": None}, train={"max_steps": 2})
    note = "model.tokenizer: the tokenizer has no pad, eos or unk token; batches are padded with id 0"
    assert main(["validate", str(recipe)]) == 0
    assert capsys.readouterr().err.count(note) == 1  # validate says what the run will say
    assert main(["train", str(recipe)]) == 0
    assert capsys.readouterr().err.count(note) == 1
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]
    assert json.loads((out / "model" / "config.json").read_text())["pad_token_id"] == 0


def test_a_model_built_from_its_config_takes_the_tokenizers_bos_and_eos_ids(tmp_path, tiny_llama_dir):
    """hf_config copied the pad id alone: a Llama from model.config kept LlamaConfig's bos 1 / eos 2 ([unused0] and
    [unused1] of this vocabulary), in its config and the generation_config an export writes. The reference is the
    tokenizer's own ids; an id model.config names stays the recipe's."""
    from transformers import AutoTokenizer

    from toolkit.model.build import build_model, load_tokenizer
    from toolkit.config.recipe import ModelConfig

    folder = tmp_path / "with-eos"  # the tests' tokenizer with a bos and an eos, as a decoder's tokenizer has
    AutoTokenizer.from_pretrained(str(tiny_llama_dir), bos_token="[CLS]", eos_token="[SEP]").save_pretrained(folder)
    config = ModelConfig(config=TINY_LLAMA_CONFIG, tokenizer=str(folder), task="causal-lm")
    tokenizer = load_tokenizer(config)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (101, 102)
    model = build_model(config, tokenizer=tokenizer, seed=0)
    for ids in (model.config, model.generation_config):  # generation_config: what generate() stops on
        assert (ids.bos_token_id, ids.eos_token_id, ids.pad_token_id) == (101, 102, tokenizer.pad_token_id)
    model.save_pretrained(tmp_path / "export")
    saved = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (101, 102)

    bert = ModelConfig(config=TINY_LLAMA_CONFIG, tokenizer=str(tiny_llama_dir), task="causal-lm")  # no bos, no eos
    built = build_model(bert, tokenizer=load_tokenizer(bert), seed=0).config
    assert (built.bos_token_id, built.eos_token_id) == (None, None)
    named = ModelConfig(config={**TINY_LLAMA_CONFIG, "eos_token_id": 7}, tokenizer=str(folder), task="causal-lm")
    assert build_model(named, tokenizer=tokenizer, seed=0).config.eos_token_id == 7


def test_a_decoder_classifier_pools_each_samples_own_last_token_whatever_its_config_class_pads_with(tiny_llama_dir):
    """OPTConfig's pad id is 1, the tests' tokenizer pads with 0: OPT's classifier pooled the last position that is
    not 1, i.e. padding, so a sample's logits depended on how long the others in its micro-batch were (losses of
    micro 8 and micro 1 × accum 8 differed by 6 %). The reference: each sample alone, unpadded."""
    import torch

    from toolkit.model.build import build_model, load_tokenizer
    from toolkit.config.recipe import ModelConfig

    opt = {"model_type": "opt", "vocab_size": 30522, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 64, "word_embed_proj_dim": 32}
    config = ModelConfig(config=opt, tokenizer=str(tiny_llama_dir), task="sequence-classification", num_labels=2)
    tokenizer = load_tokenizer(config)
    model = build_model(config, tokenizer=tokenizer, seed=0).eval()
    assert model.config.pad_token_id == tokenizer.pad_token_id == 0
    texts = ["a short one", "a much longer sample that the short one is padded to match"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        together = model(**batch).logits
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in texts])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_a_config_class_pad_id_outside_the_recipes_vocabulary_gives_way_to_the_tokenizers(tiny_llama_dir):
    """Phi3Config's pad id is 32000, for Phi-3's own vocabulary: built with vocab_size 30522 (the tests'
    tokenizer), transformers refused it ("Padding_idx must be within num_embeddings"), a value the recipe never set.
    A pad id model.config names stays the recipe's (and its mistake one line)."""
    from toolkit.model.build import build_model, load_tokenizer, meta_model
    from toolkit.config.recipe import ModelConfig

    phi3 = {"model_type": "phi3", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    config = ModelConfig(config=phi3, tokenizer=str(tiny_llama_dir), task="causal-lm")
    tokenizer = load_tokenizer(config)
    assert build_model(config, tokenizer=tokenizer, seed=0).config.pad_token_id == tokenizer.pad_token_id == 0
    assert meta_model(config).get_input_embeddings().num_embeddings == 30522  # validate and plan build it too
    named = ModelConfig(config={**phi3, "pad_token_id": 32000}, tokenizer=str(tiny_llama_dir), task="causal-lm")
    with pytest.raises(RecipeError, match="Padding_idx must be within num_embeddings"):
        meta_model(named)
