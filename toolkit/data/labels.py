"""Class labels of a sequence-classification split: ids or names, names mapped to ids, every label checked."""

from __future__ import annotations

from toolkit.config.recipe import DataConfig
from toolkit.data.files import TEXT_DTYPES, DataSource, check_filled, columns, describe, first_row, shown
from toolkit.errors import RecipeError


def _label_kind(value) -> str:
    if isinstance(value, bool) or isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "class ids"
    return "names" if isinstance(value, str) else "other"


def label_values(raw, source: DataSource, column: str) -> list:
    """The distinct labels of a split (a missing one, or labels of several kinds, is a RecipeError naming the
    row)."""
    import datasets

    _check_column(raw, source, column)
    check_filled(raw, source, column)
    if not isinstance(raw.features[column], datasets.Json):
        return raw.unique(column)
    # JSON values of several types (ids in some rows, names in others): arrow has no kernel to list them
    kinds = [_label_kind(v) for v in raw[column]]
    if len(set(kinds)) == 1 and kinds[0] != "other":  # ids of several types (1, true): one kind all the same
        return list(dict.fromkeys(raw[column]))
    odd = "other" if "other" in kinds else min(("class ids", "names"), key=kinds.count)
    number = kinds.index(odd) + 1
    value = raw[number - 1][column]
    if odd == "other":
        raise RecipeError(f"{source.key}: {source.path} row {number} has label {shown(value)} in column "
                          f"{column!r}; labels must be class ids or names")
    usual = "names" if odd == "class ids" else "class ids"
    raise RecipeError(f"{source.key}: {source.path} row {number} has label {shown(value)} in column {column!r} where "
                      f"other rows have {usual}; use one kind")


def _check_column(raw, source: DataSource, column: str) -> None:
    """The split has the label column, and it holds one value a row (a list or a mapping in every row is no label:
    arrow cannot list its distinct values)."""
    import datasets

    if column not in raw.column_names:
        raise RecipeError(f"{source.key}: {source.path} has no column {column!r} (it has {columns(raw)}); set "
                          "data.label_column to one of those")
    feature = raw.features[column]
    if not isinstance(feature, (datasets.Value, datasets.ClassLabel, datasets.Json)):
        raise RecipeError(f"{source.key}: {source.path} column {column!r} holds {describe(feature)} (row 1: "
                          f"{shown(raw[0][column])}); labels must be class ids or names, one a row")


def class_names(raw, source: DataSource, column: str) -> list[str] | None:
    """A label column that holds names (`pos`, `neg`): the names in sorted order, whose positions are the class
    ids; a `datasets` ClassLabel column: its names, in its id order. None where the labels are class ids already:
    integers, booleans, whole floats, digit strings."""
    import datasets

    values = label_values(raw, source, column)
    feature = raw.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    if isinstance(feature, datasets.Json):  # one kind (label_values): ids of several types, or names
        return sorted(values) if all(isinstance(v, str) for v in values) else None
    if is_id_column(feature):
        return None
    dtype = feature.dtype
    if dtype.startswith("float"):
        if all(float(v).is_integer() for v in values):
            return None
        number, value = first_row(raw, column, lambda v: not float(v).is_integer())
        raise RecipeError(f"{source.key}: {source.path} row {number} has label {value!r} in column {column!r}; "
                          "labels must be class ids (whole numbers) or names")
    if dtype in TEXT_DTYPES:
        if all(v.strip().isdigit() for v in values):
            return None
        return sorted(values)
    raise RecipeError(f"{source.key}: {source.path} column {column!r} holds {describe(feature)} (row 1: "
                      f"{shown(raw[0][column])}); labels must be class ids or names")


def is_id_column(feature) -> bool:
    """A column of integers or booleans: class ids, whatever data.train's labels are."""
    import datasets

    dtype = feature.dtype if isinstance(feature, datasets.Value) else ""
    return dtype.startswith(("int", "uint")) or dtype == "bool"


def label_ids(values, feature, names: list[str] | None) -> list[int]:
    """Class ids of labels: a name's position in `names` (data.train's class names; a ClassLabel's id stands for
    its name), else the id as written."""
    if names is None or is_id_column(feature):
        return [int(v) for v in values]
    return [names.index(name) for name in _as_names(values, feature)]


def _as_names(values, feature) -> list[str]:
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return [feature.int2str(int(v)) for v in values]
    return [str(v) for v in values]


def check_labels(raw, source: DataSource, data: DataConfig, *, num_labels: int, names: list[str] | None) -> None:
    """Every label is a class id below model.num_labels, or one of `names` (the training split's)."""
    column = data.label_column
    assert column is not None  # Recipe: required for sequence-classification
    values = label_values(raw, source, column)
    feature = raw.features[column]
    if names is not None and not is_id_column(feature):
        unknown = sorted(v for v in _as_names(values, feature) if v not in names)
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


def in_model_order(names: list[str] | None, model_names: list[str] | None) -> list[str] | None:
    """data.train's class names in model.path's id order where its id2label names exactly these labels (as
    transformers' run_glue keeps them): its pretrained head's row for `pos` goes on meaning `pos`."""
    if names is None or model_names is None or sorted(model_names) != sorted(names):
        return names
    return list(model_names)


def label_note(names: list[str] | None, model_names: list[str] | None) -> str | None:
    """One line where data.train's names replace model.path's id2label, which names other labels: its head's
    rows are trained (and exported) as data.train's classes (as transformers' run_glue does, which warns too)."""
    if names is None or model_names is None or names == model_names:
        return None
    return (f"[toolkit] model.path's id2label ({', '.join(model_names[:8])}) names other labels than data.train "
            f"({', '.join(names[:8])}): its mapping is replaced by data.train's")


def check_label_kind(raw, source: DataSource, *, column: str, named: bool) -> None:
    """data.eval's labels are of data.train's kind: names where it has names, class ids where it has ids (a
    ClassLabel column is both: its ids stand for its names)."""
    import datasets

    _check_column(raw, source, column)
    if isinstance(raw.features[column], datasets.ClassLabel):
        return
    eval_named = class_names(raw, source, column) is not None
    if eval_named != named:
        kind, other = ("class ids", "label names") if named else ("label names", "class ids")
        raise RecipeError(f"{source.key}: {source.path} has {kind} in column {column!r} where data.train has "
                          f"{other}; use one kind in both")
