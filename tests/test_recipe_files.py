"""Recipe files as users write them: a key written twice, `1e-4`, `$SCRATCH` in a path, an empty file. Each is
read as the user means it or refused in one line; no model is loaded."""

import re

import pytest
import yaml

from toolkit.cli import main
from toolkit.config.files import apply_override, dump_recipe, load_recipe
from toolkit.errors import RecipeError

HEAD = "model: {path: /m}\ndata: {train: t.jsonl}\n"


def _write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, where, key, first", [
    (HEAD + "optim: {lr: 1.0e-4}\noptim: {lr: 1.0e-2}\n", "4:1", "optim", 3),  # a section appended again
    ("model: {path: /m}\nmodel: {path: /n, task: causal-lm}\ndata: {train: t.jsonl}\n", "2:1", "model", 1),
    (HEAD + "optim:\n  lr: 1.0e-4\n  warmup_steps: 2\n  lr: 1.0e-2\n", "6:3", "optim.lr", 4),  # nested: named
])
def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path, capsys, text, where, key, first):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError, match=re.escape(f"recipe {path}:{where}: key {key!r} appears twice "
                                                    f"(also line {first}); keep one")):
        load_recipe(path)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and "appears twice" in err[0], err


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = _write(tmp_path, HEAD + "base: &base {lr: 1.0e-4, warmup_steps: 2}\n")
    # `<<` brings keys in that the mapping may set again: that is a merge, not a duplicate
    from toolkit.config.yaml_files import load_yaml

    assert load_yaml(path.read_text() + "optim: {<<: *base, lr: 1.0e-2}\n")["optim"] == {"lr": 1e-2, "warmup_steps": 2}


def test_a_matrix_file_with_a_key_written_twice_is_refused(tmp_path):
    from toolkit.compare.experiment import read_matrix

    path = tmp_path / "m.yaml"
    path.write_text("recipe: r.yaml\nstrategies: [single]\nstrategies: [ddp]\n")
    with pytest.raises(RecipeError, match=re.escape(f"matrix file {path}:3:1: key 'strategies' appears twice")):
        read_matrix(str(path))


@pytest.mark.parametrize("text", ["optim: {lr: 1e-4, eps: 1E-8, max_grad_norm: 1e0}\n",
                                  "optim: {lr: +1e-4, eps: 1.e-8, max_grad_norm: 1e+0}\n"])
def test_exponent_numbers_without_a_dot_are_numbers_in_a_file_as_with_set(tmp_path, text):
    recipe = load_recipe(_write(tmp_path, HEAD + text))
    assert (recipe.optim.lr, recipe.optim.eps, recipe.optim.max_grad_norm) == (1e-4, 1e-8, 1.0)
    assert load_recipe(_write(tmp_path, HEAD), ["optim.lr=1e-4"]).optim.lr == 1e-4


def test_exponent_text_stays_text_where_a_key_takes_text(tmp_path):
    recipe = load_recipe(_write(tmp_path, HEAD), ["data.text_column=1e5", "model.path=null",
                                                  "model.tokenizer=/t",
                                                  "model.config={model_type: llama, rms_norm_eps: 1e-5}"])
    assert recipe.data.text_column == "1e5"  # a column may be named so
    assert recipe.model.config == {"model_type": "llama", "rms_norm_eps": 1e-5}  # a config field: the number


def test_environment_variables_in_path_keys_are_expanded_and_saved_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    path = _write(tmp_path, "model: {path: $SCRATCH/m}\ndata: {train: '${SCRATCH}/t.jsonl'}\n"
                            "output_dir: $SCRATCH/runs/x\n")
    recipe = load_recipe(path)
    assert recipe.output_dir == str(tmp_path / "scratch" / "runs" / "x")
    assert (recipe.model.path, recipe.data.train) == (str(tmp_path / "scratch" / "m"),
                                                      str(tmp_path / "scratch" / "t.jsonl"))
    assert yaml.safe_load(dump_recipe(recipe))["output_dir"] == recipe.output_dir  # as recipe.yaml holds it
    assert load_recipe(path, ["output_dir=${SCRATCH}/y"]).output_dir == str(tmp_path / "scratch" / "y")


@pytest.mark.parametrize("value, name", [("$TOOLKIT_UNSET_VAR/runs/x", "TOOLKIT_UNSET_VAR"),
                                         ("${TOOLKIT_UNSET_VAR}/runs", "TOOLKIT_UNSET_VAR")])
def test_an_unset_environment_variable_in_a_path_is_one_line(tmp_path, capsys, monkeypatch, value, name):
    monkeypatch.delenv(name, raising=False)
    path = _write(tmp_path, HEAD)
    assert main(["validate", str(path), "--set", f"output_dir={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"output_dir: {value!r} names the environment variable {name}, which is not set" \
        in err[0], err
    assert not (tmp_path / "$TOOLKIT_UNSET_VAR").exists()


def test_an_empty_environment_variable_in_a_path_is_one_line(tmp_path, capsys, monkeypatch):
    """A shell would make `$SCRATCH/runs/x` of an empty SCRATCH `/runs/x`: a folder at the file system's root."""
    monkeypatch.setenv("TOOLKIT_EMPTY_VAR", "")
    path = _write(tmp_path, HEAD)
    assert main(["validate", str(path), "--set", "output_dir=$TOOLKIT_EMPTY_VAR/runs/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names the environment variable TOOLKIT_EMPTY_VAR, which is set but empty" in err[0], err


def test_a_set_value_with_a_key_written_twice_is_refused():
    with pytest.raises(RecipeError, match="key 'a' appears twice"):
        apply_override({}, "model.config={a: 1, a: 2}")


@pytest.mark.parametrize("text", ["", "\n", "# a recipe, one day\n"])
def test_an_empty_recipe_file_is_said_to_be_empty(tmp_path, capsys, text):
    path = _write(tmp_path, text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"toolkit: error: recipe {path} is empty; it needs at least a model and a data section "
                   "(see recipes/)"], err


def test_a_folder_or_a_missing_file_given_as_the_recipe_is_said_to_be_so(tmp_path, capsys):
    """A folder was said to be "not found", where the user can see it."""
    for path, words in ((tmp_path, "is a folder"), (tmp_path / "none.yaml", "not found")):
        assert main(["validate", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"toolkit: error: recipe {path} {words}; pass a YAML file (see `toolkit --help` for the "
                       "shipped recipes)"], err
    # a name one typo away from a recipe beside it is offered
    (tmp_path / "llama-tiny.yaml").write_text("model: {}\n")
    assert main(["validate", str(tmp_path / "lama-tiny.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"toolkit: error: recipe {tmp_path / 'lama-tiny.yaml'} not found (did you mean {tmp_path / 'llama-tiny.yaml'}?)"
        "; pass a YAML file (see `toolkit --help` for the shipped recipes)"]


def test_a_flow_mapping_without_a_space_after_its_colons_names_the_yaml_rule(tmp_path, capsys):
    """`--set model.lora={r:8,merge_on_export:true}`: YAML reads each `a:b` as one key, which the recipe has not."""
    from conftest import REPO

    assert main(["validate", str(REPO / "recipes" / "llama-tiny.yaml"), "--set",
                 "model.lora={r:8,merge_on_export:true}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown recipe key 'model.lora.merge_on_export:true'; YAML reads " \
        "'merge_on_export:true' as one key: write 'merge_on_export: ...', with a space after the colon" in err[0], err
