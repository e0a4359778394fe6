"""A checkpoint whose bytes changed after the save (same sizes: bit rot, a bad copy) is refused before any tensor
is read: exit code 2, one line naming the file, nothing written. One tiny single-process run writes the checkpoint
every test copies; only the resume of the unchanged one trains (one step). Single-process runs go in this
process (no interpreter start, no imports again): the file's whole cost is the 2-rank launch and two steps."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import write_recipe
from toolkit.cli import main

AGAIN = "copy the whole folder again, or use an earlier checkpoint"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_llama_dir) -> Path:
    """One step of a 2-layer Llama, its checkpoint written at the end."""
    root = tmp_path_factory.mktemp("checkpoint-digest")
    path = write_recipe(root / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=root / "run",
                        train={"max_steps": 1, "consistency_check_every": None}, checkpoint={"final": True})
    assert main(["train", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def checkpoint(recipe) -> Path:
    return recipe.parent / "run" / "checkpoints" / "step-00000001"


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    return copy


def _flip_a_byte(copy: Path) -> str:
    """One bit of the middle byte of the largest shard changed, its size kept: the shard's name."""
    shard = max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard.name


def _one_line(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("toolkit: error:") and all(w in lines[0] for w in words), lines


def test_the_save_records_every_file_of_the_checkpoint(checkpoint):
    listed = json.loads((checkpoint / "digests.json").read_text())["files"]
    on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(listed) == on_disk - {"digests.json"} and {".metadata", "manifest.json", "hf/config.json"} <= on_disk
    assert json.loads((checkpoint / "manifest.json").read_text())["digests"] == "digests.json"


@pytest.mark.parametrize("command", ["train", "launch zero3", "convert"])
def test_a_shard_with_one_byte_changed_is_one_line_naming_it(command, recipe, checkpoint, tmp_path, capfd):
    """ZeRO-3 on 2 ranks: each rank hashes its share of the files and both stop with the line (the launcher
    itself does not hash: one pass over the bytes)."""
    copy = _copy(checkpoint, tmp_path)
    shard = _flip_a_byte(copy)
    out = tmp_path / "out"
    args = {"train": ["train", str(recipe), "--set", f"output_dir={out}", "--resume", str(copy)],
            "launch zero3": ["launch", "--nproc", "2", str(recipe), "--set", "strategy.name=zero", "--set",
                             "strategy.stage=3", "--set", "batch.micro_batch_size=4", "--set", f"output_dir={out}",
                             "--resume", str(copy)],
            "convert": ["convert", str(copy), str(out)]}[command]
    code = main(args)
    _one_line(code, capfd.readouterr().err, f"checkpoint {copy} is damaged: its file {shard} does not hold the "
              "bytes it was saved with", AGAIN)
    assert not out.exists()


@pytest.mark.parametrize("damage, words", [
    ("digests.json lost", ("is incomplete: its digests.json, named in its manifest.json, is missing",)),
    ("digests.json garbage", ("its digests.json is unreadable",)),
    ("a file grown", ("its file recipe.yaml has", "it was saved with")),
])
def test_damaged_digests_or_a_changed_size_is_one_line(damage, words, checkpoint, tmp_path, capsys):
    copy = _copy(checkpoint, tmp_path)
    if damage == "digests.json lost":
        (copy / "digests.json").unlink()
    elif damage == "digests.json garbage":
        (copy / "digests.json").write_text("{not json")
    else:
        with open(copy / "recipe.yaml", "a") as handle:
            handle.write("# edited\n")
    out = tmp_path / "out"
    _one_line(main(["convert", str(copy), str(out)]), capsys.readouterr().err, *words)
    assert not out.exists()


def test_a_checkpoint_written_before_digests_were_recorded_converts(checkpoint, tmp_path):
    copy = _copy(checkpoint, tmp_path)
    (copy / "digests.json").unlink()
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["digests"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["convert", str(copy), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def test_an_unchanged_checkpoint_resumes(recipe, checkpoint, tmp_path, capsys):
    out = tmp_path / "resumed"
    code = main(["train", str(recipe), "--set", "train.max_steps=2", "--set", f"output_dir={out}",
                 "--resume", str(checkpoint)])
    assert code == 0 and "resume: weights and optimizer state from" in capsys.readouterr().err
    assert (out / "checkpoints" / "step-00000002" / "digests.json").is_file()


def test_digests_switched_off_records_none_and_the_checkpoint_reads_as_before(recipe, checkpoint, tmp_path):
    """checkpoint.digests: false, for checkpoints so large that hashing them at each commit costs minutes."""
    out = tmp_path / "resumed"
    assert main(["train", str(recipe), "--set", "train.max_steps=2", "--set", f"output_dir={out}",
                 "--set", "checkpoint.digests=false", "--resume", str(checkpoint)]) == 0
    saved = out / "checkpoints" / "step-00000002"
    assert not (saved / "digests.json").exists() and "digests" not in json.loads((saved / "manifest.json").read_text())
    assert main(["convert", str(saved), str(tmp_path / "model")]) == 0  # read as a checkpoint from before digests
    # the converted weights as readable as the rest (safetensors creates its file 0600 whatever the umask)
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "model").iterdir()} == {
        (tmp_path / "model" / "config.json").stat().st_mode & 0o777}
