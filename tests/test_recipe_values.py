"""Values a recipe may spell but the run cannot mean: each is one line naming the fix, exit 2, before any rank.

Validate calls (no training): a degree of 0 or less, an option the task, data format or schedule ignores. One
2-rank run: a warm-up that outlasts the run is a note, said once."""

import pytest

from conftest import write_recipe
from toolkit.cli import main


def _validate(tmp_path, tiny_llama_dir, overrides, *, nproc=2, **sections):
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out", **sections)
    return main(["validate", str(recipe), "--nproc", str(nproc), *[a for o in overrides for a in ("--set", o)]])


def _assert_one_line_exit_2(code, capsys, words):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and words in err[0], err


STRATEGY_VALUES = {
    "fsdp tp_degree negative": (2, ("strategy.name=fsdp", "strategy.tp_degree=-2"),
                                "strategy.tp_degree must be >= 1, got -2"),
    "fsdp tp_degree 0 (was fsdp alone)": (2, ("strategy.name=fsdp", "strategy.tp_degree=0"),
                                          "strategy.tp_degree must be >= 1, got 0"),
    "hybrid pipeline_degree 0 (was every rank)": (2, ("strategy.name=hybrid", "strategy.pipeline_degree=0"),
                                                  "strategy.pipeline_degree must be >= 2 (pipeline stages), got 0"),
    "hybrid pipeline_degree negative": (2, ("strategy.name=hybrid", "strategy.pipeline_degree=-2"),
                                        "strategy.pipeline_degree must be >= 2 (pipeline stages), got -2"),
    "hybrid pipeline with devices it never reads": (2, ("strategy.name=hybrid", "strategy.pipeline_degree=2",
                                                        "strategy.devices=[cpu,cpu]"),
                                                    "strategy.devices applies to hybrid without "
                                                    "strategy.pipeline_degree"),
    "ddp bucket_cap_mb 0": (2, ("strategy.name=ddp", "strategy.bucket_cap_mb=0"),
                            "strategy.bucket_cap_mb must be a finite number > 0"),
    "ddp bucket_cap_mb negative": (2, ("strategy.name=ddp", "strategy.bucket_cap_mb=-5"),
                                   "strategy.bucket_cap_mb must be a finite number > 0"),
    "stages_per_rank 0": (2, ("strategy.name=pipeline", "strategy.stages_per_rank=0"),
                          "strategy.stages_per_rank must be >= 1, got 0"),
    "stages_per_rank -1 interleaved": (2, ("strategy.name=pipeline", "strategy.schedule=interleaved-1f1b",
                                           "strategy.stages_per_rank=-1"),
                                       "strategy.stages_per_rank must be >= 1, got -1"),
    "pipeline on one rank names the world size": (1, ("strategy.name=pipeline",),
                                                  "a pipeline needs at least 2 ranks, one per stage, but the world "
                                                  "size is 1"),
}


@pytest.mark.parametrize("case", list(STRATEGY_VALUES))
def test_strategy_values_out_of_range_are_one_line(case, tmp_path, tiny_llama_dir, capsys):
    nproc, overrides, words = STRATEGY_VALUES[case]
    _assert_one_line_exit_2(_validate(tmp_path, tiny_llama_dir, overrides, nproc=nproc), capsys, words)


def test_tp_with_tp_degree_0_does_not_suggest_fsdp_with_0(tmp_path, tiny_llama_dir, capsys):
    code = _validate(tmp_path, tiny_llama_dir, ("strategy.name=tp", "strategy.tp_degree=0"))
    err = capsys.readouterr().err
    assert code == 2 and "tp_degree is 0; drop tp_degree" in err and "tp_degree 0 for" not in err, err


@pytest.mark.parametrize("accelerate, option", [(False, "--nproc"), (True, "--num_processes")])
@pytest.mark.parametrize("nproc, overrides, fix", [
    (2, ("strategy.name=single",), "use {option} 1 or strategy.name=ddp"),
    (1, ("strategy.name=pipeline",), "use {option} 2 or more"),
])
def test_a_process_count_fix_names_the_option_of_the_launcher_in_use(tmp_path, tiny_llama_dir, capsys, monkeypatch,
                                                                     accelerate, option, nproc, overrides, fix):
    if accelerate:  # what `accelerate launch` exports to every process it starts; it has no --nproc
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    else:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    code = _validate(tmp_path, tiny_llama_dir, overrides, nproc=nproc)
    _assert_one_line_exit_2(code, capsys, fix.format(option=option))


def test_the_resume_command_under_accelerate_is_its_own_launch(monkeypatch):
    from toolkit.launch.launcher import resume_hint

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr("sys.argv", ["toolkit", "train", "r.yaml", "--set", "seed=1"])
    assert resume_hint(2) == ("resume with: the same accelerate launch command (config file, --num_processes 2) "
                              "and `-m toolkit train r.yaml --set seed=1 --resume`")


IGNORED = {  # (task, format, overrides) -> what the line says
    "packing under classification": ("sequence-classification", ("data.packing=true",),
                                     "data.packing applies to model.task causal-lm only, but model.task is "
                                     "sequence-classification"),
    "num_labels under causal-lm": ("causal-lm", ("model.num_labels=3",),
                                   "model.num_labels applies to model.task sequence-classification only"),
    "messages_column under text": ("causal-lm", ("data.messages_column=turns",),
                                   "data.messages_column applies to data.format chat only, but data.format is text"),
    "chat_template under prompt-response": ("causal-lm", ("data.format=prompt-response", "data.chat_template=x"),
                                            "data.chat_template applies to data.format chat only"),
    "prompt_column under chat": ("causal-lm", ("data.format=chat", "data.prompt_column=q"),
                                 "data.prompt_column applies to data.format prompt-response only"),
    "response_column under text": ("causal-lm", ("data.response_column=a",),
                                   "data.response_column applies to data.format prompt-response only"),
    "label_column under causal-lm": ("causal-lm", ("data.label_column=stars",),
                                     "data.label_column applies to model.task sequence-classification only"),
    "text_column under chat": ("causal-lm", ("data.format=chat", "data.text_column=body"),
                               "data.text_column applies to data.format text only, but data.format is chat"),
    "min_lr_ratio under constant": ("causal-lm", ("optim.schedule=constant", "optim.min_lr_ratio=0.1"),
                                    "optim.min_lr_ratio applies to optim.schedule cosine/linear only"),
    "a skip bound under stop": ("causal-lm", ("train.max_consecutive_skips=3",),
                                "train.max_consecutive_skips applies to train.on_nonfinite skip only"),
    "tracking_dir without a tracker": ("causal-lm", ("train.tracking_dir=tb",),
                                       "train.tracking_dir applies only when train.report_to names a tracker"),
}


@pytest.mark.parametrize("case", list(IGNORED))
def test_an_option_the_task_format_or_schedule_ignores_is_one_line(case, tmp_path, tiny_llama_dir, capsys):
    task, overrides, words = IGNORED[case]
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, task=task, output_dir=tmp_path / "out")
    code = main(["validate", str(recipe), *[a for o in overrides for a in ("--set", o)]])
    _assert_one_line_exit_2(code, capsys, words)


def test_options_spelled_at_their_defaults_still_validate(tmp_path, tiny_llama_dir, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          model={"num_labels": 2}, optim={"schedule": "constant", "min_lr_ratio": 0.0},
                          data={"packing": False, "messages_column": "messages", "chat_template": None,
                                "prompt_column": "prompt", "response_column": "response",
                                "label_column": "label"})  # causal-lm: null, as llama-tiny.yaml says, or the default
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err



def test_a_warmup_as_long_as_the_run_is_said_once_and_the_run_goes_on(tmp_path, tiny_llama_dir, capsys):
    """Optimizer step k of a warm-up of w runs at k/(w+1) of optim.lr: a w at least the run's steps never
    reaches it nor follows the schedule. A short smoke run (max_steps 2 on a recipe's warm-up) is a common,
    deliberate case, so it is a note, not a refusal; rank 0 says it once. So is a recipe's eval_every kept
    when the run drops its eval data (--set data.eval=null): nothing is evaluated, and the run says so."""
    from conftest import launch, metrics

    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          optim={"warmup_steps": 3, "lr": 1e-3}, train={"max_steps": 2, "progress": False},
                          batch={"micro_batch_size": 4, "grad_accum_steps": 1})
    result = launch(recipe, nproc=2, overrides=("strategy.name=ddp", "data.eval=null", "train.eval_every=1"))
    note = "optim.warmup_steps 3 is not below the run's 2 optimizer steps"
    assert result.stderr.count(note) == 1, result.stderr[-2000:]  # two ranks, one note
    assert result.stderr.count("train.eval_every 1 is ignored: data.eval is null") == 1, result.stderr[-2000:]
    assert not any("eval_loss" in record for record in metrics(out))
    sets = ["--set", "data.eval=null", "--set", "train.eval_every=1"]
    assert main(["validate", str(recipe), "--nproc", "2", "--set", "strategy.name=ddp", *sets]) == 0
    said = capsys.readouterr().err  # validate says both before a run: the steps are known (train.max_steps)
    assert said.count(note) == 1 and said.count("train.eval_every 1 is ignored") == 1, said
    # the lr the run logged at its last step is the warm-up's 2/4 of optim.lr (independent arithmetic)
    assert abs(metrics(out)[-1]["lr"] - 1e-3 * 2 / 4) < 1e-12


def test_validate_says_where_dropout_makes_other_rank_splits_log_other_losses(tmp_path, tiny_bert_dir, capsys):
    """The README's claim (1 rank × accum 4 and 2 ranks × accum 2 log the same numbers) holds with dropout off:
    validate names the rate a run would drop out with, the model's own (read here from its config.json by
    transformers) where model.dropout is null, and says nothing once it is 0."""
    from transformers import AutoConfig

    own = AutoConfig.from_pretrained(str(tiny_bert_dir)).hidden_dropout_prob
    assert own > 0
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "out")
    cases = {"null": f"dropout {own:g} (the model's own", "0.2": "dropout 0.2 (model.dropout)", "0.0": None}
    for value, said in cases.items():
        assert main(["validate", str(recipe), "--set", f"model.dropout={value}"]) == 0
        err = capsys.readouterr().err
        if said is None:
            assert "dropout" not in err, err
        else:
            assert err.count(said) == 1 and "model.dropout: 0.0 makes them log the same numbers" in err, err


def test_zero_on_one_rank_without_offload_is_said_to_shard_nothing(tmp_path, tiny_llama_dir, capsys):
    """One H200 ran a 1B Llama's ZeRO-3 step at 3.0× single's (docs/benchmarks.md): on one rank ZeRO shards nothing
    and pays DeepSpeed's hooks. validate (and the run, through the same notes) says so where nothing is offloaded,
    and is silent at 2 ranks, with offload, and for stage 0."""
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    note = "on one rank shards nothing"
    cases = {("1", "strategy.stage=3"): "zero stage 3 on one rank shards nothing",
             ("1", "strategy.stage=null"): "zero stage 2 on one rank shards nothing",
             ("2", "strategy.stage=3"): None, ("1", "strategy.stage=0"): None,
             ("1", "strategy.offload_optimizer=true"): None}
    for (nproc, option), said in cases.items():
        code = main(["validate", str(recipe), "--nproc", nproc, "--set", "strategy.name=zero", "--set", option])
        err = capsys.readouterr().err
        assert code == 0, err
        assert (said in err) if said else (note not in err), (nproc, option, err)
