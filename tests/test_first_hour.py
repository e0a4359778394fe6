"""What a new user meets around the training itself: what a run says while it runs, and how it ends."""

import json

from conftest import write_recipe
from toolkit.cli import main


def test_dp_without_two_gpus_says_what_it_ran_as_and_progress_shows_eval_loss(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, strategy={"name": "dp"},
                          train={"max_steps": 3, "eval_every": 2, "log_every": 10, "progress": True})
    assert main(["train", str(recipe)]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if "warning" in line]
    assert warnings == ["[toolkit] warning: strategy dp needs 2+ CUDA devices; this machine has 0, so it runs as "
                        "one process on the CPU (no CUDA device), like strategy single"]
    evaluated = {m["step"]: m["eval_loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if "eval_loss" in m}
    assert sorted(evaluated) == [2, 3]
    # the progress lines: the steps evaluated (2, and the last) show their eval loss; log_every 10 adds none
    lines = [line for line in err if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"]
    for line, step in zip(lines, (2, 3)):
        assert f" eval_loss {evaluated[step]:.4f} " in line
