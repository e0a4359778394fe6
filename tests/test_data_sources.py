"""The data people have: saved datasets, folders of shards, compressed files, labels that are names, chat and
prompt-response instruction data (the loss on the response tokens only), and eval metrics beyond the loss."""

import gzip
import json
import math

import pytest
import torch

from conftest import EVAL, MINILM, TRAIN, exported_weights, launch, metrics, write_recipe
from toolkit.cli import main
from toolkit.config.files import load_recipe
from toolkit.data.losses import IGNORE_INDEX
from toolkit.data.splits import Collator, _packer, load_split
from toolkit.process.dist import DistEnv

ROWS_ALL = [json.loads(line) for line in open(TRAIN)]
ROWS = ROWS_ALL[:64]
ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _tokenizer():
    from transformers import AutoTokenizer

    from toolkit.model.build import resolve_path

    return AutoTokenizer.from_pretrained(str(resolve_path(MINILM)))


def _split(recipe_path, key="data.train", names=None):
    """The tokenized split and its class names (every sample here has tokens to learn from: none left out)."""
    recipe = load_recipe(recipe_path)
    dataset, names, counts = load_split(key, data=recipe.data, task=recipe.model.task,
                                        num_labels=recipe.model.num_labels, tokenizer=_tokenizer(),
                                        env=ONE_RANK, names=names)
    assert counts.num_left_out == 0
    return dataset, names


def _sources(tmp_path):
    """The same 64 rows as a saved Dataset, a saved DatasetDict, parquet and jsonl shard folders, and .jsonl.gz."""
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "validation": table.select(range(8))}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "parquet").mkdir()
    (tmp_path / "jsonl").mkdir()
    for shard in range(2):
        part = table.select(range(shard * 32, (shard + 1) * 32))
        part.to_parquet(str(tmp_path / "parquet" / f"part-{shard:05d}.parquet"))
        part.to_json(str(tmp_path / "jsonl" / f"part-{shard:05d}.jsonl"))
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in ROWS)
    return {"saved": tmp_path / "saved", "dict": tmp_path / "dict", "parquet": tmp_path / "parquet",
            "jsonl-shards": tmp_path / "jsonl", "jsonl.gz": tmp_path / "train.jsonl.gz"}


def test_saved_datasets_shard_folders_and_compressed_files_load_the_same_rows(tmp_path, tiny_llama_dir):
    tokenizer = _tokenizer()
    # the reference: the tokenizer on the rows as written, in order
    want = [tokenizer(row["text"], truncation=True, max_length=32)["input_ids"] for row in ROWS]
    for name, path in _sources(tmp_path).items():
        recipe = write_recipe(tmp_path / f"{name}.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                              data={"train": str(path), "eval": str(path) if name == "dict" else None})
        dataset, names = _split(recipe)
        assert dataset["input_ids"] == want and names is None, name
        assert main(["validate", str(recipe)]) == 0, name
    evaluation, _ = _split(tmp_path / "dict.yaml", key="data.eval")  # a DatasetDict's validation split
    assert evaluation["input_ids"] == want[:8]


def test_a_folder_whose_file_names_name_splits_gives_each_key_its_own_split(tmp_path, tiny_llama_dir, capsys):
    """train-*.jsonl and validation.jsonl in one folder: data.train reads the train files only and data.eval the
    validation file, as load_dataset(folder) splits them; read as one split, the eval rows would be trained on."""
    tokenizer = _tokenizer()
    folder = tmp_path / "splits"
    folder.mkdir()
    for name, rows in (("train-00000.jsonl", ROWS[:24]), ("train-00001.jsonl", ROWS[24:48]),
                       ("validation.jsonl", ROWS[48:])):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(folder), "eval": str(folder)})
    want = [tokenizer(row["text"], truncation=True, max_length=32)["input_ids"] for row in ROWS]
    assert _split(recipe)[0]["input_ids"] == want[:48]
    assert _split(recipe, key="data.eval")[0]["input_ids"] == want[48:]

    (folder / "extra.jsonl").write_text(json.dumps(ROWS[0]) + "\n")  # a file whose name gives no split
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "extra.jsonl, whose name gives no split" in err[0], err
    for name in ("extra.jsonl", "train-00000.jsonl", "train-00001.jsonl"):
        (folder / name).rename(tmp_path / name)
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "test.jsonl").rename(folder / "test.jsonl")  # validation and test, no train
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none named train" in err[0], err


@pytest.mark.parametrize("files, words", [
    # before: read whole, as a folder of shards: the validation rows were trained on
    (("part-00000.jsonl", "part-00001.jsonl", "validation.jsonl"), "holds files of split validation, none named train"),
    (("validation.jsonl",), "holds files of split validation, none named train"),
    (("train-00000.jsonl", "notes.jsonl"), "holds files of split train and notes.jsonl, whose name gives no split"),
])
def test_a_folder_naming_one_split_gives_data_train_only_its_train_files(files, words, tmp_path, tiny_llama_dir,
                                                                         capsys):
    folder = tmp_path / "splits"
    folder.mkdir()
    for i, name in enumerate(files):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in ROWS[16 * i:16 * (i + 1)]))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(folder), "eval": None})
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_folder_of_one_named_split_alone_is_that_split(tmp_path, tiny_llama_dir):
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train-00000.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS[:16]))
    (folder / "train-00001.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS[16:32]))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(folder), "eval": str(folder / "train-00001.jsonl")})
    tokenizer = _tokenizer()
    want = [tokenizer(row["text"], truncation=True, max_length=32)["input_ids"] for row in ROWS[:32]]
    assert _split(recipe)[0]["input_ids"] == want
    assert _split(recipe, key="data.eval")[0]["input_ids"] == want[16:]  # a file: read whatever its name


@pytest.mark.parametrize("make, words", [
    (lambda d: (d / "empty").mkdir(), "is a folder without data files"),
    (lambda d: ((d / "mixed").mkdir(), (d / "mixed" / "a.csv").write_text("text\nx\n"),
                (d / "mixed" / "b.jsonl").write_text('{"text": "y"}\n')), "mixes csv and json files"),
    (lambda d: (d / "bad.jsonl.gz").write_bytes(b"\x1f\x8b not gzip at all"), "cannot be read as json"),
])
def test_a_folder_or_file_that_holds_no_readable_rows_is_one_line(tmp_path, tiny_llama_dir, capsys, make, words):
    make(tmp_path)
    target = next(p for p in tmp_path.iterdir() if p.name in ("empty", "mixed", "bad.jsonl.gz"))
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          data={"train": str(target), "eval": None})
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def _named_labels(tmp_path, eval_rows):
    train, evaluation = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    names = {0: "neg", 1: "pos"}
    train.write_text("".join(json.dumps({"text": r["text"], "label": names[r["label"]]}) + "\n" for r in ROWS))
    evaluation.write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    return train, evaluation


def _wait_for_slow_tokenizing(rank: int, recipe_path: str, init: str, lengths) -> None:
    """One of two gloo ranks whose process group times out after 2 s; rank 0's tokenizing takes 4 s."""
    import datetime
    import time

    import torch.distributed as dist

    from toolkit.data import splits
    from toolkit.process.dist import shutdown

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        tokenized = splits._tokenized

        def slow(*args, **kwargs):
            time.sleep(4)
            return tokenized(*args, **kwargs)
        splits._tokenized = slow
    recipe = load_recipe(recipe_path)
    dataset, _, _ = load_split("data.train", data=recipe.data, task=recipe.model.task, num_labels=2,
                               tokenizer=_tokenizer(), env=DistEnv(rank=rank, local_rank=rank, world_size=2,
                                                                   device=torch.device("cpu")))
    lengths[rank] = len(dataset)
    shutdown(completed=True)


def test_the_other_ranks_wait_for_rank_0_tokenizing_past_the_groups_timeout(tmp_path, tiny_bert_dir):
    """Rank 0 tokenizes alone while the others wait on its word: they waited in a collective of the process
    group, whose 30-minute timeout ended every run whose corpus took longer to tokenize, the tokenizing with it
    (never cached: no later run got further). They wait on a group of their own now (hours); here the group's
    timeout is 2 s and the tokenizing takes 4 s."""
    import torch.multiprocessing as mp

    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "run", data={"eval": None})
    lengths = mp.get_context("spawn").Manager().dict()
    mp.spawn(_wait_for_slow_tokenizing, args=(str(recipe), f"file://{tmp_path / 'store'}", lengths), nprocs=2)
    assert dict(lengths) == {0: len(ROWS_ALL), 1: len(ROWS_ALL)}


def _two_nodes_without_a_shared_cache(rank: int, recipe_path: str, init: str, caches: str, rows) -> None:
    """One of 3 gloo ranks: rank 0 on node 0, ranks 1 and 2 on node 1 (local ranks 0 and 1), each node with a cache
    folder of its own; the process group times out after 2 s and node 1's tokenizing takes 4 s; `rows[rank]`: the
    rows this rank tokenized itself."""
    import datetime
    import os
    import time

    os.environ["HF_DATASETS_CACHE"] = f"{caches}/node{min(rank, 1)}"
    import torch.distributed as dist

    from toolkit.data import splits
    from toolkit.process.dist import shutdown

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=2))
    rows[rank] = 0
    advance = splits.Progress.advance

    def counted(self, n):
        if rank and not rows[rank]:  # node 1 tokenizes slowly
            time.sleep(4)
        rows[rank] += n
        return advance(self, n)
    splits.Progress.advance = counted
    recipe = load_recipe(recipe_path)
    load_split("data.train", data=recipe.data, task=recipe.model.task, num_labels=2, tokenizer=_tokenizer(),
               env=DistEnv(rank=rank, local_rank=[0, 0, 1][rank], world_size=3, device=torch.device("cpu")))
    dist.barrier()  # the run's first collective, on the process group: every rank is there within its 2 s
    shutdown(completed=True)


def test_a_node_without_rank_0_s_filesystem_tokenizes_once_and_the_others_wait_for_it(tmp_path, tiny_bert_dir):
    """Nodes that do not share rank 0's filesystem do not find its cache. Every rank there tokenized the split
    itself, at once, and rank 0, done before them, went on to the run's first collective, whose group timeout (30
    min) a long tokenizing outlasted. Now a node's first rank tokenizes for its node, the node's other ranks read its
    cache, and every rank waits for it on the long-timeout group (here the process group's timeout is 2 s and node
    1's tokenizing 4 s)."""
    import torch.multiprocessing as mp

    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "run", data={"eval": None})
    rows = mp.get_context("spawn").Manager().dict()
    mp.spawn(_two_nodes_without_a_shared_cache, args=(str(recipe), f"file://{tmp_path / 'store'}",
                                                     str(tmp_path / "caches"), rows), nprocs=3)
    assert dict(rows) == {0: len(ROWS_ALL), 1: len(ROWS_ALL), 2: 0}


def _a_node_without_the_data_file(rank: int, recipe_path: str, init: str, caches: str, errors) -> None:
    """One of 3 gloo ranks as in _two_nodes_without_a_shared_cache; node 1 (ranks 1 and 2) lacks data.train's file;
    `errors[rank]`: (the line this rank stopped with, seconds after it entered load_split)."""
    import dataclasses
    import datetime
    import os
    import time

    os.environ["HF_DATASETS_CACHE"] = f"{caches}/node{min(rank, 1)}"
    import torch.distributed as dist

    from toolkit.errors import RecipeError
    from toolkit.process import dist as toolkit_dist
    from toolkit.process.dist import shutdown

    toolkit_dist.RANK_0_WORK_TIMEOUT = datetime.timedelta(seconds=30)  # a rank left waiting fails, not hangs 24 h
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=2))
    recipe = load_recipe(recipe_path)
    data = dataclasses.replace(recipe.data, train=f"{caches}/not-on-node-1.jsonl") if rank else recipe.data
    start = time.perf_counter()
    try:
        load_split("data.train", data=data, task=recipe.model.task, num_labels=2, tokenizer=_tokenizer(),
                   env=DistEnv(rank=rank, local_rank=[0, 0, 1][rank], world_size=3, device=torch.device("cpu")))
        errors[rank] = (None, time.perf_counter() - start)
    except (RecipeError, RuntimeError) as exc:  # RuntimeError: gloo's wait timing out
        errors[rank] = (str(exc), time.perf_counter() - start)
    shutdown(completed=False)


def test_a_node_without_the_data_file_stops_every_rank_with_its_line(tmp_path, tiny_bert_dir):
    """The file was looked for on every rank before the stages that pass a node's error on: the node without it
    stopped at once, and rank 0, done tokenizing, waited for it on the long-timeout group (24 h) with no word of
    why. Now the node's first rank says it, and every rank stops with that line."""
    import torch.multiprocessing as mp

    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "run", data={"eval": None})
    errors = mp.get_context("spawn").Manager().dict()
    mp.spawn(_a_node_without_the_data_file, args=(str(recipe), f"file://{tmp_path / 'store'}",
                                                  str(tmp_path / "caches"), errors), nprocs=3)
    missing = f"{tmp_path / 'caches'}/not-on-node-1.jsonl"
    for rank in range(3):
        line, seconds = errors[rank]
        assert line is not None and line.startswith("rank 1: data.train: ") and missing in line, (rank, line)
        assert seconds < 60, (rank, seconds)


def test_tokenizing_says_how_far_it_is_and_a_cached_split_says_nothing(tmp_path, tiny_bert_dir, capsys,
                                                                       monkeypatch):
    """Rank 0 tokenized a large split before the run's first line without a word (300,000 reviews: 30 s here).
    A split that takes longer than FIRST_S says how far it is, every EVERY_S, then how long it took; here both are
    0 s, so every batch of the map says it: the counts rise to the split's rows. The cached split says nothing."""
    from toolkit.data import progress

    monkeypatch.setattr(progress, "FIRST_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    train = tmp_path / "train.jsonl"
    rows = ROWS * 40  # 2,560 rows: three batches of datasets' map (1,000 rows each)
    train.write_text("".join(json.dumps({"text": f"{r['text']} {i}", "label": r["label"]}) + "\n"
                             for i, r in enumerate(rows)))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "run", data={"train": str(train), "eval": None})
    capsys.readouterr()
    _split(recipe)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" of ")[0] for line in lines[:-1]] == [
        f"[toolkit] data.train: tokenizing {n:,}" for n in (1000, 2000, 2560)], lines
    assert lines[-1].startswith("[toolkit] data.train: tokenizing done: 2,560 rows in "), lines
    _split(recipe)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_label_names_in_a_csv_or_parquet_file_map_to_integer_ids(suffix, tmp_path, tiny_bert_dir):
    """A CSV's or parquet file's text column is read as large_string, and the tokenizing map kept its label column's
    type for the ids it mapped the names to: '0', '1' as text, and the first micro-batch stopped every rank with
    "too many dimensions 'str'". The ids are ints, the collated labels those of the names' sorted order."""
    import pandas

    path = tmp_path / f"train.{suffix}"
    frame = pandas.DataFrame({"text": [r["text"] for r in ROWS], "label": [["neg", "pos"][r["label"]] for r in ROWS]})
    frame.to_csv(path, index=False) if suffix == "csv" else frame.to_parquet(path)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "run", data={"train": str(path), "eval": None, "max_length": 16})
    dataset, names = _split(recipe)
    assert names == ["neg", "pos"] and dataset["label"] == [r["label"] for r in ROWS]
    batch = Collator(pad_token_id=0, task="sequence-classification")([dataset[i] for i in range(4)])
    assert batch["labels"].tolist() == [r["label"] for r in ROWS[:4]]


def test_label_names_map_to_sorted_ids_and_into_the_exported_config(tmp_path, tiny_bert_dir):
    eval_rows = [{"text": json.loads(line)["text"], "label": ["neg", "pos"][json.loads(line)["label"]]}
                 for line in open(EVAL)][:40]
    train, evaluation = _named_labels(tmp_path, eval_rows)
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=out, data={"train": str(train), "eval": str(evaluation), "max_length": 16},
                          batch={"micro_batch_size": 10},  # 64 rows: 6 steps an epoch, 4 rows unread
                          train={"max_steps": 3, "eval_every": None})  # 16: some rows are cut (see run.json below)
    dataset, names = _split(recipe)
    assert names == ["neg", "pos"]
    assert dataset["label"] == [r["label"] for r in ROWS]  # neg -> 0, pos -> 1: the ids the names came from
    result = launch(recipe, nproc=1)
    assert "[toolkit] labels: neg → 0, pos → 1" in result.stderr
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"] == {"neg": 0, "pos": 1}
    info = json.loads((out / "run.json").read_text())
    assert info["labels"] == ["neg", "pos"]
    # what of each split the run read, counted here with the tokenizer alone: 64 rows, 10 a step, 3 steps
    lengths = {key: [len(ids) for ids in _tokenizer()([r["text"] for r in rows])["input_ids"]]
               for key, rows in (("train", ROWS), ("eval", eval_rows))}
    for key, record in info["data"].items():
        n = lengths[key]
        assert (record["samples"], record["tokens"]) == (len(n), sum(n)), key
        assert (record["samples_cut"], record["tokens_cut"]) == (sum(k > 16 for k in n), sum(max(k - 16, 0) for k in n))
    assert info["data"]["train"]["samples_cut"] > 0  # the check above could fail
    # epochs as train.epochs counts them: steps over steps an epoch (3 of 6), not the 30 rows read over 64 (0.47)
    assert {k: info["data"]["train"][k] for k in ("steps_per_epoch", "epochs", "samples_unread_per_epoch")} == {
        "steps_per_epoch": 6, "epochs": 0.5, "samples_unread_per_epoch": 4}

    # eval accuracy is what the exported model gets on the eval rows, computed here with plain transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    hits = 0
    with torch.no_grad():
        for row in eval_rows:
            logits = model(**tokenizer(row["text"], truncation=True, max_length=16, return_tensors="pt")).logits
            hits += config["id2label"][str(int(logits.argmax()))] == row["label"]
    final = metrics(out)[-1]
    assert final["eval_accuracy"] == pytest.approx(hits / len(eval_rows), abs=1e-12)


def _relabelled_bert(tiny_bert_dir, folder, id2label: dict[int, str]):
    """tiny_bert_dir's model and tokenizer, its config.json naming its head's ids as `id2label` does."""
    import shutil

    shutil.copytree(tiny_bert_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {str(k): v for k, v in id2label.items()}
    config["label2id"] = {v: k for k, v in id2label.items()}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_pretrained_heads_own_label_ids_are_kept_for_training_and_export(tmp_path, tiny_bert_dir, capsys):
    """model.path's id2label {0: pos, 1: neg} names data.train's labels: its ids train and export, not sorted ones
    (neg -> 0 would train the head's `pos` row as neg)."""
    from toolkit.model.build import saved_label_names

    model = _relabelled_bert(tiny_bert_dir, tmp_path / "pos-neg", {0: "pos", 1: "neg"})
    train, evaluation = _named_labels(tmp_path, [{"text": r["text"], "label": ["neg", "pos"][r["label"]]}
                                                 for r in ROWS[:16]])
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=model, task="sequence-classification", output_dir=out,
                          data={"train": str(train), "eval": str(evaluation)}, train={"max_steps": 2})
    config = load_recipe(recipe)
    dataset, names, _ = load_split("data.train", data=config.data, task=config.model.task, num_labels=2,
                                   tokenizer=_tokenizer(), env=ONE_RANK, model_names=saved_label_names(config.model))
    written = [json.loads(line)["label"] for line in open(train)]
    assert names == ["pos", "neg"] and dataset["label"] == [{"pos": 0, "neg": 1}[label] for label in written]
    assert main(["train", str(recipe)]) == 0
    assert "[toolkit] labels: pos → 0, neg → 1 (id2label in the exported config)" in capsys.readouterr().err
    exported = json.loads((out / "model" / "config.json").read_text())
    assert exported["id2label"] == {"0": "pos", "1": "neg"} and exported["label2id"] == {"pos": 0, "neg": 1}


def test_a_pretrained_head_naming_other_labels_is_replaced_in_one_line():
    from toolkit.data.labels import in_model_order, label_note

    assert in_model_order(["neg", "pos"], ["good", "bad"]) == ["neg", "pos"]  # data.train's, sorted
    assert label_note(["neg", "pos"], ["good", "bad"]) == (
        "[toolkit] model.path's id2label (good, bad) names other labels than data.train (neg, pos): its mapping is "
        "replaced by data.train's")
    assert label_note(["pos", "neg"], ["pos", "neg"]) is None and label_note(["neg", "pos"], None) is None


@pytest.mark.parametrize("case", ["a label data.train lacks", "no label column"])
def test_an_eval_split_whose_labels_do_not_fit_is_one_line(case, tmp_path, tiny_bert_dir, capsys):
    """data.eval's labels are checked as data.train's are: one it lacks is named, and so is a missing label column
    (that was a KeyError traceback, exit 1)."""
    if case == "a label data.train lacks":
        train, evaluation = _named_labels(tmp_path, [{"text": "so so", "label": "mixed"}])
        words = "has label 'mixed' in column 'label', which data.train does not have (its labels: neg, pos)"
    else:
        train, evaluation = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
        train.write_text("".join(json.dumps({"text": r["text"], "label": r["label"]}) + "\n" for r in ROWS))
        evaluation.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in ROWS[:8]))
        words = f"data.eval: {evaluation} has no column 'label' (it has 'text'); set data.label_column to one of those"
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=out, data={"train": str(train), "eval": str(evaluation)})
    for command in ("validate", "train"):
        assert main([command, str(recipe)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_epochs_under_one_step_train_one_step_and_say_so(tmp_path, tiny_llama_dir):
    """train.epochs rounds down to whole steps, but to one at least: 0.5 epochs of 5 rows at a global batch of 4 (one
    step an epoch) trains a whole epoch, which a line says (before, only run.json's epochs 1.0 did)."""
    train = tmp_path / "five.jsonl"
    train.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in ROWS[:5]))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          data={"train": str(train), "eval": None}, batch={"micro_batch_size": 4},
                          train={"max_steps": None, "epochs": 0.5, "eval_every": None})
    result = launch(recipe, nproc=1)
    assert "[toolkit] train.epochs 0.5 is under one step (1 step(s) of 4 samples an epoch): training 1 step, " \
        "1 epoch(s)" in result.stderr, result.stderr[-2000:]
    info = json.loads((out / "run.json").read_text())
    assert (info["total_steps"], info["data"]["train"]["epochs"]) == (1, 1.0)


@pytest.mark.parametrize("train_kind", ["names", "class ids"])
def test_names_in_one_split_and_class_ids_in_the_other_is_one_line(train_kind, tmp_path, tiny_bert_dir, capsys):
    rows = [{"text": r["text"], "label": r["label"]} for r in ROWS]
    named = [{"text": r["text"], "label": ["neg", "pos"][r["label"]]} for r in ROWS]
    train, evaluation = (named, rows) if train_kind == "names" else (rows, named)
    paths = {}
    for key, split in (("train", train), ("eval", evaluation[:16])):
        paths[key] = tmp_path / f"{key}.jsonl"
        paths[key].write_text("".join(json.dumps(r) + "\n" for r in split))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "run", data={k: str(v) for k, v in paths.items()})
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    eval_kind, other = ("class ids", "label names") if train_kind == "names" else ("label names", "class ids")
    assert err == [f"toolkit: error: data.eval: {paths['eval']} has {eval_kind} in column 'label' where data.train "
                   f"has {other}; use one kind in both"]


def test_prompt_response_masks_exactly_the_prompt_tokens():
    from toolkit.data.instruct import encode, prompt_response_text

    tokenizer = _tokenizer()
    prompt, response = "review: the plot was thin. sentiment:", " negative"
    text, spans = prompt_response_text(prompt, response, tokenizer)
    got = encode([text], [spans], tokenizer, max_length=64, add_special_tokens=True)
    # by hand: [CLS] + the prompt's own tokens are the prompt; the response's tokens follow; [SEP] closes
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response.strip(), add_special_tokens=False)["input_ids"]
    ids = [tokenizer.cls_token_id, *prompt_ids, *response_ids, tokenizer.sep_token_id]
    assert got["input_ids"] == [ids]
    assert got["labels"] == [[IGNORE_INDEX] * (1 + len(prompt_ids)) + response_ids + [IGNORE_INDEX]]


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_masks_everything_but_the_assistant_turns():
    from toolkit.data.instruct import chat_text, encode

    tokenizer = _tokenizer()
    messages = [{"role": "user", "content": "rate it"}, {"role": "assistant", "content": "good"},
                {"role": "user", "content": "why"}, {"role": "assistant", "content": "fine acting"}]
    text, spans = chat_text(messages, tokenizer, CHAT_TEMPLATE)
    assert text == ("<user>rate it</user><assistant>good</assistant><user>why</user>"
                    "<assistant>fine acting</assistant>")
    got = encode([text], [spans], tokenizer, max_length=128, add_special_tokens=False)
    trained = tokenizer.decode([t for t in got["labels"][0] if t != IGNORE_INDEX])
    # each assistant turn's content and its closing tag; nothing of the user's turns or the opening tags
    words = tokenizer.decode(tokenizer("good</assistant>fine acting</assistant>", add_special_tokens=False)["input_ids"])
    assert trained == words


def _byte_level_bpe():
    """A byte-level BPE tokenizer as Llama-3's and Qwen-2's are (offsets not trimmed: a word's token holds the space
    before it), trained in memory on a few strings so that " negative" is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([r["text"] + " sentiment: negative positive" for r in ROWS[:16]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def _first_trained(tokenizer, text, labels):
    """The trained tokens as the tokenizer writes them, and where in `text` the first one starts."""
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    return tokenizer.convert_ids_to_tokens([t for t in labels if t != IGNORE_INDEX]), offsets[first][0]


def test_a_response_word_merged_with_the_prompts_trailing_space_is_trained():
    from toolkit.data.instruct import chat_text, encode, prompt_response_text

    tokenizer = _byte_level_bpe()
    prompt = "review: the plot was thin. sentiment: "
    text, spans = prompt_response_text(prompt, "negative", tokenizer)
    labels = encode([text], [spans], tokenizer, max_length=64, add_special_tokens=True)["labels"][0]
    # the tokenizer's own tokens: " negative" is one token that begins at the prompt's last character (the space)
    assert _first_trained(tokenizer, text, labels) == (["Ġnegative", "<|endoftext|>"], len(prompt) - 1)

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")  # a generation prompt ending in a space
    text, spans = chat_text([{"role": "user", "content": "the plot was thin"},
                             {"role": "assistant", "content": "negative"}], tokenizer, template)
    labels = encode([text], [spans], tokenizer, max_length=64, add_special_tokens=False)["labels"][0]
    assert text == "user: the plot was thin\nassistant: negative\n"
    assert _first_trained(tokenizer, text, labels) == (["Ġnegative", "Ċ"], text.index(" negative"))


def test_packing_keeps_each_token_with_its_label():
    pack = _packer(4)
    out = pack({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "labels": [[-100, 2, 3], [-100, -100, 6, 7, 8]]})
    assert out == {"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "labels": [[-100, 2, 3, -100], [-100, 6, 7, 8]]}
    batch = Collator(pad_token_id=0, task="causal-lm")([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                                        {"input_ids": [4, 5], "labels": [-100, 5]}])
    assert batch["labels"].tolist() == [[-100, 2, 3], [-100, 5, -100]] and batch["num_items"] == 3


def test_prompt_response_training_logs_the_mean_over_response_tokens(tmp_path, tiny_llama_dir):
    data = tmp_path / "pairs.jsonl"
    pairs = [{"prompt": f"review: {r['text']} sentiment:", "response": [" negative", " positive"][r["label"]]}
             for r in ROWS]
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          data={"train": str(data), "eval": str(data), "format": "prompt-response", "max_length": 48},
                          train={"max_steps": 2, "eval_every": None})
    launch(recipe, nproc=1)
    steps = metrics(out)

    # the reference: the step-1 global batch through the pretrained model, cross-entropy on the response tokens
    # alone (the prompt's tokens counted by tokenizing the prompt by itself), mean over those tokens
    from transformers import AutoModelForCausalLM

    from toolkit.data.splits import GlobalBatchSampler
    from toolkit.config.recipe import BatchPlan

    tokenizer, model = _tokenizer(), AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    plan = BatchPlan(world_size=1, micro_batch_size=8, grad_accum_steps=1, global_batch_size=8)
    total, count = 0.0, 0
    for index in GlobalBatchSampler(num_samples=len(pairs), plan=plan, rank=0, seed=0).global_batch(0):
        prompt_len = 1 + len(tokenizer(pairs[index]["prompt"], add_special_tokens=False)["input_ids"])  # + [CLS]
        ids = tokenizer(pairs[index]["prompt"] + pairs[index]["response"])["input_ids"][:-1]  # without [SEP]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        target = torch.tensor(ids[prompt_len:])  # predicted from the position before each
        total += torch.nn.functional.cross_entropy(logits[prompt_len - 1:-1], target, reduction="sum").item()
        count += len(target)
    assert steps[0]["loss"] == pytest.approx(total / count, rel=1e-5)
    assert steps[0]["loss_items"] == count
    assert steps[-1]["eval_perplexity"] == pytest.approx(math.exp(steps[-1]["eval_loss"]), rel=1e-12)
    assert exported_weights(out)  # the run exported a model


def test_chat_data_without_a_template_or_an_assistant_turn_is_one_line(tmp_path, tiny_llama_dir, capsys):
    data = tmp_path / "chats.jsonl"
    chats = [{"messages": [{"role": "user", "content": r["text"]},
                           {"role": "assistant", "content": ["no", "yes"][r["label"]]}]} for r in ROWS]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "run"
    base = dict(model_dir=tiny_llama_dir, output_dir=out, train={"max_steps": 2, "eval_every": None})
    recipe = write_recipe(tmp_path / "r.yaml", data={"train": str(data), "eval": None, "format": "chat"}, **base)
    assert main(["validate", str(recipe)]) == 2  # the MiniLM tokenizer has no chat template
    assert "data.format chat: the tokenizer has no chat template" in capsys.readouterr().err
    with_template = {"train": str(data), "eval": None, "format": "chat", "chat_template": CHAT_TEMPLATE}
    recipe = write_recipe(tmp_path / "r.yaml", data=with_template, **base)
    assert main(["validate", str(recipe)]) == 0
    assert "optim.warmup_steps 2 is not below the run's 2" in capsys.readouterr().err  # validate's note only
    chats[3]["messages"] = chats[3]["messages"][:1]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 4 has no assistant message" in err[0], err
