"""Every benchmark script imports and parses its arguments: they run on machines and days no test does (the GPU
throughput script's import of a reader that no longer existed went unnoticed until a device session would have
found it). One interpreter imports them all (torch once): a few seconds."""

import subprocess
import sys

from conftest import REPO, toolkit_env

SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py"))

CHECK = """
import contextlib, io, runpy, sys
sys.path.insert(0, "benchmarks")
for name in sys.argv[1:]:
    sys.argv = [name + ".py", "--help"]  # a script: its --help, after every import; a helper module: imported
    with contextlib.redirect_stdout(io.StringIO()) as shown:
        try:
            runpy.run_path(f"benchmarks/{name}.py", run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), (name, exc.code)
    print(name, "usage" if "usage:" in shown.getvalue() else "ok", flush=True)
"""


def test_every_benchmark_script_imports():
    assert {"gpu_throughput", "memory_scaling", "checkpoint_cost", "compare_overhead"} <= set(SCRIPTS)
    result = subprocess.run([sys.executable, "-c", CHECK, *SCRIPTS], cwd=REPO, env=toolkit_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    said = dict(line.split() for line in result.stdout.splitlines())
    assert said.keys() == set(SCRIPTS), result.stdout
    assert {name for name, what in said.items() if what == "usage"} >= {"gpu_throughput", "memory_scaling",
                                                                        "checkpoint_cost", "compare_overhead"}
