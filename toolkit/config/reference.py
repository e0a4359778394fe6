"""The reference of every recipe key (docs/recipe-keys.md), made from the sections' own declarations
(toolkit/config/recipe.py; the strategy section in toolkit/config/strategy_options.py): each
field's key, type, default and the comments written beside it, so that it cannot go stale
(tests/test_recipe_reference.py compares the file with what this makes).

    python -m toolkit.config.reference > docs/recipe-keys.md
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
import typing

from toolkit.config import recipe as recipe_module
from toolkit.config.typed import recipe_key

GROUP_LABEL = re.compile(r"\w+(, \w+)*")


def field_comments(cls: type) -> dict[str, str]:
    """Per field of `cls`: the comment lines just above its declaration, the one at its end and the indented
    comment lines that continue it (`#   ...`), joined."""
    source = inspect.getsource(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> its comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    out: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0]
        if name not in names or stripped.startswith("#") or line[:4] != "    " or line[4] == " ":
            continue
        above: list[str] = []
        k = number - 1
        # the comment block above it, up to the previous field's continuation lines; a group label ("# tp, fsdp")
        # names the strategies its fields' own comments name again
        while k >= 1 and lines[k - 1].strip().startswith("#") and not lines[k - 1].strip().startswith("#  "):
            if not GROUP_LABEL.fullmatch(comments.get(k, "")):
                above.insert(0, comments.get(k, ""))
            k -= 1
        beside = [comments[number]] if number in comments else []
        after: list[str] = []
        k = number + 1
        while k <= len(lines) and lines[k - 1].strip().startswith("#  "):
            after.append(comments.get(k, "").strip())
            k += 1
        out[name] = " ".join(part for part in [*above, *beside, *after] if part)
    return out


def _type_name(hint) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None").replace("<class '", "").replace("'>", "")
    return text.replace("toolkit.config.recipe.", "").replace("toolkit.config.strategy_options.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, what it trades) for every field of `cls`, a section's fields after its own row."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{recipe_key(f)}"
        hint = hints[f.name]
        nested = [a for a in typing.get_args(hint) or (hint,) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if nested and prefix == "":  # a section: its keys follow, each with its own row
            out.append((key, "section", "", comments.get(f.name, "")))
            out += rows(nested[0], f"{key}.")
            continue
        if nested:  # a nested mapping inside a section (model.lora)
            out.append((key, "mapping or null", _default(f), comments.get(f.name, "")))
            out += rows(nested[0], f"{key}.")
            continue
        out.append((key, _type_name(hint), _default(f), comments.get(f.name, "")))
    return out


def render() -> str:
    lines = ["# Recipe keys", "",
             "Every key a recipe takes, with its type, default and what it trades: made from the declarations in",
             "`toolkit/config/recipe.py` (the strategy section: `toolkit/config/strategy_options.py`) by",
             "`python -m toolkit.config.reference > docs/recipe-keys.md` (a test fails when",
             "this file and the declarations differ). Give a key in the YAML file or as `--set key=value`.", "",
             "| key | type | default | what it is, what it trades |", "|---|---|---|---|"]
    for key, kind, default, text in rows(recipe_module.Recipe):
        cells = [f"`{key}`", kind.replace("|", "or"), default.replace("|", "or"), text.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
