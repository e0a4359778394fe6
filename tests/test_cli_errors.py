"""Each user mistake: exit code 2, one line naming the problem and the fix, no output dir left behind."""

import pytest

from conftest import EVAL, REPO, run_cli, write_recipe
from toolkit.cli import main
from toolkit.model import precision as precision_mod


def _bad_recipe(tmp_path, tiny_llama_dir, **sections):
    out = tmp_path / "out"
    return write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, **sections), out


def _assert_one_line_exit_2(code, capsys, words, out):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and words in err[0], err
    assert not out.exists()


CASES = {
    "unknown key": ({"optim": {"learning_rate": 0.1}}, (), "unknown recipe key 'optim.learning_rate'"),
    "wrong type": ({"batch": {"micro_batch_size": "eight"}}, (), "expected an integer"),
    "unknown strategy": ({}, ("strategy.name=megatron",), "strategy.name: unknown value 'megatron'"),
    "batch mismatch": ({"batch": {"micro_batch_size": 8, "grad_accum_steps": 1, "global_batch_size": 12}}, (),
                       "1 ranks × micro 8 × accum 1 = 8, but global_batch_size is 12"),
    "missing model": ({"model": {"path": "/nonexistent/model", "task": "causal-lm"}}, (),
                      "/nonexistent/model"),
    "missing column": ({"data": {"text_column": "review"}}, (), "has no column 'review'"),
    "profile window backwards": ({"train": {"profile_steps": [3, 2]}}, (), "train.profile_steps: got [3, 2]"),
    "profile window past the end": ({}, ("train.profile_steps=[6, 7]",), "starts after the run's last step 5"),
    "lora adapting nothing": ({}, ("model.lora={\"target_modules\": []}",), "model.lora.target_modules is empty"),
    "cls without label column": ({"model": {"task": "sequence-classification"}},
                                 ("data.label_column=stars", f"data.train={EVAL}"), "has no column 'stars'"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["train", "validate"])
def test_bad_input_exits_2_with_one_line(case, command, tmp_path, tiny_llama_dir, capsys):
    sections, overrides, words = CASES[case]
    if "model" in sections:
        sections = {"model": {**sections["model"], "path": sections["model"].get("path", str(tiny_llama_dir))}}
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, **sections)
    args = [command, str(recipe)] + [a for o in overrides for a in ("--set", o)]
    _assert_one_line_exit_2(main(args), capsys, words, out)


@pytest.mark.parametrize("command", ["train", "validate"])
def test_a_nul_in_output_dir_is_one_line(command, tmp_path, tiny_llama_dir, capsys):
    """train: the folder lock (process/folder_lock.py) and its empty-folder cleanup took such a path to os.open and
    os.rmdir, whose ValueError was a traceback; the recipe's check says it. validate said ok."""
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir)
    code = main([command, str(recipe), "--set", 'output_dir="out\\0put"'])
    _assert_one_line_exit_2(code, capsys, "output_dir 'out\\x00put' holds a NUL character", out)


def test_validate_says_what_train_will_answer_an_output_dir_that_holds_a_run(llama_runs, tmp_path, capsys):
    run = llama_runs.get("single")
    assert main(["validate", str(llama_runs.recipe), "--set", f"output_dir={run}"]) == 0  # a --resume may follow
    notes = [line for line in capsys.readouterr().err.splitlines() if "output_dir" in line]
    assert notes == [f"[toolkit] note: output_dir {run} holds a completed run (its model in {run / 'model'}; no "
                     "checkpoint, so it cannot be trained further); remove that folder to start again there, or "
                     "write this one elsewhere with --set output_dir=OTHER (what toolkit train answers without "
                     "--resume)"]


def test_fp16_refused_where_the_device_cannot(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    class NoHalf:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("float16 autocast is not supported here")

    monkeypatch.setattr(precision_mod.torch, "autocast", NoHalf)
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, precision="fp16")
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys, "precision fp16 is not supported on cpu", out)


def test_launch_rejects_batch_mismatch_before_starting_ranks(tmp_path, tiny_llama_dir):
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, strategy={"name": "ddp"},
                              batch={"micro_batch_size": 4, "grad_accum_steps": 1, "global_batch_size": 4})
    result = run_cli("launch", "--nproc", "2", str(recipe))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["toolkit: error: batch: 2 ranks × micro 4 × accum 1 = 8, but global_batch_size is 4; "
                     "set batch.grad_accum_steps=null to derive it, or make global_batch_size 8"]
    assert not out.exists()


def test_single_strategy_refuses_two_ranks(tmp_path, tiny_llama_dir):
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir)
    result = run_cli("launch", "--nproc", "2", str(recipe))
    assert result.returncode == 2 and "strategy single runs in one process" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_help_lists_shipped_recipes():
    result = run_cli("--help", cwd=REPO)
    assert result.returncode == 0 and "recipes/minilm-sst.yaml" in result.stdout


def test_strategies_lists_every_strategy_with_its_options():
    from toolkit.strategies import arm_aliases, strategy_info, strategy_names

    result = run_cli("strategies", cwd=REPO)
    assert result.returncode == 0
    names = [line.split()[0] for line in result.stdout.splitlines() if line and not line.startswith(" ")]
    assert names[:len(strategy_names())] == list(strategy_names())
    assert all(f"strategy.{option}" in result.stdout for name in strategy_names()
               for option in strategy_info(name).options)
    assert all(f"  {arm} " in result.stdout for arm in arm_aliases())
    # every tested combination of parallel degrees, with the preset that runs it
    from toolkit.config.parallel import PRESETS

    table = result.stdout.split("\nparallel degrees", 1)[1].splitlines()[1:]
    assert len(table) == len(PRESETS) + 1 and ["dp_shard", "×", "tp", "fsdp", "(strategy.tp_degree)"] in [
        line.split() for line in table]
    assert table[-1].split()[:6] == ["ep", "(borrows", "from", "dp_shard)", "fsdp", "(strategy.ep_degree):"]


def test_zero_refuses_a_precision_its_accelerator_lacks(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    import deepspeed.accelerator

    class NoHalfAccelerator:  # DeepSpeed's CPU accelerator answers the same; a GPU one would not
        def is_fp16_supported(self):
            return False

        def is_bf16_supported(self):
            return True

        def device_name(self):
            return "cpu"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: NoHalfAccelerator())
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, strategy={"name": "zero"}, precision="fp16")
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys,
                            "precision fp16 is not supported by DeepSpeed's cpu accelerator; use precision: bf16", out)


# a data file as a newcomer may have it: (its name, its text, the task, words of the one line)
BAD_FILES = {
    "header only": ("train.csv", "text,label\n", "causal-lm", "has no rows (a header at most)"),
    "empty file": ("train.jsonl", "", "causal-lm", "is empty: it has no rows"),
    "unparsable": ("train.jsonl", '{"text": "fine"}\n{"text": "cut\n', "causal-lm", "cannot be read as json"),
    "text not text": ("train.jsonl", '{"text": true}\n{"text": false}\n', "causal-lm",
                      "column 'text' holds bool values, not text"),  # numbers are read as text
    "row without text": ("train.jsonl", '{"text": "a"}\n{"text": null}\n', "causal-lm", "row 2 has no 'text'"),
    # empty in every row: the run trained on the tokenizer's special tokens alone (eval accuracy 1.0)
    "no text in any row": ("train.jsonl", '{"text": "", "label": 1}\n{"text": "  ", "label": 0}\n',
                           "sequence-classification", "column 'text' is empty in every row"),
    "label outside num_labels": ("train.csv", "text,label\ngood,1\nbad,7\n", "sequence-classification",
                                 "has label 7 in column 'label', outside 0..1 (model.num_labels: 2)"),
    "labels that are numbers but not ids": ("train.csv", "text,label\ngood,0.5\nbad,1.5\n", "sequence-classification",
                                            "row 1 has label 0.5 in column 'label'; labels must be class ids "
                                            "(whole numbers) or names"),
    "more label names than num_labels": ("train.csv", "text,label\ngood,pos\nbad,neg\nmeh,mixed\n",
                                         "sequence-classification", "has 3 labels (mixed, neg, pos) but "
                                         "model.num_labels is 2; set model.num_labels: 3"),
    "row without a label": ("train.csv", "text,label\ngood,1\nbad,\n", "sequence-classification",
                            "row 2 has no 'label'; fill or drop it"),  # the row named, as for text
}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.parametrize("command", ["train", "validate"])
def test_a_bad_data_file_exits_2_with_one_line(case, command, tmp_path, tiny_llama_dir, capsys):
    name, text, task, words = BAD_FILES[case]
    data = tmp_path / name
    data.write_text(text)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, task=task, output_dir=out,
                          data={"train": str(data), "eval": None})
    _assert_one_line_exit_2(main([command, str(recipe)]), capsys, f"data.train: {data} {words}", out)


@pytest.mark.parametrize("labels", ['"1"', "1.0", "true"])
def test_labels_that_are_class_ids_in_another_type_are_accepted(labels, tmp_path, tiny_llama_dir):
    data = tmp_path / "train.jsonl"  # digit strings, whole floats, booleans: int() of each is the class id
    # 8 rows: one global batch (validate refuses fewer, as train does)
    data.write_text("".join(f'{{"text": "review {i}", "label": {labels}}}\n' for i in range(8)))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, task="sequence-classification",
                          output_dir=tmp_path / "out", data={"train": str(data), "eval": None})
    assert main(["validate", str(recipe)]) == 0


def test_model_path_to_a_file_and_max_length_beyond_the_positions(tmp_path, tiny_llama_dir, tiny_bert_dir, capsys):
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, model={"path": str(tiny_llama_dir / "config.json")})
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys, "config.json is a file; point it at the "
                            "folder save_pretrained wrote", out)
    # the tiny BERT has a table of 64 learned positions (tests/conftest.py): 65 tokens cannot be embedded
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "bert.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=out, data={"max_length": 65})
    _assert_one_line_exit_2(main(["train", str(recipe)]), capsys, "data.max_length 65 is above the model's "
                            "position limit 64", out)
    # the tiny Llama's 64 are rotary: its trained context, not a limit; a longer max_length is the user's call
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, data={"max_length": 65})
    assert main(["validate", str(recipe)]) == 0


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: x\n data:\n  train: y\n")
    _assert_one_line_exit_2(main(["validate", str(recipe)]), capsys, f"recipe {recipe}:3:2: not valid YAML: "
                            "expected <block end>, but found '<block mapping start>'", tmp_path / "out")


def test_a_bad_data_file_is_refused_by_launch_before_any_rank_starts(tmp_path, tiny_llama_dir):
    data = tmp_path / "train.csv"
    data.write_text("text,label\n")
    recipe, out = _bad_recipe(tmp_path, tiny_llama_dir, strategy={"name": "ddp"}, data={"train": str(data)})
    result = run_cli("launch", "--nproc", "2", str(recipe))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"toolkit: error: data.train: {data} has no rows (a header at "
                                                  "most); point data.train at a file with data"]
    assert not out.exists()


@pytest.mark.parametrize("args, words", [
    (["trian", "r.yaml"], "toolkit: error: argument command: invalid choice: 'trian'"),
    (["launch", "--nproc", "two", "r.yaml"], "toolkit launch: error: argument --nproc: invalid int value: 'two'"),
    (["train"], "toolkit train: error: the following arguments are required: recipe"),
    (["plan", "r.yaml", "--memory-per-rank"], "toolkit plan: error: argument --memory-per-rank: expected one argument"),
    (["compare", "r.yaml", "--nprocs", "2"], "toolkit compare: error: unrecognized arguments: --nprocs 2"),
    # argparse reads a value that starts with '-' as an option: the line says how to write it
    (["plan", "r.yaml", "--memory-per-rank", "-5GiB"], "toolkit plan: error: argument --memory-per-rank: expected "
     "one argument; a value that starts with '-' is written --memory-per-rank=-5GiB"),
    (["plan", "r.yaml", "--memory-per-rank", "-h"], "toolkit plan: error: argument --memory-per-rank: expected one "
     "argument (see"),
])
def test_a_command_line_mistake_is_one_line_without_the_usage_block(args, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1 and err[0].startswith(words) and err[0].endswith("--help)"), err


def test_help_still_shows_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: toolkit launch")


def test_a_ctrl_c_that_a_library_import_turns_into_another_error_is_still_an_interrupt(monkeypatch, capsys):
    """Ctrl-C raises KeyboardInterrupt wherever Python is; inside a lazy import a library may turn it into another
    error (transformers' lazy module says "Could not import module 'LlamaConfig'"). After a Ctrl-C that error
    is the interrupt: one line, exit 130, no traceback, as a Ctrl-C anywhere else before the steps."""
    import os
    import signal

    import toolkit.cli
    import toolkit.errors

    def interrupted_import(args):  # a command whose import is interrupted, as transformers' _LazyModule reports it
        try:
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0)  # the handler runs at the next bytecode: here
        except KeyboardInterrupt as exc:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'. Are this object's requirements "
                                      "defined correctly?") from exc

    def broken_import(args):
        raise ModuleNotFoundError("Could not import module 'LlamaConfig'")

    def run(command):
        monkeypatch.setitem(toolkit.errors._ctrl_c, "seen", False)  # a fresh process's
        monkeypatch.setitem(toolkit.cli.COMMANDS, "validate", command)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a process starts (pytest's differs)
        try:
            return main(["validate", str(REPO / "recipes" / "llama-tiny.yaml")])
        finally:
            signal.signal(signal.SIGINT, previous)

    code = run(interrupted_import)
    err = capsys.readouterr().err
    assert code == 130 and err.strip() == "toolkit: interrupted", err
    with pytest.raises(ModuleNotFoundError):  # the same error without a Ctrl-C before it is a bug's traceback
        run(broken_import)
