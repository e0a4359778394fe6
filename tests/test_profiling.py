"""train.profile_steps: torch.profiler over a window of optimizer steps, files in output_dir/profile."""

import json

import pytest

from conftest import launch, metrics, write_recipe
from toolkit.compare import measure
from toolkit.observe.comm import count_step


def test_profiled_steps_write_a_trace_and_an_op_table_and_are_left_out_of_throughput(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          train={"max_steps": 5, "profile_steps": [3, 4], "consistency_check_every": None})
    launch(recipe, nproc=1)
    trace = json.loads((out / "profile" / "rank0.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::mm", "aten::_log_softmax"} <= names or {"aten::addmm", "aten::_log_softmax"} <= names, names
    ops = (out / "profile" / "ops.txt").read_text()
    assert ops.startswith("steps 3..4, rank 0, by self_cpu_time_total") and "aten::" in ops
    assert not [p for p in (out / "profile").iterdir() if p.name.startswith(".")]  # no partial file left
    records = metrics(out)
    assert [r["step"] for r in records if r.get("profiled")] == [3, 4]
    run = json.loads((out / "run.json").read_text())
    assert run["profile"] == {"steps": [3, 4], "folder": str(out / "profile")}
    # the collectives are counted at step 5, after the window: inside it, the counting dispatch mode topped
    # ops.txt and every op showed twice
    assert run["comm_per_step"]["step"] == 5 and "PythonDispatchMode" not in ops, ops[:600]
    assert [r["step"] for r in records if "comm_bytes" in r] == [5]
    # throughput is the median over the steady steps without the profiled ones: a profiled step made very
    # slow must not move it
    slowed = [{**r, "tokens_per_s": 1.0} if r.get("profiled") else r for r in records]
    assert measure.throughput(slowed)["tokens_per_s"] == measure.throughput(records)["tokens_per_s"]


@pytest.mark.parametrize("done, total, window, step", [
    (0, 10, None, 3), (0, 2, None, 2), (5, 10, None, 6),  # step 3, or the nearest the run has
    (0, 10, (5, 6), 3), (0, 10, (2, 4), 5),  # outside the window as it is; else right after it
    (0, 4, (2, 4), 1), (0, 4, (1, 4), None), (2, 4, (3, 4), None),  # else before it; else nothing is counted
])
def test_collectives_are_counted_outside_the_profiled_steps(done, total, window, step):
    assert count_step(done=done, total_steps=total, profiled=window) == step
