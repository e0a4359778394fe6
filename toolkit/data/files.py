"""Where a split's rows come from, and what they must hold: the data files people have.

`data.train` / `data.eval` may name
  a file            json, jsonl, csv, tsv, parquet or txt, the text formats also compressed (.gz, .bz2, .xz,
                    .zst: through the zstandard package);
  a folder of shards files of one of those formats (e.g. part-00000.parquet ...), read as one split; where the
                    file names name splits by `datasets`' split keywords (train-*, *_validation.*, test.*, dev,
                    eval ...), only the key's split (train; for eval: validation, then test), and a folder without
                    it, or with a file naming none beside them, is refused (load_dataset(folder) would leave that
                    file out without a word; read whole, a validation file would be trained on);
  a saved dataset   a folder `datasets`' save_to_disk wrote: a Dataset, or a DatasetDict whose split named like
                    the key is taken (train; for eval: validation, eval or test).
Every problem with them (missing, empty, unparsable, a column without what training needs) is a RecipeError
naming the file and the fix, found by `toolkit launch` before any rank starts.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.recipe import DataConfig
from toolkit.errors import RecipeError, os_error_under

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".txt": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # what `datasets` decompresses by the file name
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # a save_to_disk folder
EVAL_SPLITS = ("validation", "eval", "test")
TEXT_DTYPES = ("string", "large_string", "string_view")
NUMBER_DTYPES = ("int", "uint", "float", "double")  # read as text where a text column holds them


@dataclass(frozen=True)
class DataSource:
    key: str  # data.train | data.eval
    path: Path
    format: str  # json | csv | tsv | parquet | text | saved
    files: tuple[Path, ...]  # what is read (a saved dataset: every file of its folder)

    def fingerprint(self) -> str:
        """Changes when any file of the source changes (the tokenized cache's identity)."""
        digest = hashlib.sha256()
        for file in self.files:
            stat = file.stat()
            digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()


def format_of(file: Path) -> str | None:
    return FORMATS.get(Path(_uncompressed_name(file)).suffix)


def _uncompressed_name(file: Path) -> str:
    """The file's name without the compression suffixes `datasets` reads through (x.jsonl.gz -> x.jsonl)."""
    name = file.name
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    return name


def data_source(key: str, path: str) -> DataSource:
    """What `key` names, checked to exist and to be something the toolkit reads (no rows read yet)."""
    where = Path(path)
    known = "json, jsonl, csv, tsv, parquet or txt (optionally .gz, .bz2, .xz, .zst)"
    if where.is_dir():
        if any((where / marker).is_file() for marker in SAVED_MARKERS):
            return DataSource(key, where, "saved", tuple(sorted(f for f in where.rglob("*") if f.is_file())))
        shards = sorted(f for f in where.iterdir() if f.is_file() and not f.name.startswith(".") and format_of(f))
        if not shards:
            raise RecipeError(f"{key}: {path} is a folder without data files ({known}) and not a dataset saved with "
                              "save_to_disk; point it at a file, a folder of shards or a saved dataset")
        formats = sorted({str(format_of(f)) for f in shards})
        if len(formats) > 1:
            raise RecipeError(f"{key}: {path} mixes {' and '.join(formats)} files; keep one format per folder")
        _check_copies(key, where, shards)
        _check_compression(key, shards[0], formats[0])
        return DataSource(key, where, formats[0], tuple(_split_of(key, where, shards)))
    if not where.is_file():
        raise RecipeError(f"{key}: {path} not found; give a {known} file, a folder of them or a saved dataset")
    fmt = format_of(where)
    if fmt is None:
        raise RecipeError(f"{key}: {path}: unknown format {where.suffix!r}; use {known}")
    _check_compression(key, where, fmt)
    return DataSource(key, where, fmt, (where,))


def _check_copies(key: str, where: Path, shards: list[Path]) -> None:
    """No two files of a folder are one file compressed and not (x.jsonl beside the x.jsonl.gz `gzip -k` left):
    read as shards, every row would be trained on twice."""
    seen: dict[str, str] = {}
    for file in shards:
        name = _uncompressed_name(file)
        if name in seen:
            raise RecipeError(f"{key}: {where} holds {seen[name]} and {file.name}, one file compressed and not: read "
                              "as shards, each row would count twice; keep one of them in the folder")
        seen[name] = file.name


def _split_of(key: str, where: Path, shards: list[Path]) -> list[Path]:
    """The shards of the key's split where any file name names a split, else all (a folder of shards). A name
    names a split as load_dataset(folder) reads it: one of `datasets`' split keywords, at the start or after a
    separator, followed by one (train-00000.jsonl, my_validation.csv, test.parquet). A folder whose names name
    splits but not the key's, or that also holds a file naming none, is refused: read whole, a folder of
    part-*.jsonl with a validation.jsonl beside them would train on the validation rows. Only the folder's own
    files are read (datasets' patterns would walk every sub-folder)."""
    import fnmatch

    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    named: dict[str, list[Path]] = {}
    for split, keywords in SPLIT_KEYWORDS.items():
        patterns = [p.format(keyword=k, sep=NON_WORDS_CHARS) for k in keywords
                    for p in ("{keyword}[{sep}]*", "*[{sep}]{keyword}[{sep}]*")]
        files = [f for f in shards if any(fnmatch.fnmatchcase(f.name, p) for p in patterns)]
        if files:
            named[str(split)] = files
    if not named:
        return shards
    wanted = ("train",) if key == "data.train" else EVAL_SPLITS
    split = next((name for name in wanted if name in named), None)
    of = f"split {next(iter(named))}" if len(named) == 1 else f"splits {', '.join(named)}"
    if split is None:
        raise RecipeError(f"{key}: {where} holds files of {of}, none named {' or '.join(wanted)}; point {key} at "
                          f"a folder or file of its split (a file is read whatever its name)")
    unnamed = sorted(f.name for f in set(shards) - {f for files in named.values() for f in files})
    if unnamed:
        raise RecipeError(f"{key}: {where} holds files of {of} and {unnamed[0]}, whose name "
                          "gives no split; rename it (train-*, validation-*, test-*) or move it out")
    return named[split]


def _check_compression(key: str, file: Path, fmt: str) -> None:
    """`datasets` decompresses text formats by their suffix; a parquet file compresses its columns itself and is
    read only as written. zstd needs the zstandard package (a dependency of the toolkit; an environment may lack
    it), without which `datasets` blames the file."""
    if fmt == "parquet" and file.name.endswith(COMPRESSIONS):
        raise RecipeError(f"{key}: {file}: parquet is read as written, not from a {file.suffix} archive; decompress "
                          "it (parquet compresses its own columns)")
    if file.name.endswith(".zst"):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise RecipeError(f"{key}: {file} is zstd-compressed, which needs the zstandard package: pip install "
                              "zstandard (or decompress it: zstd -d)") from None


def text_columns(data: DataConfig) -> tuple[str, ...]:
    """The columns data.format reads as text (a chat's messages column holds turns)."""
    if data.format == "chat":
        return ()
    if data.format == "prompt-response":
        return data.prompt_column, data.response_column
    return (data.text_column,)


def _csv_cell(value: str) -> str | None:
    """A CSV cell of a text column as written: pandas would read a column of 007 and 1.50 as the numbers 7 and
    1.5. An empty cell stays a missing value, as pandas reads it."""
    return value if value != "" else None


def read_rows(source: DataSource, *, text: tuple[str, ...] = ()):
    """The split's rows, untokenized (a datasets.Dataset); a CSV's `text` columns as written. A source without
    rows, or one that does not parse as its format, is one line naming it."""
    import datasets
    import pandas
    from datasets.arrow_writer import SchemaInferenceError

    datasets.disable_progress_bars()
    if source.format == "saved":
        return _saved_split(source)
    if all(f.stat().st_size == 0 for f in source.files):
        raise RecipeError(f"{source.key}: {source.path} is empty: it has no rows; point {source.key} at a file "
                          "with data")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is the one line below, not the
    try:                                                        # library's log of it too
        builder, options = ("csv", {"delimiter": "\t"}) if source.format == "tsv" else (source.format, {})
        converters = {"converters": {column: _csv_cell for column in text}} if builder == "csv" else {}
        raw = datasets.load_dataset(builder, data_files=[str(f) for f in source.files if f.stat().st_size],
                                    split="train", **options, **converters)
    except ValueError as exc:
        if "corresponds to no data" not in str(exc):
            raise _unreadable(source, exc) from None
        raw = None
    except StopIteration:  # datasets' json reader on a compressed file that holds no rows
        raw = None
    except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, OSError) as exc:
        if not isinstance(exc.__cause__, (SchemaInferenceError, pandas.errors.EmptyDataError)):
            raise _unreadable(source, exc.__cause__ or exc) from None
        raw = None  # the text and csv readers on a compressed file that holds nothing
    finally:
        datasets.logging.set_verbosity(verbosity)
    if raw is None or len(raw) == 0:
        raise RecipeError(f"{source.key}: {source.path} has no rows (a header at most); point {source.key} at a "
                          "file with data")
    return raw


def num_blank_lines(raw, source: DataSource, column: str) -> int:
    """How many of a text file's rows are empty or only whitespace (0 for other formats: a row there is a record);
    all of them is a RecipeError. Counted without writing anything (validate counts; the ranks drop them)."""
    if source.format != "text":
        return 0
    num_blank = sum(1 for line in raw[column] if not line.strip())
    if num_blank == len(raw):
        raise RecipeError(f"{source.key}: {source.path} has only blank lines; point {source.key} at a file with text")
    return num_blank


def drop_blank_lines(raw, source: DataSource, column: str, *, fingerprint: str):
    """A text file's rows without the lines that are empty or only whitespace (the blank line between
    paragraphs), and how many those were: a tokenizer that adds [CLS] [SEP] makes a sample of each, which would
    teach the model nothing but its own markup. Other formats keep every row: a row there is a record."""
    num_blank = num_blank_lines(raw, source, column)
    if not num_blank:  # nothing to drop: no filtered copy of the split written
        return raw, 0
    kept = raw.filter(lambda batch: [bool(line.strip()) for line in batch[column]], batched=True,
                      new_fingerprint=fingerprint)
    return kept, num_blank


def _unreadable(source: DataSource, exc: BaseException) -> RecipeError:
    denied = os_error_under(exc)  # datasets' own error raised from the reader's
    if isinstance(denied, PermissionError):  # not the file's format: the suffix advice would mislead
        return RecipeError(f"{source.key}: {source.path} cannot be read ({denied.strerror}: {denied.filename}); make "
                           "it readable by this user")
    cause = str(exc).strip().splitlines()
    reason = cause[-1][:200] if cause else type(exc).__name__
    if source.format == "json" and "in row " in reason:
        # arrow counts rows from 0 within the block it was parsing: not a line a user can find
        reason = _first_bad_json_line(source.files) or re.sub(r" in row \d+", "", reason)
    return RecipeError(f"{source.key}: {source.path} cannot be read as {source.format} ({reason}); fix the file or "
                       "give it the suffix of its format")


def _first_bad_json_line(files) -> str | None:
    """In JSON Lines files, the first line that is no JSON: "FILE line N: why" (1-based, as an editor counts),
    or None where the files are no JSON Lines (one document, an array) or every line parses."""
    import json

    import fsspec  # datasets' own file layer: decompresses by the file name, as datasets did reading it

    for file in files:
        with fsspec.open(str(file), "rt", compression="infer", encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if number == 1 and not line.lstrip().startswith("{"):
                    break  # one JSON document, not a record per line
                if not line.strip():
                    continue
                try:
                    json.loads(line.rstrip("\r\n"))
                except ValueError as exc:
                    return f"{Path(file).name} line {number}: {getattr(exc, 'msg', exc)}"
    return None


def _saved_split(source: DataSource):
    import datasets

    try:
        saved = datasets.load_from_disk(str(source.path))
    except IndexError:  # datasets concatenates the saved arrow files: there are none
        raise RecipeError(f"{source.key}: {source.path} has no rows; point {source.key} at data") from None
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise _unreadable(source, exc) from None
    if isinstance(saved, datasets.DatasetDict):
        wanted = ("train",) if source.key == "data.train" else EVAL_SPLITS
        split = next((name for name in wanted if name in saved), None)
        if split is None:
            raise RecipeError(f"{source.key}: {source.path} holds splits {', '.join(saved)}, none named "
                              f"{' or '.join(wanted)}; save the split as its own dataset or rename it")
        saved = saved[split]
    if len(saved) == 0:
        raise RecipeError(f"{source.key}: {source.path} has no rows; point {source.key} at data")
    return saved


def columns(raw) -> str:
    """The split's column names, quoted: a stray space in a CSV header shows."""
    return ", ".join(repr(c) for c in raw.column_names)


def check_records(raw, source: DataSource) -> None:
    """One row per record: a JSON file of one object whose values are lists (columnar, as pandas' to_json
    writes a dict of lists) reads as a single row of lists."""
    import datasets

    if len(raw) == 1 and all(isinstance(f, (datasets.List, datasets.LargeList)) for f in raw.features.values()):
        raise RecipeError(f"{source.key}: {source.path} holds one record whose values are lists (columnar JSON); "
                          "write one record per line (JSON Lines: {\"text\": ..., \"label\": ...})")


def shown(value) -> str:
    """A cell's value as Python writes it (a number unquoted, text quoted), cut to fit one line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def first_row(raw, column: str, bad) -> tuple[int, object]:
    """The 1-based number and value of the first row whose `column` value is bad (an error path: one pass)."""
    return next((number, value) for number, value in enumerate(raw[column], start=1) if bad(value))


def check_filled(raw, source: DataSource, column: str) -> None:
    if raw.data.column(column).null_count:  # arrow's count: no Python pass over the column
        number, _ = first_row(raw, column, lambda v: v is None)
        raise RecipeError(f"{source.key}: {source.path} row {number} has no {column!r}; fill or drop it")


def check_some_text(raw, source: DataSource, column: str, setting: str) -> None:
    """A text column in which every row is empty (or only whitespace) is no data: the run would train on the
    tokenizer's special tokens alone. Empty rows among others are the data's own (a text file's blank lines:
    num_blank_lines). Read chunk by chunk, up to the first that holds text: a large column is neither copied
    nor read whole (the arrow table's, whatever rows a view of it selects: text there is text in the file)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if source.format == "text" or not len(raw):
        return
    for chunk in raw.data.column(column).chunks:
        for start in range(0, len(chunk), 65536):
            piece = chunk.slice(start, 65536)
            try:
                if not pc.max(pc.binary_length(piece)).as_py():  # every value empty: nothing to trim
                    continue
                if pc.max(pc.utf8_length(pc.utf8_trim_whitespace(piece))).as_py():
                    return
            except pa.ArrowNotImplementedError:  # a type arrow's kernels lack (string_view in some releases)
                if any(str(value).strip() for value in piece.to_pylist() if value is not None):
                    return
    raise RecipeError(f"{source.key}: {source.path} column {column!r} is empty in every row; point "
                      f"{source.key} at the data, or set {setting} to the column with the text")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_text_column(raw, source: DataSource, column: str, setting: str, *, may_be_empty: bool = False) -> None:
    """`column` exists and holds text or numbers (read as text: numbers_as_text) in every row; text in some row
    unless `may_be_empty` (a prompt column: data that is responses alone)."""
    import datasets

    if column not in raw.column_names:
        raise RecipeError(f"{source.key}: {source.path} has no column {column!r} (it has {columns(raw)}); set "
                          f"{setting} to one of those")
    check_filled(raw, source, column)
    feature = raw.features[column]
    if isinstance(feature, datasets.Value) and feature.dtype.startswith(TEXT_DTYPES):
        if not may_be_empty:
            check_some_text(raw, source, column, setting)
        return
    if isinstance(feature, datasets.Value) and feature.dtype.startswith(NUMBER_DTYPES):
        return
    if isinstance(feature, datasets.Json):  # JSON values of several types: text and numbers in some rows only
        if not any(not isinstance(v, str) and not _is_number(v) for v in raw[column]):
            return
        number, value = first_row(raw, column, lambda v: not isinstance(v, str) and not _is_number(v))
        raise RecipeError(f"{source.key}: {source.path} row {number} has {shown(value)} in column {column!r}, "
                          "where other rows have text; write it as text (in quotes) or drop the row")
    raise RecipeError(f"{source.key}: {source.path} column {column!r} holds {describe(feature)}, not text; set "
                      f"{setting} to the column with the text")


def numbers_as_text(raw, text: tuple[str, ...], *, fingerprint: str):
    """`raw` with the numbers of its `text` columns as text (42 -> "42"): a math set's answers are what the model
    must write. A JSON or parquet number is its value's text (2.50 -> "2.5"; arrow reads a JSON column mixing 42
    and 2.5 as floats: 42.0); text in quotes is kept as written."""
    import datasets

    for column in [c for c in text if c in raw.column_names and not (isinstance(raw.features[c], datasets.Value)
                                                                      and raw.features[c].dtype in TEXT_DTYPES)]:
        stored = raw.data.column(column).to_pylist()
        if isinstance(raw.features[column], datasets.Json):  # JSON values of several types, each stored as JSON
            texts = [value if value is None else _json_text(value) for value in stored]
        else:
            texts = [value if value is None else str(value) for value in stored]
        # added beside it first: a table whose one column is removed keeps no rows to add one to
        kept = f"{column}.text"
        while kept in raw.column_names:  # a name of the file's own
            kept += "_"
        raw = raw.add_column(kept, texts, new_fingerprint=f"{fingerprint}-{column}", feature=datasets.Value("string"))
        raw = raw.remove_columns(column).rename_column(kept, column)
    return raw


def _json_text(stored: str) -> str:
    """A Json column's value as text: datasets stores each as JSON, and a quoted number ("1.50") unquoted, so
    the stored text of what is not a string is kept, not the number it parses as (1.5)."""
    import json

    value = json.loads(stored)
    return value if isinstance(value, str) else stored


def describe(feature) -> str:
    dtype = getattr(feature, "dtype", None)
    if dtype in TEXT_DTYPES:
        return "text"
    return f"{dtype} values" if dtype else type(feature).__name__
