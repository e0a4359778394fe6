"""The tests' forked toolkit processes (tests/forked_ranks.py): what the server forks and what it execs, and
its messages, and the hook (tests/forking) that forks the toolkit processes a forked one starts."""

import socket
import subprocess
import sys
from pathlib import Path

import forked_ranks


def test_two_messages_read_in_one_go_are_two_messages():
    # a fast process ends before its client reads the pid: both replies then come in one recv
    ours, theirs = socket.socketpair()
    forked_ranks._send(theirs, {"pid": 12})
    forked_ranks._send(theirs, {"status": 512})
    theirs.close()
    messages = forked_ranks._Messages(ours)
    assert [messages.next(), messages.next(), messages.next()] == [{"pid": 12}, {"status": 512}, None]


def test_an_environment_differing_in_what_libraries_read_at_import_is_execd(monkeypatch):
    monkeypatch.setattr(forked_ranks, "_SERVER_ENV", {"PATH": "/bin", "HF_HUB_OFFLINE": "1"})
    monkeypatch.setattr(forked_ranks, "_DEFAULTS", {"HF_HUB_OFFLINE": "1"})  # the toolkit's default, added
    assert forked_ranks._differences({"PATH": "/bin"}) == []  # the rank adds the same default
    assert forked_ranks._differences({"PATH": "/bin", "RANK": "1", "TORCHELASTIC_RUN_ID": "x",
                                      "OMP_NUM_THREADS": "1", "TOOLKIT_FAULT": "y"}) == []  # read when used
    assert forked_ranks._differences({"PATH": "/bin", "HF_HUB_OFFLINE": "0"}) == ["HF_HUB_OFFLINE"]
    assert forked_ranks._differences({"PATH": "/bin", "MALLOC_ARENA_MAX": "2"}) == ["MALLOC_ARENA_MAX"]
    assert forked_ranks._differences({}) == ["PATH"]


def _hook_args(monkeypatch, argv: list[str]) -> list[str] | None:
    import importlib.util

    from conftest import FORKING

    spec = importlib.util.spec_from_file_location("forking_hook", FORKING / "sitecustomize.py")
    hook = importlib.util.module_from_spec(spec)
    monkeypatch.delenv(forked_ranks.FORKED_RANKS_ENV, raising=False)  # loading it here must not make a client
    spec.loader.exec_module(hook)
    monkeypatch.setattr(sys, "orig_argv", argv)
    return hook._toolkit_args()


def test_the_hook_takes_toolkit_commands_only(monkeypatch):
    assert _hook_args(monkeypatch, ["python", "-m", "toolkit", "train", "r.yaml"]) == ["train", "r.yaml"]
    assert _hook_args(monkeypatch, ["python", "-u", "-m", "toolkit", "launch"]) == ["launch"]  # as torchrun starts it
    assert _hook_args(monkeypatch, ["python", "-X", "importtime", "-m", "toolkit", "train"]) is None
    assert _hook_args(monkeypatch, ["python", "-m", "torch.distributed.run", "-m", "toolkit"]) is None
    assert _hook_args(monkeypatch, ["python", "benchmarks/startup.py"]) is None


def test_a_toolkit_process_started_by_a_forked_one_asks_the_server_and_runs_plain_when_refused():
    # what a forked `toolkit launch` or compare starts: `python -m toolkit ...` with the server's variable; here
    # with a variable a fork cannot give, so the server logs it as exec'd and the process runs as it is
    import conftest

    env = {**conftest.forked_env(), "MALLOC_ARENA_MAX": "2"}
    log = Path(f"{conftest._RANK_SERVER}.exec-log")
    before = log.read_text().splitlines() if log.is_file() else []
    done = subprocess.run([sys.executable, "-m", "toolkit", "--help"], cwd=conftest.REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
    assert log.read_text().splitlines()[len(before):] == ["exec'd: --help: MALLOC_ARENA_MAX"]


def test_the_ranks_of_a_strategy_on_deepspeed_are_forked_from_the_server_that_imported_it(tmp_path, monkeypatch,
                                                                                           tiny_llama_dir):
    # the first server sends these to the second (_serve_deepspeed), which imported the zero strategy's
    # runtime_modules as such a rank does before it measures its runtime; every other process stays with the first
    from conftest import write_recipe

    monkeypatch.chdir(tmp_path)  # the check reads the recipe from the client's folder, where it goes
    write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    (tmp_path / "zero.yaml").write_text((tmp_path / "r.yaml").read_text().replace("name: single", "name: zero"))

    def sent(*args: str, env: dict | None = None) -> bool:
        return forked_ranks._runs_on_deepspeed({"args": list(args), "cwd": str(tmp_path), "env": env or {}})

    assert sent("train", "r.yaml", "--set", "strategy.name=zero", "--set", "strategy.stage=3")
    assert sent("train", "zero.yaml")  # the strategy named in the file
    assert sent("train", "r.yaml", env={"ACCELERATE_USE_DEEPSPEED": "true"})  # as `accelerate launch` sets it
    assert not sent("train", "r.yaml")
    assert not sent("train", "zero.yaml", "--set", "strategy.name=fsdp")
    assert not sent("launch", "zero.yaml", "--nproc", "2")  # the launcher imports no DeepSpeed; its ranks do
    assert not sent("train", "missing.yaml", "--set", "strategy.name=zero")  # the rank says the mistake


def test_a_runtime_module_the_installed_library_lacks_is_skipped_a_missing_library_is_not():
    import pytest

    from toolkit.strategies.base import import_runtime_module

    import_runtime_module("deepspeed.runtime.zero.no_such_optimizer")  # a version without it: nothing to import
    with pytest.raises(ModuleNotFoundError):
        import_runtime_module("no_such_library")
    with pytest.raises(ModuleNotFoundError):
        import_runtime_module("no_such_library.submodule")
