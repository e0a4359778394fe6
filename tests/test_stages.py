"""Pipeline stages are cut from any model whose blocks sit in one list (toolkit.model.stages): for each family
below, the model cut into three stages (first, middle, last), each from its own copy and holding only its own
parameters, gives the model's own logits and parameter gradients. Families whose forward does more than
embeddings, blocks, norm and head (logit scales, soft caps, sliding windows, learned positions, tuple-returning
blocks) are among them: each stage runs the model's own forward. A model whose modules and forward do not show
where to cut is refused in one line."""

import copy

import pytest
import torch
from torch import nn

from toolkit.errors import RecipeError
from toolkit.model.stages import Stage, layer_list, layout_of
from toolkit.model.tied import tied_aliases

SHAPES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
GPT2_SHAPES = dict(n_embd=32, n_layer=4, n_head=4, n_positions=64)

FAMILIES = {
    # model_type: the config fields that make it what the row says
    "llama": {},
    "mistral": {"sliding_window": 8},  # a window shorter than the samples: the model's own sliding mask
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},  # sliding layers 2-3 only
    "qwen3": {},
    "gemma": {},  # embeddings scaled by sqrt(hidden) inside the model's forward
    "gemma2": {"final_logit_softcapping": 0.5, "sliding_window": 8},  # soft-capped logits, alternating windows
    "olmo": {},
    "olmo2": {},
    "cohere": {"logit_scale": 0.0625},
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "phi": {},  # partial rotary, parallel attention and MLP
    "phi3": {},
    "stablelm": {},
    "starcoder2": {},
    "gpt_neox": {},  # embed_in / embed_out, final_layer_norm
    "gpt2": GPT2_SHAPES,  # learned positions (wpe), Conv1D layers, a tied head
    "gpt_bigcode": GPT2_SHAPES,
    "gptj": {**GPT2_SHAPES, "rotary_dim": 4},
    "falcon": {"head_dim": None},  # blocks that return a tuple (outputs[0]); head_dim derived
    "bloom": {"n_layer": 4, "n_head": 4},  # ALiBi, and a layer norm on the embeddings
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 16},  # projections before and after the blocks
}


def _model(model_type: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    settings = {k: v for k, v in {**SHAPES, **fields}.items() if v is not None}
    config = AutoConfig.for_model(model_type, **settings)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()  # eval: no dropout


def _chained(model, cuts: list[list[int]], ids, mask):
    """The logits of `model` cut into stages at `cuts`, each from its own copy, and the gradients of a loss on
    them by the whole model's (canonical) parameter names (a tied weight's two copies summed)."""
    stages = [Stage(copy.deepcopy(model), layer_ids=c, first=i == 0, last=i == len(cuts) - 1)
              for i, c in enumerate(cuts)]
    hidden = ids
    for stage in stages:
        hidden = stage(hidden, attention_mask=mask)
    hidden.float().square().mean().backward()
    canonical = tied_aliases(model)
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            key = canonical[name]
            grads[key] = grads.get(key, 0) + param.grad
    return hidden.detach(), grads, stages


def _inputs(length: int = 24):
    ids = torch.randint(3, 128, (2, length))
    mask = torch.ones_like(ids)
    mask[1, length - 6:] = 0  # a padded sample: every stage's mask comes from the padding mask
    return ids, mask


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_three_stages_of_every_family_give_the_models_own_logits_and_gradients(model_type):
    model = _model(model_type, **FAMILIES[model_type])
    ids, mask = _inputs()
    want = model(input_ids=ids, attention_mask=mask).logits
    want.float().square().mean().backward()
    want_grads = {name: p.grad for name, p in model.named_parameters()}
    got, grads, stages = _chained(model, [[0], [1, 2], [3]], ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want.detach()[keep], rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()  # every parameter on exactly the stage(s) that use it
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # each stage holds its own blocks alone: the middle one nothing from before or after them
    layout = layout_of(model)
    middle = {name for name, _ in stages[1].named_parameters()}
    assert middle and all(name.startswith(f"{layout.stack}.1.") or name.startswith(f"{layout.stack}.2.")
                          for name in middle), sorted(middle)[:4]


def test_the_layout_is_read_from_the_model():
    gpt2 = layout_of(_model("gpt2", **GPT2_SHAPES))
    assert (gpt2.stack, gpt2.before, gpt2.after) == ("transformer.h", ("transformer.wte", "transformer.wpe"),
                                                     ("lm_head", "transformer.ln_f"))
    opt = layout_of(_model("opt", **FAMILIES["opt"]))  # declared before its blocks, run after them
    assert "model.decoder.project_out" in opt.after and "model.decoder.project_in" in opt.before
    assert len(layer_list(_model("gpt_neox"))) == 4


def test_a_bert_classifier_is_cut_like_a_decoder(tiny_bert_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir).eval()
    layout = layout_of(model)
    assert (layout.stack, layout.before, layout.after) == (
        "bert.encoder.layer", ("bert.embeddings",), ("classifier", "bert.pooler"))
    ids, mask = _inputs(12)
    want = model(input_ids=ids, attention_mask=mask).logits
    got, _, _ = _chained(model, [[0], [1]], ids, mask)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, hidden):
        return self.linear(hidden)


class _Reused(nn.Module):
    """A model whose forward runs one module with weights both before and after its blocks."""

    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, hidden):
        hidden = self.proj(hidden)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.proj(hidden)


class _Handing(nn.Module):
    """A model whose blocks hand a second value (a position bias) from each block to the next."""

    _no_split_modules = ["_BiasedBlock"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_BiasedBlock(), _BiasedBlock()])

    def forward(self, hidden):
        bias = None
        for i, layer in enumerate(self.layers):
            hidden, bias = layer(hidden, bias=bias)
        return hidden


class _BiasedBlock(_Block):
    def forward(self, hidden, bias=None):
        bias = torch.ones_like(hidden) if bias is None else bias
        return self.linear(hidden) + bias, bias


def test_a_classifier_unpacking_each_blocks_output_is_cut_like_a_decoder():
    """DeBERTa's encoder unpacks each block's output (`hidden_states, att_m = layer_module(...)`): a block of an
    earlier stage hands on the hidden states and None for the attention it does not return (before: the first
    step failed, "too many values to unpack")."""
    from transformers import DebertaConfig, DebertaForSequenceClassification

    torch.manual_seed(0)
    model = DebertaForSequenceClassification(DebertaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)).eval()
    blocks = ("DebertaLayer",)  # DeBERTa declares no _no_split_modules: strategy.blocks names its block
    assert layout_of(model, blocks).outputs == 2
    ids, mask = _inputs(12)
    want = model(input_ids=ids, attention_mask=mask).logits
    want.float().square().mean().backward()
    stages = [Stage(copy.deepcopy(model), layer_ids=[i], first=i == 0, last=i == 2, blocks=blocks) for i in range(3)]
    hidden = ids
    for stage in stages:
        hidden = stage(hidden, attention_mask=mask)
    hidden.float().square().mean().backward()
    torch.testing.assert_close(hidden.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    for i, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-7,
                                       msg=lambda m, n=name: f"stage {i} {n}: {m}")


class _Renaming(_Handing):
    """As _Handing, with the second value renamed before it goes on (T5's position_bias)."""

    def forward(self, hidden):
        bias = None
        for layer in self.layers:
            hidden, new_bias = layer(hidden, bias=bias)
            bias = new_bias
        return hidden


def test_a_model_handing_a_second_value_from_block_to_block_is_refused():
    with pytest.raises(RecipeError, match=r"^pipeline: _Handing.forward hands bias from each block to the next "
                                          r"beside the hidden states"):
        layout_of(_Handing())
    with pytest.raises(RecipeError, match=r"^pipeline: _Renaming.forward hands bias from each block"):
        layout_of(_Renaming())
    # LiLT: `layout_inputs = layer_outputs[1]`, handed to the next block (before: accepted, and the first stage's
    # forward failed on the batch's second row, which a left-out block's [1] indexes)
    from transformers import LiltConfig, LiltForSequenceClassification

    lilt = LiltForSequenceClassification(LiltConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64))
    with pytest.raises(RecipeError, match=r"^pipeline: LiltEncoder.forward hands layout_inputs from each block"):
        layout_of(lilt, ("LiltLayer",))


def test_a_model_that_does_not_show_where_to_cut_is_refused_in_one_line():
    with pytest.raises(RecipeError, match=r"^pipeline: cannot cut _Reused into stages: _Reused.forward uses proj "
                                          r"where it runs the blocks; set strategy.blocks"):
        layout_of(_Reused())
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                             num_heads=2))
    # its blocks sit in two lists (encoder and decoder): not one stack a pipeline runs through
    with pytest.raises(RecipeError, match=r"^pipeline: the 4 blocks T5Block of T5ForConditionalGeneration are "
                                          r"not one list of the model"):
        layout_of(t5)


def test_validate_refuses_a_pipeline_of_a_model_it_cannot_cut_in_one_line(monkeypatch, tmp_path, tiny_llama_dir,
                                                                          capsys):
    from conftest import write_recipe
    from test_cli_errors import _assert_one_line_exit_2
    from toolkit.cli import main
    from toolkit.model import stages

    # as for a model whose forward's source cannot be read (compiled, or built at run time): nothing tells where
    # its embeddings and head run
    monkeypatch.setattr(stages, "_uses", lambda owner: {})
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          batch={"micro_batch_size": 4, "grad_accum_steps": 2})
    code = main(["validate", str(recipe), "--nproc", "2", "--set", "strategy.name=pipeline"])
    _assert_one_line_exit_2(code, capsys, "pipeline: cannot cut LlamaForCausalLM into stages: "
                                          "LlamaForCausalLM.forward does not name self.model", out)


@pytest.mark.parametrize("model_type,fields", [("gpt2", GPT2_SHAPES), ("llama", {}), ("gpt_neox", {})])
def test_a_decoder_classifier_that_pools_its_last_token_is_refused(model_type, fields):
    """A decoder's sequence classifier finds each sample's last real token from the input ids after its blocks;
    the last stage is given hidden states only, and transformers then pools position -1, the padding of every
    shorter sample (a review measured 0.1-0.2 apart on the padded rows of GPT-2, OPT, BLOOM and GPT-NeoX)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    settings = {k: v for k, v in {**SHAPES, **fields}.items() if v is not None}
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(model_type, **settings))
    with pytest.raises(RecipeError, match=r"^pipeline: \w+ForSequenceClassification.forward reads the input ids "
                                          r"after its blocks"):
        layout_of(model)


def test_a_modernbert_classifier_whose_forward_reads_each_layers_attention_type_is_cut():
    """ModernBERT alternates local and global attention and reads each layer's attention_type in its forward: the
    stand-ins for other stages' blocks carry their blocks' plain settings (before: AttributeError on every rank)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = AutoConfig.for_model("modernbert", vocab_size=128, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=3, num_attention_heads=4, pad_token_id=0, cls_token_id=1,
                                  sep_token_id=2, bos_token_id=1, eos_token_id=2, global_attn_every_n_layers=2,
                                  local_attention=8)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    ids, mask = _inputs(12)
    want = model(input_ids=ids, attention_mask=mask).logits
    got, _, _ = _chained(model, [[0], [1], [2]], ids, mask)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_layerdrop_is_refused():
    model = _model("opt", **FAMILIES["opt"], layerdrop=0.1)
    with pytest.raises(RecipeError, match=r"^pipeline: OPTForCausalLM skips blocks at random in training "
                                          r"\(config.layerdrop 0.1\)"):
        layout_of(model)
