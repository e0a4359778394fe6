"""`toolkit compare` predicts each arm's step time on this machine's CPU profile, which it measured at its end every
time (~10 s, most of it starting gloo ranks for the bus). A profile measured for the same shapes, ranks and dtype
on this machine within a day is now read from the user's cache (toolkit/cost/calibrate.py: cached_cpu_profile);
anything else is measured anew. The measurement itself is test_scale_plan's calibrate test; here a shipped profile
stands in for it, so that what is counted is how often it runs."""

import os
import time

import pytest

from conftest import REPO

from toolkit.compare.predictions import measure_profile
from toolkit.config.files import load_recipe
from toolkit.cost import calibrate, hardware

RECIPE = str(REPO / "recipes" / "llama-tiny.yaml")


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """The ranks of each measurement made, with the cache in tmp_path/cache."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    made: list[int] = []

    def measure(*, nproc, model, tokens, dtype):
        made.append(nproc)
        return hardware.load("h100-sxm")

    monkeypatch.setattr(calibrate, "cpu_profile", measure)
    return made


def profile_of(tmp_path, name: str, *overrides: str, nproc: int = 2) -> tuple[hardware.Hardware, list[str]]:
    out, lines = tmp_path / name, []
    out.mkdir()
    measure_profile(out, load_recipe(RECIPE, list(overrides)), nproc=nproc, say=lines.append)
    return hardware.load(str(out / "hardware.yaml")), lines


def test_a_second_compare_of_the_same_shapes_reads_the_profile_the_first_measured(tmp_path, measured):
    first, said = profile_of(tmp_path, "a")
    assert measured == [2] and said == ["measuring this machine for the predicted step times (toolkit calibrate "
                                        "--hardware cpu)..."]
    again, said = profile_of(tmp_path, "b")
    assert measured == [2] and again == first
    assert len(said) == 1 and "measured by an earlier compare at " in said[0], said
    assert str(tmp_path / "cache" / "calibration") in said[0]  # where to delete it


@pytest.mark.parametrize("overrides, nproc", [
    (("batch.micro_batch_size=8",), 2),  # other GEMM shapes
    (("precision=bf16",), 2),
    ((), 4),  # other ranks: other threads a rank, another bus
])
def test_other_shapes_ranks_or_dtype_are_measured_anew(tmp_path, measured, overrides, nproc):
    profile_of(tmp_path, "a")
    profile_of(tmp_path, "b", *overrides, nproc=nproc)
    assert measured == [2, nproc]


def test_a_profile_a_day_old_or_damaged_is_measured_anew(tmp_path, measured):
    profile_of(tmp_path, "a")
    (cached,) = (tmp_path / "cache" / "calibration").glob("*.yaml")
    day_ago = time.time() - calibrate.PROFILE_CACHE_MAX_AGE_S - 60
    os.utime(cached, (day_ago, day_ago))
    profile_of(tmp_path, "b")
    assert measured == [2, 2]
    cached.write_text(cached.read_text()[:200])  # cut short
    profile_of(tmp_path, "c")
    assert measured == [2, 2, 2]
    profile_of(tmp_path, "d")  # and kept again whole
    assert measured == [2, 2, 2]
