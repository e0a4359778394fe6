"""The commands of the README and of its docs/ pages run as written, from a fresh copy of the project, so the
documentation cannot rot.

Every command in the command blocks of README.md and of every docs/*.md page (README.md first, then the pages in
name order; a command shown on two pages counts once) is listed below: run (each from a fresh copy, with fewer
steps where the README says `--set train.max_steps=2` is fine), run in sequence (the checkpoint walk-through of
docs/checkpoints.md), or not run here with the reason, and then at least parsed by the toolkit's own command line
with every file it names present. A command added to the README or a docs page without an entry here fails the
first test."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, forked_env

PREFIXES = ("make ", "toolkit ", "torchrun ", "accelerate launch ", "python ")
FEWER_STEPS = ("--set", "train.max_steps=2")

RUN = [  # each from a fresh copy, with FEWER_STEPS; the output each leaves
    ("toolkit train recipes/minilm-sst.yaml", "runs/minilm-sst/model/model.safetensors"),
    ("toolkit launch --nproc 2 recipes/minilm-sst.yaml --set strategy.name=ddp", "runs/minilm-sst/model/model.safetensors"),
]
SEQUENCE = [  # the checkpoint walk-through, one after the other in one fresh copy, exactly as written
    "toolkit launch --nproc 2 recipes/llama-tiny.yaml --set strategy.name=fsdp --set train.max_steps=10 "
    "--set checkpoint.every_steps=5",
    "toolkit launch --nproc 2 recipes/llama-tiny.yaml --set strategy.name=fsdp --set train.max_steps=10 "
    "--set checkpoint.every_steps=5 --resume",
    "toolkit train recipes/llama-tiny.yaml --set train.max_steps=10 --resume runs/llama-tiny/checkpoints/step-00000005",
    "toolkit convert runs/llama-tiny/checkpoints/step-00000010 my-model/",
]
NOT_RUN = {  # parsed and their files checked only
    "make demo": "the set-up, then `toolkit train recipes/minilm-sst.yaml` (run above)",
    "make test": "this suite",
    "torchrun --nproc_per_node 2 -m toolkit train recipes/minilm-sst.yaml --set strategy.name=ddp":
        "tests/test_launchers.py runs this launcher against toolkit launch (tiny model)",
    "accelerate launch --config_file recipes/accelerate/ddp.yaml -m toolkit train recipes/minilm-sst.yaml "
    "--set strategy.name=ddp": "tests/test_launchers.py runs this config file (tiny model)",
    "accelerate launch --config_file recipes/accelerate/fsdp.yaml -m toolkit train recipes/minilm-sst.yaml":
        "tests/test_launchers.py runs this config file (tiny model)",
    "accelerate launch --config_file recipes/accelerate/deepspeed.yaml -m toolkit train recipes/minilm-sst.yaml":
        "tests/test_launchers.py runs this config file (tiny model)",
    "accelerate launch --config_file recipes/accelerate/fsdp-v1-example.yaml -m toolkit train recipes/llama-tiny.yaml "
    "--set precision=bf16": "tests/test_launchers.py runs this config file (tiny model)",
    "toolkit launch --nnodes 2 --node-rank 0 --nproc 8 --rdzv-endpoint node001:29500 recipes/llama-tiny.yaml "
    "--set strategy.name=fsdp": "two machines; tests/test_multinode.py runs two nodes on 127.0.0.1",
    "toolkit compare recipes/minilm-sst.yaml --strategies single,ddp,fsdp,zero2,zero3,zero3-offload --nproc 2 "
    "--steps 30 --output runs/sst-compare": "six arms of MiniLM: minutes; tests/test_compare.py runs these arms",
    "toolkit compare experiments/fsdp-vs-zero.yaml": "a 16-arm matrix; tests/test_compare.py runs a matrix file",
    "toolkit report runs/sst-compare": "needs the compare above; tests/test_compare.py re-renders a report",
    "toolkit compare recipes/minilm-sst.yaml --strategies ddp,ddp-bf16c,ddp-powersgd,fsdp,fsdp-bf16reduce --steps 60":
        "five arms of MiniLM: minutes (benchmarks/communication.py runs them); tests/test_communication_levers.py runs "
        "a compare of levers (tiny model)",
    "toolkit train recipes/llama-tiny.yaml --set 'train.report_to=[tensorboard,mlflow]'":
        "tests/test_tracking.py reads both trackers back from a 2-rank run (tiny model)",
    "toolkit compare recipes/llama-tiny.yaml --strategies single,ddp,fsdp --steps 20 --output runs/tiny-compare "
    "--set train.report_to=tensorboard": "tests/test_compare.py runs a compare with train.report_to=tensorboard",
    "toolkit plan recipes/llama-tiny.yaml --nproc 2 --strategies ddp,fsdp,zero1,zero2,zero3,tp,pp-1f1b "
    "--memory-per-rank 40GiB": "tests/test_plan.py runs `toolkit plan` on this recipe (and checks its numbers)",
    "toolkit calibrate recipes/minilm-sst.yaml --hardware cpu --nproc 2":
        "tests/test_scale_plan.py calibrates this CPU and plans with the profile it wrote",
    "toolkit plan recipes/llama3-8b.yaml --hardware h100-sxm --nodes 2":
        "tests/test_scale_plan.py runs this plan (--json) and checks its numbers",
    "toolkit launch --nproc 2 recipes/llama-tiny.yaml --set parallel.dp_shard=2":
        "tests/test_parallel_layout.py runs these degrees against their presets (tiny model)",
    "toolkit launch --nproc 2 recipes/llama-tiny.yaml --set parallel.dp_replicate=2":
        "tests/test_parallel_layout.py runs these degrees against their presets (tiny model)",
    "toolkit launch --nproc 4 recipes/llama-tiny.yaml --set parallel.dp_shard=2 --set parallel.tp=2":
        "four ranks; tests/test_parallel_layout.py resolves dp_shard 2 × tp 2 to fsdp with tp_degree 2",
}
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # README first, then the pages by name


def readme_commands() -> list[str]:
    """The command lines of the command blocks of README.md and the docs/ pages (DOCS, in that order), comments
    dropped, spacing normalised; a command shown on more than one page (the README's short form of a page) once."""
    commands: list[str] = []
    for page in DOCS:
        fenced = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif fenced and line.startswith(PREFIXES):
                commands.append(shlex.join(shlex.split(line, comments=True)))
        assert not fenced, f"{page.name}: a command block is not closed"
    return list(dict.fromkeys(commands))


def fresh_copy(root: Path) -> Path:
    """What a fresh clone has (its files, linked), without the runs and the environment of this one."""
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {"runs", ".venv", ".git", "my-model"}:
            (root / entry.name).symlink_to(entry)
    return root


def run(command: str, cwd: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    args = shlex.split(command)
    assert args[0] == "toolkit"
    result = subprocess.run([sys.executable, "-m", "toolkit", *args[1:], *extra], cwd=cwd, env=forked_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "Traceback" not in result.stderr, \
        f"{command} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def test_every_readme_command_is_run_or_says_why_not():
    listed = [command for command, _ in RUN] + SEQUENCE + list(NOT_RUN)
    assert sorted(readme_commands()) == sorted(listed)


@pytest.mark.parametrize("command", list(NOT_RUN))
def test_commands_not_run_here_parse_and_name_files_that_exist(command):
    from toolkit.cli import build_parser

    args = shlex.split(command)
    if args[0] == "make":
        assert f"\n{args[1]}:" in (REPO / "Makefile").read_text()
        return
    named = [a for a in args if a.endswith((".yaml", ".json", ".py"))]
    assert all((REPO / a).is_file() for a in named), named
    if args[0] != "toolkit":  # a launcher: its part from `-m toolkit` on is the toolkit's command line
        args = args[args.index("toolkit"):]
    build_parser().parse_args(args[1:])  # argparse exits on a wrong option


@pytest.mark.parametrize("command,output", RUN, ids=[command for command, _ in RUN])
def test_readme_commands_run_from_a_fresh_copy(command, output, tmp_path):
    copy = fresh_copy(tmp_path / "clone")
    run(command, copy, FEWER_STEPS)
    assert (copy / output).is_file()


def test_the_checkpoint_walk_through_runs_as_written(tmp_path):
    copy = fresh_copy(tmp_path / "clone")
    for command in SEQUENCE:
        run(command, copy)
    root = copy / "runs" / "llama-tiny" / "checkpoints"
    aside, *checkpoints = sorted(p.name for p in root.iterdir())
    assert checkpoints == ["step-00000005", "step-00000010"]  # the single run's step 10
    # the fsdp run's own step 10, set aside when the single run branched from step 5 (docs/checkpoints.md)
    assert aside.startswith("set-aside-after-step-00000005-")
    assert sorted(p.name for p in (root / aside).iterdir()) == ["metrics.jsonl", "model", "step-00000010"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(copy / "my-model")
    assert model.config.tie_word_embeddings and (copy / "my-model" / "tokenizer.json").is_file()
