"""`toolkit compare`, `report` and `plan`: each user mistake is exit code 2, one line naming the problem and
the fix, and nothing written."""

import pytest

from conftest import write_recipe
from toolkit.cli import main


def _assert_one_line_exit_2(code, capsys, words, out=None):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and all(w in err[0] for w in words), err
    assert out is None or not out.exists()


@pytest.fixture
def recipe(tmp_path, tiny_llama_dir):
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused")


@pytest.mark.parametrize("size", ["40", "0", "0.0001KiB"])
def test_plan_wants_a_memory_size_with_its_unit(size, recipe, capsys):
    _assert_one_line_exit_2(main(["plan", str(recipe), "--memory-per-rank", size]), capsys,
                            (f"--memory-per-rank: {size!r}", "1 MiB or more with its unit", "40GiB"))
