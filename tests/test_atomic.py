import pytest

from toolkit.atomic import write_text_whole, write_whole


def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "run.json"
    write_text_whole(path, "old")

    def half_then_fail(tmp):
        tmp.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, half_then_fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
    write_text_whole(path, "new", durable=True)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["run.json"]
