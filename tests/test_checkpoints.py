"""Checkpoints: a resumed run equals an uninterrupted one, under the same strategy and across strategies and
world sizes; a save that died is never picked up; `toolkit convert`; every mistake one line.

Each uninterrupted run (6 steps, a checkpoint every 3) is done once and shared. A run "stopped after step 3"
is what a crash after step 5 leaves: the step-3 checkpoint and metrics of steps 1-5 (the resume drops 4-5)."""

import json
import re
import resource
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import (REPO, exported_weights, launch, losses, metrics, run_cli, strict_loads, toolkit_env,
                      write_recipe)
from toolkit.checkpoint import state, store, verify
from toolkit.errors import RecipeError
from toolkit.process import faults

SOURCES = {"ddp": 2, "fsdp": 2, "zero2-offload": 2, "zero3": 2, "fsdp-async": 2, "pp": 2, "cp2": 2, "hsdp-tp2": 4,
           "pp-tp2": 4, "pp-fsdp-tp2": 8, "pp-tp2-sp-lossp": 4, "pp-head-zb": 2}
CROSS = [("zero3", 2, "fsdp", 2), ("fsdp", 2, "ddp", 1), ("ddp", 2, "zero3", 2), ("zero2-offload", 2, "single", 1),
         ("fsdp", 2, "fsdp", 1), ("ddp", 2, "pp", 2), ("pp", 2, "single", 1),
         ("ddp", 2, "tp", 2),  # tp: the split weights and their Adam state are DTensors
         ("cp2", 2, "single", 1), ("fsdp", 2, "cp2", 2),  # cp2: FSDP's shards over the flattened dp_shard × cp mesh
         ("hsdp-tp2", 4, "single", 1),  # HSDP × tp: DTensors over a 3-D mesh (dp_replicate, dp_shard, tp)
         # tensor-parallel pipeline stages: each stage's split weights DTensors over its tp ranks, the rest whole on
         # each (saved once); read back into one process, and from ddp's whole tensors into the stages' slices
         ("pp-tp2", 4, "single", 1), ("ddp", 2, "pp-tp2", 4),
         # and FSDP2-sharded over their replicas: each tp slice's dim-0 shards, DTensors over (dp_shard, tp)
         ("ddp", 2, "pp-fsdp-tp2", 8), ("pp-fsdp-tp2", 8, "single", 1),
         # under sequence parallelism the stages' norms are DTensors too (replicated over tp); under loss_parallel the
         # last stage's head and the first's tied embedding hold a tp rank's rows of the vocabulary
         ("pp-tp2-sp-lossp", 4, "single", 1),
         # split_head: the tied weight's copies on every stage, two a rank, saved once under the embedding's name
         ("pp-head-zb", 2, "single", 1)]


def strategy_overrides(name: str) -> tuple[str, ...]:
    if name == "fsdp-async":  # dcp.async_save: written in the background while training goes on
        return ("strategy.name=fsdp", "checkpoint.async=true")
    if name == "zero3":  # written in the background: each rank's pieces of DeepSpeed's partitions, as chunks
        return ("strategy.name=zero", "strategy.stage=3", "checkpoint.async=true")
    if name == "zero2-offload":  # the same pieces, written synchronously; Adam on the CPU (DeepSpeed's own)
        return ("strategy.name=zero", "strategy.stage=2", "strategy.offload_optimizer=true")
    if name == "pp":  # two stages, each rank holds half the blocks (the tied embedding on both ends)
        return ("strategy.name=pipeline", "strategy.schedule=1f1b")
    if name == "pp-head-zb":  # 4 stages over 2 ranks, the head's rows on all 4: a rank holds two copies of the tied
        # weight, whose Adam states a resume fills alike
        return ("strategy.name=pipeline", "strategy.schedule=interleaved-zb", "strategy.stages_per_rank=2",
                "strategy.split_head=true")
    if name == "cp2":  # context parallel: each sequence split over the 2 ranks
        return ("parallel.cp=2",)
    if name == "hsdp-tp2":  # 2 replica groups × 2 tp ranks
        return ("parallel.dp_replicate=2", "parallel.tp=2")
    if name == "pp-tp2":  # 2 stages, each over 2 tp ranks
        return ("parallel.pp=2", "parallel.tp=2")
    if name == "pp-tp2-sp-lossp":  # and their norms on sequence shards, their vocabulary split
        return ("parallel.pp=2", "parallel.tp=2", "strategy.sequence_parallel=true", "strategy.loss_parallel=true")
    if name == "pp-fsdp-tp2":  # 2 stages × 2 fsdp replicas × 2 tp ranks; 1f1b needs 2 micro-batches a replica
        return ("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "batch.micro_batch_size=2")
    return (f"strategy.name={name}",)


class CheckpointRuns:
    def __init__(self, root, recipe):
        self.root, self.recipe, self.done = root, recipe, {}

    def full(self, name: str):
        """The uninterrupted run of strategy `name` at its SOURCES world size."""
        if name not in self.done:
            out = self.root / f"full-{name}"
            launch(self.recipe, nproc=SOURCES[name], overrides=(*strategy_overrides(name), f"output_dir={out}"))
            self.done[name] = out
        return self.done[name]

    def resumed(self, source: str, target: str, nproc: int, *, extra=()):
        """`target` at `nproc` ranks, resumed from the step-3 checkpoint `source` wrote."""
        out = self.root / f"resume-{source}-to-{target}{nproc}"
        crashed(self.full(source), out)
        result = launch(self.recipe, nproc=nproc, overrides=(*strategy_overrides(target), f"output_dir={out}"),
                        extra=("--resume", *extra))
        return out, result


def crashed(full_run, out):
    """What a run that died after step 5 leaves: metrics of steps 1-5, its step-3 checkpoint, no step 6."""
    out.mkdir(parents=True)
    lines = (full_run / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:5]))
    shutil.copytree(full_run / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000003")


def checkpointed_recipe(root, model_dir, *, final: bool):
    """6 steps of global batch 8, a checkpoint every 3: what the resume tests crash after step 5 and continue."""
    return write_recipe(root / "recipe.yaml", model_dir=model_dir, output_dir=root / "unused",
                        batch={"global_batch_size": 8, "micro_batch_size": 4, "grad_accum_steps": None},
                        train={"max_steps": 6, "eval_every": None, "consistency_check_every": None, "progress": False},
                        checkpoint={"every_steps": 3, "keep_last": 2, "final": final})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tied_llama_dir):
    root = tmp_path_factory.mktemp("checkpoints")
    return CheckpointRuns(root, checkpointed_recipe(root, tiny_tied_llama_dir, final=True))


def assert_continues(resumed, reference, *, rtol: float):
    """All 6 per-step losses and the final weights of `resumed` equal the uninterrupted `reference`'s."""
    steps = metrics(resumed)
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]  # steps 4-5 of the crashed run were dropped
    assert [m["lr"] for m in steps] == [m["lr"] for m in metrics(reference)]  # the same schedule, taken up exactly
    torch.testing.assert_close(torch.tensor(losses(resumed), dtype=torch.float64),
                               torch.tensor(losses(reference), dtype=torch.float64), rtol=rtol, atol=0.0)
    got, want = exported_weights(resumed), exported_weights(reference)
    assert got.keys() == want.keys()
    for key in want:  # per element |a - b| <= 1e-6 + 1e-5·|a|
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


# ddp's own resume is the one the restart and SIGTERM tests below do, after a real interruption; fsdp's is
# fsdp-async (the async save changes how the files are written, not what the resumed run reads)
@pytest.mark.parametrize("name", ["zero2-offload", "zero3", "fsdp-async", "pp", "pp-head-zb"])
def test_resume_equals_uninterrupted(runs, name):
    resumed, result = runs.resumed(name, name, SOURCES[name])
    # the same strategy at the same world size runs the same arithmetic: equal to rounding (1e-6); the async
    # checkpoint was staged before training moved on, so it resumes like a synchronous one
    reference = runs.full("fsdp" if name == "fsdp-async" else name)
    assert_continues(resumed, reference, rtol=1e-6)
    assert "resume: weights and optimizer state from" in result.stderr and "continuing at step 4 of 6" in result.stderr
    assert "the lr schedule follows this recipe" not in result.stderr  # the same recipe: no change to name
    # DeepSpeed's communication backend is the toolkit's to make: its op's build line came from every rank
    assert "built successfully" not in result.stdout + result.stderr
    run = json.loads((resumed / "run.json").read_text())
    assert run["resumed_from"]["step"] == 3 and run["status"] == "completed"
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    if name.startswith("pp"):  # each stage filled from the checkpoint alone: no rank built the whole model to resume
        assert f"weights: each rank read only its stages' tensors from {resumed / 'checkpoints' / 'step-00000003'}" \
            in run["layout"]


# a model from a config: how a fresh run of each strategy builds it, and which ranks the plan charges the whole
# model for it; resumed, each rank reads only its part of the checkpoint
FROM_CONFIG = {"fsdp": (("strategy.name=fsdp",), "rank 0 built the whole model and broadcast it",
                        "each rank read its shards of", [1, 0]),
               "pp": (("strategy.name=pipeline",), "every rank built the whole model, then kept its stages",
                      "each rank read only its stages' tensors from", [1, 1])}


@pytest.mark.parametrize("name", list(FROM_CONFIG))
def test_a_resumed_run_of_a_model_from_a_config_plans_no_whole_build(tmp_path, name):
    """A model from a config (its seeded init is the whole model's): a fresh fsdp run builds it whole on rank 0 and
    broadcasts it, a fresh pipeline run builds it whole on every rank and keeps its stages: loading peaks the plan
    charges those ranks. Resumed, each rank reads only its part of the checkpoint into the empty model and nothing
    is built whole: the plan the run records (run.json memory_prediction) says so too, where it charged the whole
    model before."""
    overrides, fresh_loading, resumed_loading, whole_on = FROM_CONFIG[name]
    recipe = REPO / "recipes" / "llama-tiny.yaml"
    common = (*overrides, "train.eval_every=null", "data.eval=null", "checkpoint.final=true", "train.log_every=1")
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    launch(recipe, nproc=2, overrides=(*common, "train.max_steps=2", f"output_dir={fresh}"))
    shutil.copytree(fresh, resumed)
    launch(recipe, nproc=2, overrides=(*common, "train.max_steps=3", f"output_dir={resumed}"), extra=("--resume",))
    before, after = (json.loads((run / "run.json").read_text()) for run in (fresh, resumed))
    assert fresh_loading in before["layout"], before["layout"]
    assert f"{resumed_loading} {resumed / 'checkpoints' / 'step-00000002'}" in after["layout"], after["layout"]
    # the whole model in fp32, its tied embedding once: the exported weights' bytes
    whole = sum(w.numel() * 4 for w in exported_weights(fresh).values())
    assert before["memory_prediction"]["built_bytes"] == [whole * k for k in whole_on]
    assert after["memory_prediction"]["built_bytes"] == [0, 0]


@pytest.mark.parametrize("source,source_ranks,target,target_ranks", CROSS,
                         ids=[f"{s}{a}-to-{t}{b}" for s, a, t, b in CROSS])
def test_resume_across_strategies_and_world_sizes(runs, source, source_ranks, target, target_ranks):
    resumed, _ = runs.resumed(source, target, target_ranks)
    # fp32, the same global batch: the strategies compute the same thing up to their reduction order, the
    # tolerance every equivalence test uses (the optimizer state crossed over: step 4 would differ otherwise)
    assert_continues(resumed, runs.full(source), rtol=1e-5)


def test_checkpoint_layout_and_manifest(runs):
    checkpoint = runs.full("fsdp") / "checkpoints" / "step-00000003"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["strategy"] == "fsdp" and manifest["world_size"] == 2
    assert manifest["global_batch_size"] == 8 and manifest["tokens_seen"] == sum(m["tokens"] for m in
                                                                                  metrics(runs.full("fsdp"))[:3])
    assert manifest["extra"]["scheduler"]["last_epoch"] == 3 and manifest["versions"]["torch"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys  # tied: once
    assert {"optim.state.model.embed_tokens.weight.exp_avg", "optim.state.model.embed_tokens.weight.step",
            "rng.0", "rng.1"} <= keys
    assert (checkpoint / "hf" / "config.json").is_file() and (checkpoint / "recipe.yaml").is_file()


@pytest.mark.parametrize("name", ["zero3", "zero2-offload"])
def test_each_zero_rank_writes_its_own_part_of_the_checkpoint(runs, name):
    """No rank gathers the others' partitions to write them (rank 0 did: two fp32 copies of the whole model and
    its Adam moments in its host memory at every save). DCP writes one data file per rank: each holds about its
    1/N of the masters and moments, and DCP's metadata lists the pieces as chunks of the full tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = runs.full(name) / "checkpoints" / "step-00000003"
    sizes = [(checkpoint / f"__{rank}_0.distcp").stat().st_size for rank in range(2)]
    # the tied embedding (30522 × 32, 97 % of the model) is cut mid-tensor by both stages' partitions
    assert max(sizes) < 0.6 * sum(sizes), sizes
    chunks = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    embedding = chunks["optim.state.model.embed_tokens.weight.exp_avg"]
    assert len(embedding.chunks) >= 2 and sum(c.sizes.numel() for c in embedding.chunks) == embedding.size.numel()


def run_with_fault(fault: str, value: str, *args: str):
    """`python -m toolkit ARGS` with one of toolkit/process/faults.py's hooks set."""
    env = toolkit_env()
    env[fault] = value
    return subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_save_killed_before_its_commit_is_never_resumed(runs, tmp_path):
    out = tmp_path / "killed"
    # SIGKILL after step 6's files are written, before the folder is renamed into place
    result = run_with_fault(faults.KILL_BEFORE_COMMIT_STEP, "6", "train", str(runs.recipe), "--set",
                            f"output_dir={out}")
    assert result.returncode == -9, result.stderr[-3000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [".step-00000006.partial", "step-00000003"]  # the partial one is complete on disk but
    assert (out / "checkpoints" / ".step-00000006.partial" / "manifest.json").is_file()  # not committed
    resumed = run_cli("train", str(runs.recipe), "--set", f"output_dir={out}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000003 (step 3" in resumed.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    # single at 1 rank vs ddp at 2: the same maths, a different reduction order
    assert_continues(out, runs.full("ddp"), rtol=1e-5)


@pytest.mark.parametrize("how", ["train", "launch"])
def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(runs, tmp_path, how):
    """A disk that fills up at a save (here the file size limit, `ulimit -f`: Python ignores SIGXFSZ, so DCP's
    write fails with EFBIG where a full disk gives ENOSPC): one line naming the step, its folder and the OS error,
    exit 1 (a failed run, not a recipe mistake), no traceback; run.json's ended says the same; no step folder.
    Through `toolkit launch` (2 ddp ranks) the same one line: the launcher adds no "launch failed" of its own,
    also when rank 0 is slow to say it (a loaded machine; before, rank 1 exited first and the launcher stopped
    rank 0 before its line: only "launch failed: rank 1 exit code 1; rank 0 stopped by the launcher")."""
    out = tmp_path / "full"
    # above every file the run writes before its first save (run.json, metrics, ~10 kB), below the save's shard
    # (~12 MB: the tied Llama's fp32 weights and Adam state)
    limit_bytes = 2 * 2**20

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    command = ["train"] if how == "train" else ["launch", "--nproc", "2"]
    strategy = "single" if how == "train" else "ddp"
    result = subprocess.run([sys.executable, "-m", "toolkit", *command, str(runs.recipe), "--set",
                             "train.max_steps=3", "--set", f"strategy.name={strategy}", "--set", f"output_dir={out}"],
                            cwd=REPO, env={**toolkit_env(), faults.DELAY_FAILURE_LINE: "2"}, capture_output=True,
                            text=True, timeout=600, preexec_fn=limit_file_size)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("toolkit: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    folder = re.escape(str(out / "checkpoints" / "step-00000003"))
    ranks = "rank 0" if how == "train" else "ranks 0, 1"  # each ddp rank writes its part (DCP gathers the errors)
    assert re.fullmatch(rf"toolkit: checkpoint of step 3 NOT written to {folder}: File too large \(EFBIG\) on {ranks}; "
                        r"[\d,.]+ GiB free on its file system; no intact checkpoint was written before it", lines[0])
    ended = json.loads((out / "run.json").read_text())["ended"]
    assert ended["reason"] == lines[0].removeprefix("toolkit: ")
    assert (ended["error"], ended["step"], ended["checkpoint"]) == ("CheckpointWriteError", 3, None)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".step-00000003.partial"]  # never resumed


def test_a_disk_full_before_the_first_step_is_one_line_and_leaves_nothing(runs, tmp_path):
    """No room for output_dir's first files (recipe.yaml, run.json: the file size limit below them, EFBIG where a
    full disk gives ENOSPC): before, rank 0's traceback from recipe.yaml's write_text, a recipe.yaml cut at the
    limit left behind, and the other ranks waiting in their first collective. Now every rank ends on it alike (rank
    0's failure is all-reduced), one line, exit 1, and the folder keeps only what it held before (a job script's
    `mkdir -p` and its own file)."""
    out = tmp_path / "made-by-the-user"
    out.mkdir()
    (out / "notes.txt").write_text("the user's\n")

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))

    result = subprocess.run([sys.executable, "-m", "toolkit", "launch", "--nproc", "2", str(runs.recipe), "--set",
                             "strategy.name=ddp", "--set", f"output_dir={out}"], cwd=REPO, env=toolkit_env(),
                            capture_output=True, text=True, timeout=600, preexec_fn=limit_file_size)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("toolkit: ")]
    assert lines == [f"toolkit: {out} could not be written before the first step (File too large (EFBIG)); no step "
                     "was trained; once the disk has room (or the folder can be written), run the same command "
                     "again"], result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_run_that_fails_on_a_full_disk_says_so_in_its_run_json(runs, tmp_path):
    """A disk that fills up mid-run has no room for run.json's new copy either (written whole: a new file, then a
    rename), so a run whose checkpoint failed there stayed "running" in run.json for good. Here, from step 1 no
    file may grow past run.json's size (the file size limit set by the fault hook: EFBIG where a full disk gives
    ENOSPC; what is on disk stays writable, as a full disk's allocated blocks do), so step 2's checkpoint fails.
    run.json must say the run failed, why, and which checkpoint holds step 1: rewritten over its own bytes."""
    out = tmp_path / "full"
    result = run_cli("train", str(runs.recipe), *(a for item in ("train.max_steps=3", "checkpoint.every_steps=1",
                                                                 f"output_dir={out}") for a in ("--set", item)),
                     env={faults.FULL_DISK_AFTER_STEP: "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("toolkit: ")]
    assert len(lines) == 1 and lines[0].startswith("toolkit: checkpoint of step 2 NOT written"), result.stderr[-3000:]
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "failed", info["status"]
    assert info["ended"]["reason"] == lines[0].removeprefix("toolkit: ")
    assert (info["ended"]["error"], info["ended"]["step"], info["ended"]["steps_done"], info["ended"]["checkpoint"]) \
        == ("CheckpointWriteError", 2, 1, str(out / "checkpoints" / "step-00000001"))
    assert store.is_complete(out / "checkpoints" / "step-00000001")
    assert not list(out.glob(".run.json.*"))  # the new copy that could not be written is gone


@pytest.mark.parametrize("how", ["train", "launch"])
def test_metrics_that_cannot_be_written_stop_the_run_checkpointed_in_one_line(runs, tmp_path, how):
    """metrics.jsonl on a disk that fills up mid-run (its file descriptor made /dev/full at step 2: a real
    ENOSPC from the kernel): before, a 40-line traceback and no checkpoint, every step since the last one lost.
    Every rank stops after that step, its checkpoint written; one line says why and how to resume, exit 1; the
    resume ends as the run never stopped (step 2's record, never written, is the one missing)."""
    out = tmp_path / "full"
    command = ["train"] if how == "train" else ["launch", "--nproc", "2"]
    result = run_cli(*command, str(runs.recipe), "--set", f"strategy.name={'single' if how == 'train' else 'ddp'}",
                     "--set", f"output_dir={out}", env={faults.FULL_METRICS_AT_STEP: "2"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("toolkit: ")]
    checkpoint = out / "checkpoints" / "step-00000002"
    assert len(lines) == 1 and lines[0].startswith(
        f"toolkit: {out / 'metrics.jsonl'} could not be written at step 2 (No space left on device (ENOSPC)); "
        f"the run stopped after step 2; the newest checkpoint is {checkpoint} (step 2); once the disk has room "
        f"(or the file can be written), resume with: toolkit {' '.join(command)} "), result.stderr[-3000:]
    assert lines[0].endswith(" --resume")
    assert store.is_complete(checkpoint)
    info = json.loads((out / "run.json").read_text())
    assert (info["status"], info["ended"]["error"], info["ended"]["step"]) == ("failed", "OutputWriteError", 2)
    if how == "launch":
        return
    reference = tmp_path / "never-stopped"
    launch(runs.recipe, nproc=1, overrides=(f"output_dir={reference}",))
    launch(runs.recipe, nproc=1, overrides=(f"output_dir={out}",), extra=("--resume",))
    assert [m["step"] for m in metrics(out)] == [1, 3, 4, 5, 6]
    want = [m["loss"] for m in metrics(reference) if m["step"] != 2]
    torch.testing.assert_close(torch.tensor(losses(out), dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("how", ["train", "launch"])
def test_a_model_that_cannot_be_exported_ends_the_run_in_one_line(runs, tmp_path, how):
    """The export on a full disk (the file size limit, as above: safetensors' own error, not an OSError):
    before, a traceback and the 89 MB .model.partial left on the full disk. One line naming the folder, the
    error and what holds the weights (here nothing: no checkpoint at all), exit 1, the partial folder gone."""
    out = tmp_path / "full"

    def limit_file_size() -> None:  # above run.json and metrics.jsonl, below the weights' ~4 MB file
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))

    command = ["train"] if how == "train" else ["launch", "--nproc", "2"]
    sets = [a for item in (f"strategy.name={'single' if how == 'train' else 'ddp'}", "train.max_steps=2",
                           "checkpoint.every_steps=null", "checkpoint.every_minutes=null", "checkpoint.final=false",
                           f"output_dir={out}") for a in ("--set", item)]
    result = subprocess.run([sys.executable, "-m", "toolkit", *command, str(runs.recipe), *sets], cwd=REPO,
                            env=toolkit_env(), capture_output=True, text=True, timeout=600,
                            preexec_fn=limit_file_size)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("toolkit: ")]
    assert lines == [f"toolkit: the model could not be written to {out / 'model'} (File too large (EFBIG)); every "
                     "step was trained, and no checkpoint holds its weights (checkpoint.final: true keeps one)"], \
        result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "recipe.yaml", "run.json"]
    assert json.loads((out / "run.json").read_text())["ended"]["error"] == "OutputWriteError"


def test_zero0_in_bf16_checkpoints_its_fp32_masters_and_adam_moments(runs, tmp_path):
    """ZeRO stage 0 in bf16/fp16 steps through DeepSpeed's FP16 optimizer, whose fp32 masters and Adam state are
    kept apart from the 16-bit parameters. Read as torch's own state, its checkpoints held the bf16 weights (as
    fp32) and no moments at all: a resume zeroed them (the next updates ~lr in size, each element's sign) and
    rounded the masters to bf16. Now both are saved, and the resume continues as the run never stopped."""
    overrides = ("strategy.name=zero", "strategy.stage=0", "precision=bf16")
    full = tmp_path / "full"
    launch(runs.recipe, nproc=2, overrides=(*overrides, f"output_dir={full}"))
    saved = full / "checkpoints" / "step-00000003"
    keys = state.saved_keys(saved)
    name = "model.layers.0.mlp.up_proj.weight"
    assert {f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"} <= keys
    shape = verify.read_metadata(saved).state_dict_metadata[f"model.{name}"].size
    master = {"model": {name: torch.zeros(tuple(shape))}}
    dcp.load(master, checkpoint_id=str(saved))
    weight = master["model"][name]
    assert not torch.equal(weight, weight.bfloat16().float())  # fp32 masters, not the bf16 weights widened
    out = tmp_path / "resumed"
    crashed(full, out)
    launch(runs.recipe, nproc=2, overrides=(*overrides, f"output_dir={out}"), extra=("--resume",))
    assert_continues(out, full, rtol=1e-6)


def test_a_resumed_run_draws_the_same_dropout_masks_as_the_uninterrupted_one(runs, tmp_path):
    """Each rank's random generator is in the checkpoint, but the CPU matmul peak measured at start drew its
    matrices from it after the restore: with dropout on (a real model's own; every other test turns it off),
    every resumed step's masks differed. One process, the same arithmetic: equal bit for bit."""
    from toolkit.cli import main

    dropout = ("--set", "model.dropout=0.1")
    full = tmp_path / "full"
    assert main(["train", str(runs.recipe), *dropout, "--set", f"output_dir={full}"]) == 0
    out = tmp_path / "resumed"
    crashed(full, out)
    assert main(["train", str(runs.recipe), *dropout, "--set", f"output_dir={out}", "--resume"]) == 0
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert losses(out) == losses(full)


def test_convert_writes_a_model_transformers_loads_with_the_trained_logits(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    full = runs.full("zero3")
    result = run_cli("convert", str(full / "checkpoints" / "step-00000006"), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr[-3000:]
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(full / "model"))  # what the run itself exported
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()  # tied again
    ids = torch.randint(0, converted.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, exported(ids).logits, rtol=0, atol=0)
    assert (tmp_path / "hf" / "tokenizer.json").is_file() or (tmp_path / "hf" / "vocab.txt").is_file()


@pytest.mark.parametrize("given", ["run", "checkpoints"])
def test_convert_given_a_run_takes_its_newest_complete_checkpoint_and_says_which(runs, tmp_path, given):
    """`toolkit convert RUN` or `RUN/checkpoints` answered 'not a toolkit checkpoint: no manifest.json'."""
    full = runs.full("ddp")
    result = run_cli("convert", str(full if given == "run" else full / "checkpoints"), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"[toolkit] convert: {full / 'checkpoints' / 'step-00000006'}, the newest complete checkpoint" in \
        result.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


def test_an_output_dir_holding_a_run_is_refused_without_resume(runs, capfd, forked_children):
    from toolkit.cli import main

    full = runs.full("ddp")
    before = (full / "run.json").stat().st_mtime_ns
    code = main(["launch", "--nproc", "2", str(runs.recipe), "--set", "strategy.name=ddp", "--set",
                 f"output_dir={full}"])  # refused by the ranks before they write: what the terminal shows (capfd)
    assert code == 2
    # a completed run: --resume at the same max_steps has nothing left to do, so it is not offered alone
    assert capfd.readouterr().err.strip().splitlines() == [
        f"toolkit: error: output_dir {full} holds a completed run (6 steps); write this one elsewhere with --set "
        "output_dir=OTHER, or train that one further with a larger train.max_steps and --resume"]
    assert (full / "run.json").stat().st_mtime_ns == before


def test_an_output_dir_holding_a_stopped_run_offers_resume(runs, tmp_path):
    from toolkit.checkpoint.store import check_output_dir

    stopped = tmp_path / "stopped"
    shutil.copytree(runs.full("ddp"), stopped)
    info = json.loads((stopped / "run.json").read_text())
    (stopped / "run.json").write_text(json.dumps({**info, "status": "stopped"}))
    with pytest.raises(RecipeError) as refused:
        check_output_dir(stopped, resume=False)
    assert str(refused.value) == (f"output_dir {stopped} already holds a run; continue it with --resume, or write "
                                  "this one elsewhere with --set output_dir=OTHER")


@pytest.mark.parametrize("damage", ["no checkpoint", "garbage metadata", "foreign folder", "other model"])
def test_a_missing_corrupted_or_foreign_checkpoint_is_one_line(runs, tmp_path, tiny_bert_dir, damage, capfd,
                                                              forked_children):
    from toolkit.cli import main

    given = tmp_path / "given"
    shutil.copytree(runs.full("ddp") / "checkpoints" / "step-00000003", given)
    args = ["--resume", str(given)]
    expected = {"garbage metadata": "its DCP metadata is unreadable",
                "foreign folder": "is not a toolkit checkpoint",
                "other model": "it was written for another model",
                "no checkpoint": "no complete checkpoint in"}[damage]
    recipe = runs.recipe
    if damage == "garbage metadata":
        (given / ".metadata").write_bytes(b"not a pickle")
    elif damage == "foreign folder":
        (given / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    elif damage == "other model":
        recipe = write_recipe(tmp_path / "bert.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                              output_dir=tmp_path / "unused", batch={"global_batch_size": 8, "micro_batch_size": 8,
                                                                     "grad_accum_steps": None})
    else:
        args = ["--resume"]
    out = tmp_path / "out"
    code = main(["launch", "--nproc", "2", str(recipe), "--set", "strategy.name=ddp", "--set", f"output_dir={out}",
                 *args]) if damage != "other model" else main(["train", str(recipe), "--set", f"output_dir={out}", *args])
    err = capfd.readouterr().err  # a launch's ranks say the line: the file descriptors, as a terminal shows them
    assert code == 2, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("toolkit:")]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err[-3000:]
    assert not out.exists()  # nothing half-written


def test_a_rank_killed_mid_run_is_restarted_and_the_run_finishes_as_if_never_killed(runs, tmp_path):
    out = tmp_path / "restarted"
    # rank 1 is SIGKILLed after step 4; torch's agent restarts both ranks, which resume from step 3
    result = run_with_fault(faults.KILL_RANK_AT_STEP, "1:4", "launch", "--nproc", "2", "--max-restarts", "1",
                            str(runs.recipe), "--set", "strategy.name=ddp", "--set", f"output_dir={out}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resume: weights and optimizer state from" in result.stderr and "step-00000003" in result.stderr
    # the restart is said as it happens (which rank, how), and kept in run.json
    assert "toolkit: rank 1 killed by SIGKILL; restarting every rank (restart 1 of 1): they resume from the run's " \
        "newest checkpoint" in result.stderr, result.stderr[-4000:]
    assert json.loads((out / "run.json").read_text())["restarts"] == 1
    assert_continues(out, runs.full("ddp"), rtol=1e-6)


def test_a_restart_of_a_resumed_run_continues_its_own_newest_checkpoint_not_the_one_it_was_given(runs, tmp_path):
    """torch's agent restarts the ranks with the command line they began with, `--resume PATH` included: a restart
    resumed PATH again (here another run's, into an output_dir that now holds this one: refused; into its own,
    every step since trained again). It continues the newest checkpoint this launch wrote, with its optimizer
    state (not fresh, as --resume-weights-only asked for PATH only): the same losses and weights as the run
    never killed."""
    source = tmp_path / "source"
    crashed(runs.full("ddp"), source)
    given = source / "checkpoints" / "step-00000003"
    flags = ("--set", "checkpoint.every_steps=1", "--resume", str(given), "--resume-weights-only")
    reference = tmp_path / "never-killed"
    launch(runs.recipe, nproc=1, overrides=("checkpoint.every_steps=1", f"output_dir={reference}"),
           extra=flags[2:])
    out = tmp_path / "restarted"
    # SIGKILL after step 5 and its checkpoint; the restart resumes step-00000005, weights and Adam state
    result = run_with_fault(faults.KILL_RANK_AT_STEP, "0:5", "launch", "--nproc", "1", "--max-restarts", "1",
                            str(runs.recipe), "--set", f"output_dir={out}", *flags)
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = [line for line in result.stderr.splitlines() if line.startswith("[toolkit] resume: weights")]
    assert resumed[0].startswith(f"[toolkit] resume: weights (fresh optimizer state) from {given} (step 3"), resumed
    assert resumed[1].startswith("[toolkit] resume: weights and optimizer state from "
                                 f"{out / 'checkpoints' / 'step-00000005'} (step 5"), resumed
    assert [m["step"] for m in metrics(out)] == [4, 5, 6] == [m["step"] for m in metrics(reference)]
    torch.testing.assert_close(torch.tensor(losses(out), dtype=torch.float64),
                               torch.tensor(losses(reference), dtype=torch.float64), rtol=1e-6, atol=0.0)
    got, want = exported_weights(out), exported_weights(reference)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_every_minutes_checkpoints_on_every_rank_alike(runs, tmp_path):
    """checkpoint.every_minutes (30 by default): a checkpoint once that much training passed since the last one,
    the ranks agreeing after each step (their clocks differ; one rank's yes is every rank's). At a millionth of a
    minute every step is due, but the last, which is checkpoint.final's; both ranks write each one (a DCP save
    is collective: a rank that disagreed would hang or leave it uncommitted)."""
    out = tmp_path / "clock"
    launch(runs.recipe, nproc=2, overrides=("strategy.name=ddp", "batch.micro_batch_size=4", "train.max_steps=4",
                                            "checkpoint.every_steps=null", "checkpoint.every_minutes=0.000001",
                                            "checkpoint.keep_last=10", "checkpoint.final=false", f"output_dir={out}"))
    written = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert written == ["step-00000001", "step-00000002", "step-00000003"], written
    for step in written:
        assert json.loads((out / "checkpoints" / step / "manifest.json").read_text())["step"] == int(step[5:])
    clock = json.loads((out / "run.json").read_text())["clock_checkpoints"]  # what they held training up
    assert clock["count"] == 3 and clock["held_s"] > 0


def test_a_restart_without_a_checkpoint_says_it_trains_again_from_step_one(tiny_llama_dir, tmp_path):
    """--max-restarts resumes from the run's newest checkpoint; with checkpoint.every_steps and every_minutes unset
    there is none before the end, and a restart trains every step again: the launch says so before the ranks
    start, and the restart where it happens (it retrained in silence)."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, data={"eval": None},
                          train={"max_steps": 3}, checkpoint={"every_minutes": None})
    result = run_with_fault(faults.KILL_RANK_AT_STEP, "0:2", "launch", "--nproc", "1", "--max-restarts", "1",
                            str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if "warning" in line] == [
        "[toolkit] warning: --max-restarts 1 restarts the ranks from the run's newest checkpoint, and neither "
        "checkpoint.every_steps nor every_minutes is set (only a final checkpoint): a restart trains again from "
        "step 1; set one of them to lose at most that many steps or minutes",
        f"[toolkit] warning: restarted with no complete checkpoint in {out / 'checkpoints'}: training again from "
        "step 1"]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


def test_sigterm_to_the_launcher_checkpoints_stops_cleanly_and_resume_finishes(runs, tmp_path):
    out = tmp_path / "preempted"
    # rank 0 sends its launcher SIGTERM after step 2, as a scheduler preempting the job would; the ranks
    # stop together after the step they are in, write a checkpoint there and say how to resume
    result = run_with_fault(faults.SIGTERM_LAUNCHER_AT_STEP, "2", "launch", "--nproc", "2", str(runs.recipe),
                            "--set", "strategy.name=ddp", "--set", f"output_dir={out}")
    assert result.returncode == 128 + 15, result.stderr[-4000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("toolkit:")]
    assert len(lines) == 1 and lines[0].startswith("toolkit: stopped by SIGTERM at step "), result.stderr[-3000:]
    assert lines[0].endswith(f"--set output_dir={out} --resume") and "toolkit launch --nproc 2" in lines[0]
    stopped_at = int(lines[0].split(" at step ")[1].split()[0])
    assert 2 <= stopped_at < 6 and (out / "checkpoints" / f"step-{stopped_at:08d}").is_dir()
    assert "Traceback" not in result.stderr
    ended = json.loads((out / "run.json").read_text())  # before: "status": "running"
    assert ended["status"] == "stopped" and ended["ended"]["reason"] == f"stopped by SIGTERM at step {stopped_at} of 6"
    assert ended["ended"]["checkpoint"] == str(out / "checkpoints" / f"step-{stopped_at:08d}")
    assert ended["ended"]["signal"] == "SIGTERM" and ended["ended"]["resumable"] and \
        ended["ended"]["steps_done"] == stopped_at
    launch(runs.recipe, nproc=2, overrides=("strategy.name=ddp", f"output_dir={out}"), extra=("--resume",))
    assert_continues(out, runs.full("ddp"), rtol=1e-6)


def test_a_non_finite_step_stops_the_run_and_is_never_checkpointed(runs, tmp_path):
    # lr 1e6 (reached over the 2 warm-up steps): the first update sends the weights to ±1e5 or more and a
    # later step's gradients (or loss) are not finite
    out = tmp_path / "nan"
    result = run_cli("train", str(runs.recipe), "--set", "optim.lr=1e6", "--set", "checkpoint.every_steps=1",
                     "--set", f"output_dir={out}")
    assert result.returncode == 4, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("toolkit:")]
    assert len(lines) == 1 and lines[0].startswith("toolkit: non-finite ") and "Traceback" not in result.stderr, \
        result.stderr
    bad = int(lines[0].split(" at step ")[1].split(";")[0])
    assert bad >= 2 and f"step-{bad - 1:08d} (--resume)" in lines[0]
    assert [m["step"] for m in metrics(out)] == list(range(1, bad))  # the bad step is not logged as done
    run = strict_loads((out / "run.json").read_text())  # before: "status": "running"
    assert run["status"] == "stopped" and run["ended"]["step"] == bad and run["ended"]["steps_done"] == bad - 1
    assert run["ended"]["checkpoint"] == str(out / "checkpoints" / f"step-{bad - 1:08d}")
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names[-1] == f"step-{bad - 1:08d}"  # written up to the step before, never the bad one
    converted = run_cli("convert", str(out / "checkpoints" / names[-1]), str(tmp_path / "last"))
    assert converted.returncode == 0, converted.stderr[-3000:]
    from safetensors.torch import load_file

    assert all(torch.isfinite(w).all() for w in load_file(str(tmp_path / "last" / "model.safetensors")).values())


def test_on_nonfinite_skip_drops_those_steps_and_keeps_the_weights_finite(runs, tmp_path):
    out = tmp_path / "skip"
    result = run_cli("train", str(runs.recipe), "--set", "optim.lr=1e6", "--set", "train.on_nonfinite=skip",
                     "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=6", "--set",
                     f"output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(out)  # strict JSON: before, `"grad_norm": NaN`
    first_bad = next(m["step"] for m in steps if m["skipped"])
    assert all(m["skipped"] for m in steps[first_bad - 1:]) and not any(m["skipped"] for m in steps[:first_bad - 1])
    assert all(m["skipped_nonfinite"] and m["nonfinite"] for m in steps[first_bad - 1:])  # what each null was
    # fewer in a row than train.max_consecutive_skips (10): the run completes, and says how many it skipped
    skipped = 6 - first_bad + 1
    assert f"[toolkit] done: {skipped} of 6 steps skipped (non-finite loss or gradient norm)" in result.stderr
    # what the run left on disk, summed here from the files: the export and its 6 checkpoints
    done = next(line for line in result.stderr.splitlines() if line.startswith("[toolkit] done:"))
    for folder in ("model", "checkpoints"):
        size = sum(f.stat().st_size for f in (out / folder).rglob("*") if f.is_file())
        shown = f"{size / 1e6:,.0f} MB" if size >= 1e6 else f"{size / 1e3:,.0f} kB"
        assert f"{out / folder} ({shown})" in done, done
    run = strict_loads((out / "run.json").read_text())
    assert run["status"] == "completed" and run["final_loss"] == steps[-1]["loss"]
    assert run["skipped_steps"] == {"nonfinite": skipped, "fp16_overflow": 0, "steps_run": 6}
    final = exported_weights(out)
    assert all(torch.isfinite(w).all() for w in final.values())
    # no update after the last good step (no weight decay either): the final weights are that step's
    converted = run_cli("convert", str(out / "checkpoints" / f"step-{first_bad - 1:08d}"), str(tmp_path / "step1"))
    assert converted.returncode == 0, converted.stderr[-3000:]
    from safetensors.torch import load_file

    step1 = load_file(str(tmp_path / "step1" / "model.safetensors"))
    assert step1.keys() == final.keys() and all(torch.equal(step1[k], final[k]) for k in final)


def test_a_quick_run_keeps_no_final_checkpoint_and_a_continued_one_does(tmp_path, tiny_llama_dir):
    """checkpoint.final null (the default): a run that trained under 10 minutes writes no final checkpoint (its
    export is its result; its checkpoint would be 3× the fp32 model) and says so in its done line; its 2 ranks agree
    (one collective flag); a run that continued a checkpoint keeps one, as does checkpoint.final true."""
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, data={"eval": None},
                          checkpoint={"final": None}, batch={"micro_batch_size": 4, "grad_accum_steps": 1})
    quick = launch(recipe, nproc=2, overrides=("strategy.name=ddp", "train.max_steps=2"))
    assert not (out / "checkpoints").exists() and (out / "model" / "model.safetensors").is_file()
    assert "no final checkpoint: a run of " in quick.stderr and "checkpoint.final: true keeps one" in quick.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "completed"
    # every 2 steps to step 2, then continued to step 3, which only the final checkpoint of a continued run writes
    steps = tmp_path / "steps"
    launch(recipe, nproc=1, overrides=(f"output_dir={steps}", "train.max_steps=2", "checkpoint.every_steps=2"))
    launch(recipe, nproc=1, overrides=(f"output_dir={steps}", "train.max_steps=3", "checkpoint.every_steps=2"),
           extra=("--resume",))
    assert sorted(p.name for p in (steps / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    kept = tmp_path / "kept"
    launch(recipe, nproc=1, overrides=(f"output_dir={kept}", "train.max_steps=1", "checkpoint.final=true"))
    assert [p.name for p in (kept / "checkpoints").iterdir()] == ["step-00000001"]
