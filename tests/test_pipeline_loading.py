"""A pipeline stage built empty and filled from the pretrained safetensors files alone (each rank reads only its
stages' tensors): exactly the tensors from_pretrained gives the whole model, a tied head included."""

import copy

import pytest
import torch

from conftest import MINILM
from toolkit.checkpoint.loading import ModelSource, load_part, materialize
from toolkit.config.files import load_recipe
from toolkit.model.stages import Stage, layer_list
from toolkit.model.tied import tied_aliases


def test_minilms_files_without_a_head_are_not_read_stage_by_stage(tmp_path):
    from conftest import write_recipe
    from toolkit.model.build import load_tokenizer

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=MINILM, task="sequence-classification",
                                      output_dir=tmp_path / "out"))
    source = ModelSource(recipe=recipe, tokenizer=load_tokenizer(recipe.model))
    assert source.weight_files(source.empty()) is None


def stages_filled_from_files(recipe):
    from toolkit.model.build import load_tokenizer

    source = ModelSource(recipe=recipe, tokenizer=load_tokenizer(recipe.model))
    empty = source.empty()
    files = source.weight_files(empty)
    assert files is not None  # the files hold exactly the model's tensors
    aliases = {name: first for name, first in tied_aliases(empty).items() if name != first}
    blocks = len(layer_list(empty))
    out = []
    for first, last, ids in ((True, False, range(0, blocks // 2)), (False, True, range(blocks // 2, blocks))):
        stage = Stage(copy.deepcopy(empty), layer_ids=list(ids), first=first, last=last)
        materialize(stage, device=torch.device("cpu"))
        load_part(stage, files, aliases=aliases)
        out.append(stage)
    return out, source.pretrained()


@pytest.mark.parametrize("which", ["bert classifier", "tied llama"])
def test_a_stage_read_from_the_files_equals_from_pretrained(which, tiny_tied_llama_dir, tiny_bert_dir, tmp_path):
    from conftest import write_recipe

    if which == "bert classifier":
        # a classifier saved whole (MiniLM's files hold no head: from_pretrained makes one, so a pipeline builds
        # that model whole on every rank, below)
        recipe_path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                                   output_dir=tmp_path / "out")
    else:
        recipe_path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_tied_llama_dir, output_dir=tmp_path / "out")
    stages, whole = stages_filled_from_files(load_recipe(recipe_path))
    reference = whole.state_dict()
    seen = set()
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, reference[name]), name  # bit for bit, buffers included
            seen.add(name)
    assert seen == set(reference)  # every tensor of the model is in one stage (a tied head: in the last, too)
    if which == "tied llama":
        assert torch.equal(stages[1].lm_head.weight, whole.model.embed_tokens.weight)
