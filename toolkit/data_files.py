"""Where a split's rows come from, and what they must hold: the data files people have.

`data.train` / `data.eval` may name
  a file            json, jsonl, csv, parquet or txt, the text formats also compressed (.gz, .bz2, .xz, .zst);
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
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import RecipeError
from toolkit.recipe import DataConfig

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # what `datasets` decompresses by the file name
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # a save_to_disk folder
EVAL_SPLITS = ("validation", "eval", "test")
TEXT_DTYPES = ("string", "large_string", "string_view")


@dataclass(frozen=True)
class DataSource:
    key: str  # data.train | data.eval
    path: Path
    format: str  # json | csv | parquet | text | saved
    files: tuple[Path, ...]  # what is read (a saved dataset: every file of its folder)

    def fingerprint(self) -> str:
        """Changes when any file of the source changes (the tokenized cache's identity)."""
        digest = hashlib.sha256()
        for file in self.files:
            stat = file.stat()
            digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()


def format_of(file: Path) -> str | None:
    name = file.name
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    return FORMATS.get(Path(name).suffix)


def data_source(key: str, path: str) -> DataSource:
    """What `key` names, checked to exist and to be something the toolkit reads (no rows read yet)."""
    where = Path(path)
    known = "json, jsonl, csv, parquet or txt (optionally .gz, .bz2, .xz, .zst)"
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
        _check_compression(key, shards[0], formats[0])
        return DataSource(key, where, formats[0], tuple(_split_of(key, where, shards)))
    if not where.is_file():
        raise RecipeError(f"{key}: {path} not found; give a {known} file, a folder of them or a saved dataset")
    fmt = format_of(where)
    if fmt is None:
        raise RecipeError(f"{key}: {path}: unknown format {where.suffix!r}; use {known}")
    _check_compression(key, where, fmt)
    return DataSource(key, where, fmt, (where,))


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
    read only as written."""
    if fmt == "parquet" and file.name.endswith(COMPRESSIONS):
        raise RecipeError(f"{key}: {file}: parquet is read as written, not from a {file.suffix} archive; decompress "
                          "it (parquet compresses its own columns)")


def read_rows(source: DataSource):
    """The split's rows, untokenized (a datasets.Dataset). A source without rows, or one that does not parse
    as its format, is one line naming it."""
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
        raw = datasets.load_dataset(source.format, data_files=[str(f) for f in source.files if f.stat().st_size],
                                    split="train")
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


def _unreadable(source: DataSource, exc: BaseException) -> RecipeError:
    cause = str(exc).strip().splitlines()
    return RecipeError(f"{source.key}: {source.path} cannot be read as {source.format} "
                       f"({cause[-1][:200] if cause else type(exc).__name__}); fix the file or give it the suffix of "
                       "its format")


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


def check_text_column(raw, source: DataSource, column: str, setting: str) -> None:
    """`column` exists and holds text in every row."""
    import datasets

    if column not in raw.column_names:
        raise RecipeError(f"{source.key}: {source.path} has no column {column!r} (it has "
                          f"{', '.join(raw.column_names)}); set {setting} to one of those")
    feature = raw.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in TEXT_DTYPES):
        raise RecipeError(f"{source.key}: {source.path} column {column!r} holds {describe(feature)}, not text; set "
                          f"{setting} to the column with the text")
    if raw.data.column(column).null_count:  # arrow's count: no Python pass over the column
        missing = next(i for i, v in enumerate(raw[column]) if v is None)
        raise RecipeError(f"{source.key}: {source.path} row {missing + 1} has no {column!r}; fill or drop it")


def label_values(raw, source: DataSource, column: str) -> list:
    """The distinct labels of a split (a missing one is a RecipeError)."""
    if column not in raw.column_names:
        raise RecipeError(f"{source.key}: {source.path} has no column {column!r} (it has "
                          f"{', '.join(raw.column_names)}); set data.label_column to one of those")
    values = raw.unique(column)
    if any(v is None for v in values):
        raise RecipeError(f"{source.key}: {source.path} has a row without a {column!r}; fill or drop it")
    return values


def class_names(raw, source: DataSource, column: str) -> list[str] | None:
    """A label column that holds names (`pos`, `neg`): the names in sorted order, whose positions are the class
    ids. None where the labels are class ids already: integers, booleans, whole floats, digit strings."""
    import datasets

    values = label_values(raw, source, column)
    feature = raw.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return None
    dtype = getattr(feature, "dtype", "")
    if dtype.startswith(("int", "uint")) or dtype == "bool" or \
            (dtype.startswith("float") and all(float(v).is_integer() for v in values)):
        return None
    if dtype in TEXT_DTYPES:
        if all(v.strip().isdigit() for v in values):
            return None
        return sorted(values)
    example = next(iter(values), None)
    raise RecipeError(f"{source.key}: {source.path} column {column!r} holds {describe(feature)} (e.g. {example!r}); "
                      "labels must be class ids or names")


def check_labels(raw, source: DataSource, data: DataConfig, *, num_labels: int, names: list[str] | None) -> None:
    """Every label is a class id below model.num_labels, or one of `names` (the training split's)."""
    column = data.label_column
    assert column is not None  # Recipe: required for sequence-classification
    values = label_values(raw, source, column)
    if names is not None:
        unknown = sorted(str(v) for v in values if str(v) not in names)
        if unknown:
            raise RecipeError(f"{source.key}: {source.path} has label {unknown[0]!r} in column {column!r}, which "
                              f"data.train does not have (its labels: {', '.join(names)}); fix the data")
        return
    ids = sorted(int(v) for v in values)
    bad = [v for v in ids if not 0 <= v < num_labels]
    if bad:
        raise RecipeError(f"{source.key}: {source.path} has label {bad[0]!r} in column {column!r}, outside "
                          f"0..{num_labels - 1} (model.num_labels: {num_labels}); fix the data or set "
                          "model.num_labels")


def describe(feature) -> str:
    dtype = getattr(feature, "dtype", None)
    if dtype in TEXT_DTYPES:
        return "text"
    return f"{dtype} values" if dtype else type(feature).__name__
