"""Lists of compare arms and plan layouts as the command line gives them: `single,ddp,fsdp@optim.lr=2e-4`, split at
the commas and @ outside an override's YAML value ([...], {...}, quotes), each arm once. Shared by `toolkit compare`,
`toolkit plan --strategies` and `toolkit plan --layouts`."""

from __future__ import annotations

from toolkit.errors import RecipeError

CLOSING = {"[": "]", "{": "}"}


def split_outside(text: str, sep: str, *, where: str) -> list[str]:
    """`text` split at each `sep` that is outside [...], {...} and quotes, so that an override's YAML value keeps
    its own commas and @: `fsdp@strategy.blocks=[A,B],ddp` is two arms. An unclosed one is a RecipeError."""
    parts, start, closers, quote = [], 0, [], ""
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"" and (i == 0 or text[i - 1] in "=[{,: "):  # a quote opens a YAML value, as in YAML
            quote = char
        elif char in CLOSING:
            closers.append(CLOSING[char])
        elif closers and char == closers[-1]:
            closers.pop()
        elif char == sep and not closers:
            parts.append(text[start:i])
            start = i + 1
    if quote or closers:
        unclosed = quote or next(opening for opening, closing in CLOSING.items() if closing == closers[-1])
        raise RecipeError(f"{where}: {unclosed!r} is not closed; close it, e.g. fsdp@strategy.blocks=[A,B] "
                          "(commas inside [...], {...} or quotes stay in the arm's override)")
    return [*parts, text[start:]]


def arm_parts(spec: str, *, what: str = "arm") -> list[str]:
    """`fsdp@optim.lr=2e-4@seed=1` -> [its name, its overrides]; an override without `=` is a RecipeError naming
    the arm (not a --set the user never gave)."""
    name, *extra = split_outside(spec, "@", where=f"{what} {spec!r}")
    bad = next((e for e in extra if "=" not in e), None)
    if bad is not None:
        raise RecipeError(f"{what} {spec!r}: {bad!r} after @ is no override; write {name}@key.path=value, e.g. "
                          f"{name}@optim.lr=1e-4 (a value holding @ goes in quotes)")
    return [name, *extra]


def split_arms(text: str, *, option: str = "--strategies") -> list[str]:
    """`single,ddp,fsdp@optim.lr=2e-4` -> its arms, in order; an empty or a repeated arm is a RecipeError."""
    arms = [a.strip() for a in split_outside(text, ",", where=f"{option} {text!r}")]
    if not all(arms):
        raise RecipeError(f"{option} {text!r}: an arm name is empty; give comma-separated arms, e.g. {option} "
                          "single,ddp,fsdp (`toolkit strategies` lists them)")
    refuse_repeats(arms, where=option)
    return arms


def refuse_repeats(names: list[str], *, where: str) -> None:
    """Each arm runs once: a repeat would be reported beside itself (the reference judged against itself)."""
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        raise RecipeError(f"{where}: arm {repeated!r} is given twice; list each arm once")
