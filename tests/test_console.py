"""A run whose console goes away (`toolkit train R 2>&1 | head -4`, a closed SSH session) trains on: the toolkit
stops writing to the closed stream, metrics.jsonl and run.json go on, and the exit code agrees with run.json.
Before: BrokenPipeError ended the run at its next line, run.json said failed, and the command exited 0."""

import json
import subprocess
import sys

from conftest import REPO, toolkit_env, write_recipe


def test_a_run_whose_reader_left_completes_and_exits_as_run_json_says(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          train={"max_steps": 6, "progress": True, "log_every": 1},  # a line a step, after the reader
                          checkpoint={"every_steps": 3})
    process = subprocess.Popen([sys.executable, "-m", "toolkit", "train", str(recipe)], cwd=REPO, env=toolkit_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    first = process.stdout.readline()  # `| head -1`: one line read, then the reader is gone
    process.stdout.close()
    code = process.wait(timeout=600)
    run = json.loads((out / "run.json").read_text())
    assert first.startswith("[toolkit]"), first
    assert (code, run["status"]) == (0, "completed"), run
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6
    assert (out / "model" / "config.json").is_file()
