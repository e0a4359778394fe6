"""A checkpoint that is incomplete or was written for another model, and an output folder that cannot be made:
exit code 2, one line naming the problem and the fix, nothing written. One tiny single-process run (a model from a
config, so that a test can change its shapes) writes the checkpoint every test shares; no test trains."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import MINILM, launch, write_recipe
from toolkit.cli import main

CONFIG = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """A 2-layer Llama built from its config, one step, its checkpoint written at the end."""
    root = tmp_path_factory.mktemp("checkpoint-errors")
    path = write_recipe(root / "recipe.yaml", model_dir=root, output_dir=root / "run",
                        train={"max_steps": 1, "consistency_check_every": None}, checkpoint={"final": True})
    data = yaml.safe_load(path.read_text())
    data["model"] = {"config": CONFIG, "tokenizer": MINILM, "task": "causal-lm", "dropout": 0.0}
    path.write_text(yaml.safe_dump(data))
    launch(path, nproc=1)
    return path


@pytest.fixture(scope="module")
def checkpoint(recipe) -> Path:
    return recipe.parent / "run" / "checkpoints" / "step-00000001"


def _assert_one_line_exit_2(code, capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("toolkit: error:") and all(w in err[0] for w in words), err


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("command", ["train", "launch", "convert"])
def test_a_checkpoint_missing_a_data_file_is_one_line_naming_it(command, recipe, checkpoint, tmp_path, capfd):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    (copy / "__0_0.distcp").unlink()
    out = tmp_path / "out"
    args = {"train": ["train", str(recipe), "--set", f"output_dir={out}", "--resume", str(copy)],
            "launch": ["launch", "--nproc", "1", str(recipe), "--set", f"output_dir={out}", "--resume", str(copy)],
            "convert": ["convert", str(copy), str(out)]}[command]
    _assert_one_line_exit_2(main(args), capfd, "is incomplete", "__0_0.distcp")  # a launch's rank says it
    assert not out.exists()


def test_a_checkpoint_of_other_tensor_shapes_is_one_line_naming_a_tensor(recipe, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", str(recipe), "--set", "model.config.hidden_size=16", "--set", f"output_dir={out}",
                 "--resume", str(checkpoint)])
    _assert_one_line_exit_2(code, capsys, "'model.embed_tokens.weight' with shape [30522, 32]",
                            "this model's is [30522, 16]", "written for another model")
    assert not out.exists()


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_checkpoint_with_layers_the_model_lacks_is_refused(weights_only, recipe, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", str(recipe), "--set", "model.config.num_hidden_layers=1", "--set", f"output_dir={out}",
                 "--resume", str(checkpoint), *(["--resume-weights-only"] if weights_only else [])])
    # layer 1: 4 attention + 3 MLP projections + 2 norms
    _assert_one_line_exit_2(code, capsys, "'model.layers.1.", "that this model does not have (9 such)",
                            "written for another model")
    assert not out.exists()


def test_zero3_refuses_a_checkpoint_with_layers_the_model_lacks(recipe, checkpoint, tmp_path, capfd, forked_children):
    """ZeRO-3 reads a checkpoint one module at a time into its partitions (low-memory loading), not as a whole
    state dict: two ranks, through the launcher (a rank of a process group ends without tearing it down), whose
    stderr is the ranks' own (capfd)."""
    out = tmp_path / "out"
    code = main(["launch", "--nproc", "2", str(recipe), "--set", "model.config.num_hidden_layers=1",
                 "--set", "strategy.name=zero", "--set", "strategy.stage=3", "--set", "batch.micro_batch_size=4",
                 "--set", f"output_dir={out}",
                 "--resume", str(checkpoint)])
    _assert_one_line_exit_2(code, capfd, "'model.layers.1.", "that this model does not have (9 such)",
                            "written for another model")
    assert not (out / "checkpoints").exists() and not (out / "model").exists()


@pytest.mark.parametrize("where", ["under a file", "in /proc", "inside the checkpoint"])
def test_convert_into_a_folder_it_cannot_or_must_not_make_is_one_line(where, recipe, checkpoint, capsys):
    if where == "in /proc" and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    dest, words = {"under a file": (checkpoint.parent.parent / "run.json" / "sub", "run.json is a file, not a folder"),
                   "in /proc": (Path("/proc/toolkit-convert"), "no folder can be made in /proc"),
                   "inside the checkpoint": (checkpoint / "inside", "is inside the checkpoint")}[where]
    before = _files(checkpoint)
    _assert_one_line_exit_2(main(["convert", str(checkpoint), str(dest)]), capsys, words)
    assert not dest.exists() and _files(checkpoint) == before


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="no /proc here")
@pytest.mark.parametrize("command", ["train", "launch"])
def test_an_output_dir_that_cannot_be_made_is_one_line(command, recipe, capfd):
    out = "/proc/toolkit-run"
    args = ["train", str(recipe)] if command == "train" else ["launch", "--nproc", "1", str(recipe)]
    _assert_one_line_exit_2(main([*args, "--set", f"output_dir={out}"]), capfd,
                            f"output_dir {out}: no folder can be made in /proc", "choose another output_dir")
    assert not Path(out).exists()


def test_an_output_dir_whose_probe_another_rank_removed_can_still_be_made(tmp_path, monkeypatch):
    """check_creatable's probe folder, removed before this process removes it: by another rank that refused the run
    for a mistake of its own and took what appeared in output_dir since it started (process/cleanup.py
    remove_made). The folder was made, so output_dir can be; this rank said "no folder can be made ... (No such
    file or directory)" beside the other rank's line (seen once in a full test run)."""
    from toolkit.checkpoint import store

    made = []
    real = tempfile.mkdtemp

    def made_then_taken(*args, **kwargs):
        path = real(*args, **kwargs)
        os.rmdir(path)  # the other rank's cleanup, between this process's mkdir and its rmdir
        made.append(path)
        return path

    monkeypatch.setattr(store.tempfile, "mkdtemp", made_then_taken)
    store.check_creatable(tmp_path / "out")
    assert made and not any(Path(path).exists() for path in made)


@pytest.mark.parametrize("source, words", [
    ("manifest", ("manifest.json does not exist or is not a folder", "(the folder holding it: ")),
    ("run folder", ("is not a toolkit checkpoint", "pass one of its checkpoints/step-N")),
])
def test_convert_of_a_file_or_run_folder_names_the_checkpoint_folder_not_resume(source, words, recipe, checkpoint,
                                                                                 tmp_path, capsys):
    """convert takes no --resume: its hint names the folder to pass. (A run folder holding a complete checkpoint
    is converted from its newest: tests/test_checkpoints.py; this one holds none.)"""
    given = checkpoint / "manifest.json" if source == "manifest" else tmp_path / "run"
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    code = main(["convert", str(given), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and all(w in err[0] for w in words) and "--resume" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_run_that_wrote_no_checkpoint_is_refused_with_a_way_out(tmp_path):
    """A run that failed before its first checkpoint: a rerun was refused ('continue it with --resume') and
    --resume too ('start the run without --resume'); each message sent the user to the other."""
    from toolkit.checkpoint.store import check_output_dir, find_resume
    from toolkit.errors import RecipeError

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"status": "failed"}))
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(RecipeError) as rerun:
        check_output_dir(out, resume=False)
    assert str(rerun.value) == (f"output_dir {out} holds a run that wrote no checkpoint, so --resume cannot continue "
                                "it; remove that folder to start again there, or write this one elsewhere with "
                                "--set output_dir=OTHER")
    with pytest.raises(RecipeError) as resumed:
        find_resume(out, None)
    assert str(resumed.value) == (f"--resume: no complete checkpoint in {out / 'checkpoints'}; remove {out} (its run "
                                  "wrote no checkpoint) and start again without --resume, or pass a checkpoint "
                                  "folder with --resume PATH")


def _without_digests(checkpoint: Path, copy: Path) -> Path:
    """A copy as a checkpoint from before digests were recorded (or with checkpoint.digests false): damage to it
    is found by reading it, not by a file's hash."""
    shutil.copytree(checkpoint, copy)
    (copy / "digests.json").unlink()
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["digests"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_convert_of_a_damaged_hf_config_or_an_uncommitted_save_is_one_line(checkpoint, tmp_path, capsys):
    copy = _without_digests(checkpoint, tmp_path / "copy")
    (copy / "hf" / "config.json").write_text("{")  # transformers' own refusal was a 52-line traceback
    _assert_one_line_exit_2(main(["convert", str(copy), str(tmp_path / "out")]), capsys,
                            f"checkpoint {copy}: its hf/ folder (the model's config and tokenizer) is unreadable",
                            "the checkpoint is damaged")
    # a save never committed (a crash mid-save leaves .step-N.partial), complete as it may look
    partial = tmp_path / "checkpoints" / ".step-00000001.partial"
    shutil.copytree(checkpoint, partial)
    _assert_one_line_exit_2(main(["convert", str(partial), str(tmp_path / "out")]), capsys,
                            "is a save that was never committed", "use a complete checkpoint")
    assert not (tmp_path / "out").exists()


def test_convert_onto_a_full_disk_is_one_line_and_keeps_nothing(checkpoint, tmp_path):
    """A model file that cannot be written (here no file may grow past 64 kB: EFBIG, as a quota or a full disk
    refuses it): one line, exit 1, and neither the partial folder nor the folders made for OUT are left."""
    import resource
    import subprocess
    import sys

    from conftest import REPO, toolkit_env

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "a" / "b" / "model"
    result = subprocess.run([sys.executable, "-m", "toolkit", "convert", str(checkpoint), str(out)], cwd=REPO,
                            env=toolkit_env(), capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and lines[-1] == f"toolkit: {out} could not be written (File too large (EFBIG)); " \
        "nothing of it was kept: free space or choose another folder", result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # a/, a/b/ and .model.partial all gone


class _RunsCode:
    """What a hostile .metadata holds: unpickling it calls os.system (pickle's __reduce__), which torch's own
    reader (pickle.load) would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("hostile", ["a global", "a class's state", "a pickled entry"])
@pytest.mark.parametrize("command", ["train", "convert"])
def test_a_checkpoint_whose_metadata_would_run_code_is_refused_without_running_it(hostile, command, recipe,
                                                                                 checkpoint, tmp_path, capsys):
    """Nothing is unpickled on load but DCP's .metadata, and that only as DCP's own metadata classes: a global
    other than those is refused before it is called, so is state set on a class (pickle's BUILD: it would change
    the class for the whole process), and so is an entry stored as a pickled object (DCP reads such an entry
    with torch.load(weights_only=False)). The digests guard against damage, not against whoever rewrote
    them: a checkpoint without digests shows it."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from toolkit.checkpoint.verify import SafeReader

    copy = _without_digests(checkpoint, tmp_path / "copy")
    marker = tmp_path / "ran"
    if hostile == "a global":
        (copy / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
        words = "os.system is not part of a DCP checkpoint's metadata" if os.name != "posix" else \
            "posix.system is not part of a DCP checkpoint's metadata"
    elif hostile == "a class's state":  # BUILD on an allowed class: every PosixPath of the process names /x
        metadata = pickle.dumps(SafeReader(str(copy)).read_metadata(), protocol=2)[2:]
        (copy / ".metadata").write_bytes(b"\x80\x02cpathlib\nPosixPath\nN}X\x04\x00\x00\x00_strX\x02\x00\x00\x00/xs"
                                         b"\x86b0" + metadata)
        words = "it sets the state of <class 'pathlib.PosixPath'>, which DCP's metadata never does"
    else:
        metadata = SafeReader(str(copy)).read_metadata()
        key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        (copy / ".metadata").write_bytes(pickle.dumps(metadata))
        words = f"{key!r} is stored as a pickled object, which no toolkit checkpoint holds"
    out = tmp_path / "out"
    args = ["train", str(recipe), "--set", f"output_dir={out}", "--resume", str(copy)] if command == "train" else \
        ["convert", str(copy), str(out)]
    _assert_one_line_exit_2(main(args), capsys, f"checkpoint {copy}: its DCP metadata is unreadable", words)
    assert not marker.exists() and not out.exists() and str(Path("/a")) == "/a"


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_checkpoint_without_lora_adapters_resumed_with_model_lora_names_that_setting(weights_only, recipe,
                                                                                       checkpoint, tmp_path, capsys):
    """Every adapted layer's weights have other names under peft (base_layer, lora_A): the line was "no weight
    'model.layers.0...base_layer.weight'", not the one setting that differs."""
    out = tmp_path / "out"
    code = main(["train", str(recipe), "--set", "model.lora={r: 4}", "--set", f"output_dir={out}",
                 "--resume", str(checkpoint), *(["--resume-weights-only"] if weights_only else [])])
    _assert_one_line_exit_2(code, capsys, "holds a model without LoRA adapters and this run's has them: drop "
                            "model.lora to continue it, or write it out with `toolkit convert`")
    assert not out.exists()


def test_a_strategys_own_state_in_a_checkpoint_is_read_without_running_code(tmp_path):
    """PowerSGD's and local SGD's state travels in a checkpoint as bytes of torch.save (a comm.<rank> tensor, which
    .metadata's checks let through): read back with weights_only, it builds tensors, numbers and numpy arrays
    (PowerSGD's generator state) and refuses any other global before calling it."""
    import io
    import pickle

    import numpy as np
    import torch

    from toolkit.checkpoint.verify import load_blob

    rng = np.random.RandomState(7)
    buffer = io.BytesIO()
    torch.save({"iter": 3, "rng": rng.get_state(), "parameters": {"w": {"p": torch.ones(2)}}, "blobs": [b"x"]},
               buffer)
    saved = load_blob(buffer.getvalue())
    again = np.random.RandomState()
    again.set_state(saved["rng"])
    assert again.randint(1 << 30) == rng.randint(1 << 30) and saved["blobs"] == [b"x"]
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"state": _RunsCode(marker)}, buffer)
    with pytest.raises(pickle.UnpicklingError):
        load_blob(buffer.getvalue())
    assert not marker.exists()
