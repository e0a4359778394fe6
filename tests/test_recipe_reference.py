"""docs/recipe-keys.md is what toolkit/config/recipe.py declares: a key added, removed, renamed, retyped, given another
default or another comment without the reference made again fails here (`python -m toolkit.config.reference >
docs/recipe-keys.md` makes it)."""

import dataclasses

from conftest import REPO
from toolkit.config import reference as recipe_reference
from toolkit.config.recipe import Recipe, TrainConfig


def test_the_recipe_key_reference_is_the_declarations():
    assert (REPO / "docs" / "recipe-keys.md").read_text() == recipe_reference.render()


def test_the_reference_holds_every_key_with_its_default_and_comment():
    table = {line.split(" | ")[0].strip("| `"): line.split(" | ")[1:] for line in recipe_reference.render()
             .splitlines() if line.startswith("| `")}
    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            yield f"{prefix}{f.metadata.get('key', f.name)}"
    assert set(keys(TrainConfig, "train.")) <= table.keys()
    assert {f"{f.metadata.get('key', f.name)}" for f in dataclasses.fields(Recipe)} <= table.keys()
    kind, default, text = table["train.host_memory"]
    assert (kind, default) == ("str", "auto") and text.startswith("on CPU, how a rank allocates")
    assert table["strategy.find_unused_parameters"][2].startswith("ddp: needed when")  # no group label before it
    assert table["checkpoint.async"][1] == "false"  # a Python keyword's field, by its recipe key
