"""What of a data file reaches training: packing keeps every token of long documents, truncation and blank lines
are counted in one note, and a file a user got wrong (mixed label types, a template given as a path, a tab-
separated or zstd file) is one line naming the row, value or fix — found by `validate` where `train` would refuse."""

import importlib.util
import json
import sys

import pytest
import torch

from conftest import MINILM, TRAIN, write_recipe
from toolkit.cli import main
from toolkit.config.files import load_recipe
from toolkit.data.losses import IGNORE_INDEX
from toolkit.data.splits import data_note, load_split
from toolkit.process.dist import DistEnv

ROWS = [json.loads(line) for line in open(TRAIN)][:64]
ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tokenizer():
    from transformers import AutoTokenizer

    from toolkit.model.build import resolve_path

    return AutoTokenizer.from_pretrained(str(resolve_path(MINILM)))


def _split(recipe_path, key="data.train", names=None):
    recipe = load_recipe(recipe_path)
    return load_split(key, data=recipe.data, task=recipe.model.task, num_labels=recipe.model.num_labels,
                      tokenizer=_tokenizer(), env=ONE_RANK, names=names)


def _one_line_exit_2(code, capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("toolkit: error:"), err
    assert all(w in err[0] for w in words), err


def _long_documents(tmp_path):
    """4 documents of ~3,000 tokens each and 60 short ones."""
    path = tmp_path / "long.jsonl"
    rows = [{"text": " ".join(r["text"] for r in ROWS) if i < 4 else ROWS[i]["text"]} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, [r["text"] for r in rows]


def test_packing_keeps_every_token_of_long_documents(tmp_path, tiny_llama_dir):
    """Packing tokenizes whole documents and cuts their stream into blocks (transformers' run_clm group_texts):
    the blocks are the first len // 32 blocks of the concatenated whole-document token ids. Before, each
    document was cut at data.max_length first and ~90 % of these tokens never reached a block."""
    path, texts = _long_documents(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None, "packing": True, "max_length": 32})
    dataset, _, counts = _split(recipe)
    stream = [t for ids in _tokenizer()(texts)["input_ids"] for t in ids]  # the reference: whole documents
    blocks = len(stream) // 32
    assert dataset["input_ids"] == [stream[i * 32:(i + 1) * 32] for i in range(blocks)]
    assert counts.num_tokens == len(stream) and counts.num_cut == 0
    assert counts.num_tokens_unpacked == len(stream) - blocks * 32 < 32  # one partial block: 64 rows, one batch


def test_a_block_longer_than_a_packing_batch_s_tokens_still_packs(tmp_path, tiny_llama_dir, monkeypatch):
    """Each packing batch's last partial block is left out. Its size was fixed in samples (1,000), so a block longer
    than 1,000 short samples' tokens left out every token: 1,000 reviews hold ~15,000 tokens, and packing them into
    blocks of 16,384 was refused as "fewer than one packed block" for a file of 158,610 tokens. A batch now holds
    PACK_BLOCKS blocks' worth of samples at least; here PACK_ROWS is 8 samples (~100 tokens) and a block 128."""
    from toolkit.data import splits

    monkeypatch.setattr(splits, "PACK_ROWS", 8)
    texts = [r["text"] for r in ROWS]
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None, "packing": True, "max_length": 128})
    dataset, _, counts = _split(recipe)
    stream = [t for ids in _tokenizer()(texts)["input_ids"] for t in ids]
    assert sum(len(ids) for ids in _tokenizer()(texts[:8])["input_ids"]) < 128  # 8 samples: not one block
    blocks = len(stream) // 128
    assert blocks >= 4 and dataset["input_ids"] == [stream[i * 128:(i + 1) * 128] for i in range(blocks)]
    assert counts.num_tokens_unpacked == len(stream) - blocks * 128 and counts.pack_rows == len(texts)


def test_a_split_packed_again_in_other_batches_reads_none_of_the_first_packing_s_cache(tmp_path, tiny_llama_dir,
                                                                                       monkeypatch):
    """The blocks depend on the packing batches' size, which its cache key carries; the filter after it (blocks
    with a token to learn from) was keyed without it, so a second packing in other batches read the first one's
    index list: other rows, or rows past the end. Each packing here equals one made by hand from its batches."""
    from toolkit.data import splits

    texts = [f"{r['text']} {i}" for i, r in enumerate(ROWS * 40)]  # 2,560 samples
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None, "packing": True, "max_length": 32})
    ids = _tokenizer()(texts)["input_ids"]
    for rows in (1000, 100):
        monkeypatch.setattr(splits, "PACK_ROWS", rows)
        dataset, _, counts = _split(recipe)
        expected = []
        for start in range(0, len(ids), counts.pack_rows):
            stream = [t for sample in ids[start:start + counts.pack_rows] for t in sample]
            expected += [stream[i:i + 32] for i in range(0, len(stream) // 32 * 32, 32)]
        assert counts.pack_rows == rows and dataset["input_ids"] == expected, rows


def test_truncation_without_packing_is_one_note_with_the_share_of_tokens_lost(tmp_path, tiny_llama_dir):
    path, texts = _long_documents(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None, "max_length": 32})
    dataset, _, counts = _split(recipe)
    whole = [len(ids) for ids in _tokenizer()(texts)["input_ids"]]
    assert sum(len(ids) for ids in dataset["input_ids"]) == sum(min(n, 32) for n in whole)
    assert counts.num_cut == sum(n > 32 for n in whole) == 4  # the long documents; no short one reaches 32
    assert counts.num_tokens == sum(whole) and counts.num_tokens_cut == sum(max(n - 32, 0) for n in whole)
    note = data_note("data.train", counts, load_recipe(recipe).data)
    share = f"{counts.num_tokens_cut / counts.num_tokens:.1%}"
    assert note == (f"[toolkit] data.train: 4 sample(s) longer than data.max_length 32 were cut, dropping "
                    f"{counts.num_tokens_cut:,} of {counts.num_tokens:,} tokens ({share}); raise data.max_length, "
                    "or set data.packing: true (causal-lm) to keep them")
    short = write_recipe(tmp_path / "short.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                         data={"train": TRAIN, "eval": None, "max_length": 64})
    assert data_note("data.train", _split(short)[2], load_recipe(short).data) is None  # nothing cut: no note


def test_blank_lines_of_a_text_file_are_left_out_and_counted(tmp_path, tiny_llama_dir, capsys):
    """Paragraphs separated by blank lines (CRLF): the MiniLM tokenizer makes [CLS] [SEP] of a blank line, a
    sample with a token to learn from, so half of the samples taught the model its own markup."""
    path = tmp_path / "paragraphs.txt"
    path.write_bytes("".join(f"{r['text']}\r\n \r\n" for r in ROWS).encode())
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None})
    dataset, _, counts = _split(recipe)
    tokenizer = _tokenizer()
    assert dataset["input_ids"] == [tokenizer(r["text"], truncation=True, max_length=32)["input_ids"] for r in ROWS]
    assert counts.num_blank == 64
    note = data_note("data.train", counts, load_recipe(recipe).data)
    assert note == "[toolkit] data.train: 64 blank line(s) left out"
    path.write_text("\n  \n\t\n")
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, f"data.train: {path} has only blank lines")


# a file as a user may have it: (its name, its text, the words of the one line)
MIXED = [{"text": r["text"], "label": r["label"]} for r in ROWS[:8]]
BAD_FILES = {
    "ids and names": ("mixed.jsonl", [*MIXED[:5], {"text": "meh", "label": "pos"}, *MIXED[5:]],
                      "row 6 has label 'pos' in column 'label' where other rows have class ids; use one kind"),
    "a boolean among texts": ("booltext.jsonl", [*MIXED[:3], {"text": True, "label": 0}, *MIXED[3:]],
                              "row 4 has True in column 'text', where other rows have text"),  # a number is text
    "a fraction among ids": ("float.jsonl", [*MIXED[:6], {"text": "meh", "label": 1.5}, *MIXED[6:]],
                             "row 7 has label 1.5 in column 'label'; labels must be class ids (whole numbers)"),
    # every row's label a list or a mapping: arrow has no kernel to list their distinct values (it raised its own
    # ArrowNotImplementedError, a traceback)
    "a list as every label": ("lists.jsonl", [{**r, "label": [r["label"]]} for r in MIXED],
                              f"column 'label' holds List (row 1: [{MIXED[0]['label']}]); labels must be class ids "
                              "or names, one a row"),
    "a mapping as every label": ("maps.jsonl", [{**r, "label": {"id": r["label"]}} for r in MIXED],
                                 f"column 'label' holds dict (row 1: {{'id': {MIXED[0]['label']}}}); labels must "
                                 "be class ids or names"),
    "columnar json": ("columns.json", {"text": [r["text"] for r in MIXED], "label": [r["label"] for r in MIXED]},
                      "holds one record whose values are lists (columnar JSON); write one record per line"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_label_or_text_of_the_wrong_kind_names_its_row_and_value(case, tmp_path, tiny_llama_dir, capsys):
    name, rows, words = BAD_FILES[case]
    path = tmp_path / name
    path.write_text(json.dumps(rows) if isinstance(rows, dict) else "".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, task="sequence-classification",
                          output_dir=tmp_path / "out", data={"train": str(path), "eval": None})
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, f"data.train: {path} {words}")


def test_responses_that_are_numbers_are_read_as_the_text_written(tmp_path, tiny_llama_dir):
    prompts = [f"what is {r['text'][:20]}? answer:" for r in ROWS[:4]]
    written = ["2", "007", "1.50", "42"]  # pandas alone reads this column as the floats 2.0, 7.0, 1.5, 42.0
    csv = tmp_path / "math.csv"
    csv.write_text("prompt,response\n" + "".join(f'"{p}",{r}\n' for p, r in zip(prompts, written)))
    ints, mixed = tmp_path / "ints.jsonl", tmp_path / "mixed.jsonl"  # a JSON number: its value's text
    for path, responses in ((ints, [2, 7, 15, 42]), (mixed, ["yes", 7, "1.50", 42])):
        path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in zip(prompts, responses)))
    tokenizer = _tokenizer()
    for path, responses in ((csv, written), (ints, ["2", "7", "15", "42"]), (mixed, ["yes", "7", "1.50", "42"])):
        recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                              data={"train": str(path), "eval": None, "format": "prompt-response"})
        dataset, _, _ = _split(recipe)
        for row, prompt, response in zip(dataset, prompts, responses, strict=True):  # the tokenizer alone, on the text
            whole = tokenizer(prompt + response)["input_ids"]
            skip = len(tokenizer(prompt)["input_ids"]) - 1  # [CLS] and the prompt's tokens, without [SEP]
            assert row["input_ids"] == whole, (path, response)
            assert [t for t in row["labels"] if t != IGNORE_INDEX] == whole[skip:-1], (path, response)


def test_a_text_column_of_numbers_alone_is_read_as_their_text(tmp_path, tiny_llama_dir):
    """The file's text column is the numbers (before: its column was removed first, which left a file of one
    column a table of no rows to add the text to, and every run crashed in datasets' concatenation)."""
    tokenizer = _tokenizer()
    for name, values, texts, beside in (("ints", [2, 7, 15, 42], ["2", "7", "15", "42"], {}),
                                        ("mixed", ["yes", 7, "1.50", 42], ["yes", "7", "1.50", "42"], {}),
                                        # beside a column named as the conversion's temporary one
                                        ("named", [2, 7, 15, 42], ["2", "7", "15", "42"], {"text.text": "x"})):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": v, **beside}) + "\n" for v in values))
        recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                              data={"train": str(path), "eval": None})
        dataset, _, _ = _split(recipe)
        assert [row["input_ids"] for row in dataset] == [tokenizer(t)["input_ids"] for t in texts], name


def test_csv_cells_and_headers_name_the_row_and_show_the_spaces(tmp_path, tiny_llama_dir, capsys):
    path = tmp_path / "train.csv"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, task="sequence-classification",
                          output_dir=tmp_path / "out", data={"train": str(path), "eval": None})
    path.write_text("text,label\n" + "good,1\n" * 5 + "bad,\n" + "meh,0\n" * 4)
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, "row 6 has no 'label'; fill or drop it")
    path.write_text("text , label\n" + "good,1\n" * 8)
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, "has no column 'text' (it has 'text ', ' label')")


def test_validate_refuses_fewer_train_rows_than_one_global_batch_as_train_does(tmp_path, tiny_llama_dir, capsys):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None})
    for command in ("validate", "train"):
        _one_line_exit_2(main([command, str(recipe)]), capsys,
                         "data: 3 train samples are fewer than one global batch of 8; lower batch sizes or add data")
    # packed, 3 long rows may fill many blocks: known only once tokenized, so validate lets it through
    assert main(["validate", str(recipe), "--set", "data.packing=true"]) == 0


def test_a_folder_holding_a_file_and_its_compressed_copy_is_one_line(tmp_path, tiny_llama_dir, capsys):
    """Before: both were read as shards, 128 rows from 64, each trained on twice."""
    import gzip

    folder = tmp_path / "d"
    folder.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in ROWS)
    (folder / "x.jsonl").write_text(text)
    (folder / "x.jsonl.gz").write_bytes(gzip.compress(text.encode()))  # what `gzip -k x.jsonl` leaves
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(folder), "eval": None})
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, "holds x.jsonl and x.jsonl.gz, one file compressed "
                     "and not", "each row would count twice")


@pytest.mark.parametrize("compressed", [False, True])
def test_a_json_lines_file_cut_mid_line_names_the_line_as_an_editor_counts(compressed, tmp_path, tiny_llama_dir,
                                                                          capsys):
    """arrow said "in row 9" of line 10: it counts from 0, within the block it was parsing."""
    import gzip

    text = "".join(json.dumps(r) + "\n" for r in ROWS[:9]) + '{"text": "cut", "lab\n' + json.dumps(ROWS[9]) + "\n"
    path = tmp_path / ("x.jsonl.gz" if compressed else "x.jsonl")
    path.write_bytes(gzip.compress(text.encode()) if compressed else text.encode())
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None})
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, f"({path.name} line 10: Unterminated string")


def test_a_tab_separated_file_reads_as_the_same_rows(tmp_path, tiny_llama_dir):
    path = tmp_path / "train.tsv"
    path.write_text("text\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in ROWS))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, task="sequence-classification",
                          output_dir=tmp_path / "out", data={"train": str(path), "eval": None})
    dataset, _, _ = _split(recipe)
    tokenizer = _tokenizer()
    assert dataset["input_ids"] == [tokenizer(r["text"], truncation=True, max_length=32)["input_ids"] for r in ROWS]
    assert dataset["label"] == [r["label"] for r in ROWS]


def test_a_zstd_file_reads_or_names_the_package_to_install(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    path = tmp_path / "train.jsonl.zst"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None})
    text = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    if importlib.util.find_spec("zstandard"):  # a dependency (pyproject.toml): the file reads as its rows
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(text))
        assert _split(recipe)[0].num_rows == 64
    path.write_bytes(b"\x28\xb5\x2f\xfd")  # what is read never matters without the package: the line names it
    monkeypatch.setitem(sys.modules, "zstandard", None)  # an environment without it
    _one_line_exit_2(main(["validate", str(recipe)]), capsys,
                     f"data.train: {path} is zstd-compressed, which needs the zstandard package: pip install zstandard")


def test_a_chat_template_file_is_read_and_a_template_that_writes_no_message_is_one_line(tmp_path, tiny_llama_dir,
                                                                                        capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["text"]},
                                                     {"role": "assistant", "content": ["no", "yes"][r["label"]]}]})
                            + "\n" for r in ROWS))
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(data), "eval": None, "format": "chat", "chat_template": str(template)})
    assert main(["validate", str(recipe)]) == 0
    from_file, _, _ = _split(recipe)
    inline = write_recipe(tmp_path / "inline.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(data), "eval": None, "format": "chat", "chat_template": CHAT_TEMPLATE})
    assert from_file["labels"] == _split(inline)[0]["labels"]  # the file's template, as if given as text
    template.unlink()
    _one_line_exit_2(main(["validate", str(recipe)]), capsys,
                     f"data.chat_template '{template}' is neither a Jinja template", "nor a file")
    roles_only = "{% for m in messages %}<{{ m['role'] }}>{% endfor %}"
    _one_line_exit_2(main(["validate", str(recipe), "--set", f"data.chat_template={json.dumps(roles_only)}"]), capsys,
                     "data.chat_template does not write the assistant's message")


def test_the_chat_template_trained_with_is_saved_with_the_export_and_the_checkpoint(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["text"]},
                                                     {"role": "assistant", "content": ["no", "yes"][r["label"]]}]})
                            + "\n" for r in ROWS[:8]))
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          data={"train": str(data), "eval": None, "format": "chat", "chat_template": str(template)},
                          train={"max_steps": 1}, checkpoint={"final": True})
    assert AutoTokenizer.from_pretrained(tiny_llama_dir).chat_template is None  # the model's own has none
    assert main(["train", str(recipe)]) == 0
    saved = [out / "model", *(out / "checkpoints").glob("*/hf")]
    assert len(saved) == 2, saved
    for folder in saved:  # what a user's transformers reads back, against the file the recipe named
        assert AutoTokenizer.from_pretrained(folder).chat_template == template.read_text(), folder


def test_a_chat_template_that_fails_on_one_conversation_names_its_split_file_and_row(tmp_path, tiny_llama_dir):
    from toolkit.errors import RecipeError

    rows = [[{"role": "user", "content": r["text"]}, {"role": "assistant", "content": "yes"}] for r in ROWS[:9]]
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    rows[6].insert(1, {"role": "tool", "content": "42"})  # row 7: a role the template refuses
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    strict = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
              "{{ raise_exception('no role ' + m['role']) }}{% endif %}" + CHAT_TEMPLATE.split("%}", 1)[1])
    for key, train, evaluation in (("data.train", data, None), ("data.eval", clean, data)):
        recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                              data={"train": str(train), "eval": evaluation and str(evaluation), "format": "chat",
                                    "chat_template": strict})
        with pytest.raises(RecipeError) as refused:
            _split(recipe, key)
        assert str(refused.value) == (f"{key}: {data} row 7: data.chat_template fails on its conversation "
                                      "(TemplateError: no role tool); fix it")


def test_a_saved_class_label_column_gives_its_names(tmp_path, tiny_bert_dir):
    """A datasets ClassLabel says which id each name is: those are the class names (exported as id2label), and an
    eval file with the names maps onto the same ids."""
    import datasets

    saved = tmp_path / "saved"
    table = datasets.Dataset.from_list([{"text": r["text"], "label": r["label"]} for r in ROWS])
    table.cast_column("label", datasets.ClassLabel(names=["neg", "pos"])).save_to_disk(str(saved))
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text("".join(json.dumps({"text": r["text"], "label": ["neg", "pos"][r["label"]]}) + "\n"
                                  for r in ROWS[:16]))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=tmp_path / "out", data={"train": str(saved), "eval": str(evaluation)})
    train, names, _ = _split(recipe)
    assert names == ["neg", "pos"] and train["label"] == [r["label"] for r in ROWS]
    evaluated, _, _ = _split(recipe, key="data.eval", names=names)
    assert evaluated["label"] == [r["label"] for r in ROWS[:16]]
    assert main(["validate", str(recipe)]) == 0


def test_packed_instruction_blocks_without_a_response_token_are_counted_as_blocks_and_tokens(tmp_path,
                                                                                             tiny_llama_dir):
    """Prompts longer than a block: packing leaves out the blocks that hold prompt text only. The note said
    "N sample(s) have no token to learn from" of what were blocks, and not the share of the tokens they held
    (here most of them). Checked against the kept blocks: the blocks packed = kept + left out, every kept block
    has a response token, and the tokens left out are whole blocks."""
    data = tmp_path / "long-prompts.jsonl"
    pairs = [{"prompt": "reviews: " + " ".join(r["text"] for r in ROWS[i:i + 6]) + " sentiment:",
              "response": " positive"} for i in range(32)]
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(data), "eval": None, "format": "prompt-response", "packing": True,
                                "max_length": 32})
    dataset, _, counts = _split(recipe)
    packed = (counts.num_tokens - counts.num_tokens_unpacked) // 32
    left_out = packed - len(dataset)
    assert counts.num_left_out == left_out > len(dataset)  # most blocks are prompt text only
    assert all(any(label != -100 for label in row[1:]) for row in dataset["labels"])
    tokens = left_out * 32
    note = data_note("data.train", counts, load_recipe(recipe).data)
    assert note == (f"[toolkit] data.train: {left_out} of {packed} packed blocks of data.max_length 32 tokens hold "
                    f"no response token: {tokens:,} of {counts.num_tokens:,} tokens "
                    f"({tokens / counts.num_tokens:.1%}) left out, and a response whose prompt began in another "
                    "block is trained without it; raise data.max_length, or leave data.packing off for prompts this "
                    "long; "
                    f"{counts.num_tokens_unpacked:,} of {counts.num_tokens:,} tokens "
                    f"({counts.num_tokens_unpacked / counts.num_tokens:.1%}) are left out of packing: the partial "
                    "block at the end of every 32 samples")  # the split's 32: one packing batch


def _cased_tokenizer(path):
    """The test tokenizer saved without lower-casing: the same vocabulary (an uncased one), other ids ("Overall" is
    [UNK])."""
    from transformers import AutoTokenizer

    from toolkit.model.build import resolve_path

    AutoTokenizer.from_pretrained(str(resolve_path(MINILM)), do_lower_case=False).save_pretrained(path)
    return AutoTokenizer.from_pretrained(str(path))


def test_a_tokenizer_with_the_same_vocabulary_that_tokenizes_otherwise_reads_its_own_tokens(tmp_path,
                                                                                           tiny_llama_dir):
    """The tokenized cache keyed the vocabulary, not the normalizer: a second tokenizer with the same
    vocabulary was given the first one's cached tokens. The reference is the second tokenizer called directly."""
    import shutil

    from transformers import AutoTokenizer

    from toolkit.data.splits import tokenizer_identity

    path = tmp_path / "rows.jsonl"
    texts = [r["text"].capitalize() for r in ROWS[:16]]  # capitals: what lower-casing changes
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                                      data={"train": str(path), "eval": None}))
    plain, other = _tokenizer(), _cased_tokenizer(tmp_path / "cased")
    assert other.get_vocab() == plain.get_vocab()
    shutil.copytree(tiny_llama_dir, tmp_path / "copy")  # the same files elsewhere: the same identity

    def identity(folder):
        return tokenizer_identity(AutoTokenizer.from_pretrained(str(folder)))

    assert identity(tmp_path / "copy") == identity(tiny_llama_dir)
    assert tokenizer_identity(other) != tokenizer_identity(plain)

    def ids(tokenizer):
        return load_split("data.train", data=recipe.data, task="causal-lm", num_labels=2, tokenizer=tokenizer,
                          env=ONE_RANK)[0]["input_ids"]

    assert ids(plain) == plain(texts, truncation=True, max_length=32)["input_ids"]
    assert ids(other) == other(texts, truncation=True, max_length=32)["input_ids"] != ids(plain)


@pytest.mark.parametrize("raised", ["itself", "under datasets' error"])
def test_a_data_file_this_user_cannot_read_says_so_not_its_format(raised, tmp_path, tiny_llama_dir, capsys,
                                                                  monkeypatch):
    """A file without read permission: the line names the permission, not the format (it said "cannot be read as
    json ...; fix the file or give it the suffix of its format"). The tests run as root, whom the kernel lets read
    any file, so the reader's EACCES is raised where datasets' reader meets it: as itself, or as the cause of
    datasets' own DatasetGenerationError."""
    import datasets

    path = tmp_path / "locked.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    denied = PermissionError(13, "Permission denied", str(path))

    def load_dataset(*args, **kwargs):
        if raised == "itself":
            raise denied
        raise datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset") \
            from denied

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out",
                          data={"train": str(path), "eval": None})
    _one_line_exit_2(main(["validate", str(recipe)]), capsys, f"data.train: {path} cannot be read (Permission "
                     f"denied: {path}); make it readable by this user")
