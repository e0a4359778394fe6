"""What `toolkit compare` and `toolkit report` print at their end: the verdict table, its long texts as wrapped
lines, and the recommendation; every line at most CONSOLE_WIDTH characters (the full table is in report.md)."""

from __future__ import annotations

import textwrap

from toolkit.compare.predictions import step_lines
from toolkit.compare.recommend import recommendations
from toolkit.compare.report_render import below_verdicts, verdict_rows
from toolkit.compare.verdict import BY_DESIGN

CONSOLE_WIDTH = 120
SEPARATOR = "  "
MIN_ARM_WIDTH = 12


def _middle(text: str, width: int) -> str:
    """text cut to width with … in its middle: arms named alike keep both their start and their end apart."""
    if len(text) <= width:
        return text
    keep = width - 1
    return text[:(keep + 1) // 2] + "…" + text[len(text) - keep // 2:]


def fitted_table(head: list[str], rows: list[list[str]], *, width: int = CONSOLE_WIDTH) -> list[str]:
    """Columns padded to their widest cell; where that is wider than `width`, the first column (arm names, the
    one a user chooses freely) is cut in its middle to fit."""
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]
    others = sum(widths[1:]) + len(SEPARATOR) * (len(widths) - 1)
    widths[0] = min(widths[0], max(MIN_ARM_WIDTH, width - others))
    line = lambda cells: SEPARATOR.join(_middle(c, w).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(head), line(["-" * w for w in widths]), *[line(r) for r in rows]]


def wrapped(text: str, *, bullet: str = "", width: int = CONSOLE_WIDTH) -> list[str]:
    """One text as lines of at most `width`, continuations indented (a path longer than a line is cut)."""
    return textwrap.wrap(text, width=width, initial_indent=bullet, subsequent_indent=" " * max(len(bullet), 2),
                         break_on_hyphens=False) or [bullet.rstrip()]


def summary_lines(results: dict) -> list[str]:
    """The verdict table, below it each failure, fallback and note, then the recommendation (markdown's bold
    left out)."""
    head, rows = verdict_rows(results)
    column, levers = head.index("verdict"), []
    for row in rows:  # a lever's name and settings, long as they are, go below the table: the arm names stay whole
        if row[column].startswith(f"{BY_DESIGN} ("):
            levers.append(f"{row[0]} {row[column]}")
            row[column] = BY_DESIGN
    lines = fitted_table(head, rows)
    for text in [*levers, *below_verdicts(results)]:
        lines += wrapped(text)
    lines.append("recommendation:")
    for text in recommendations(results):
        lines += wrapped(text.replace("**", ""), bullet="- ")
    steps = step_lines(results)
    if steps:
        lines += wrapped(f"step time, measured and as toolkit plan predicts it on {results.get('hardware_profile')}:")
        for text in steps:
            lines += wrapped(text, bullet="- ")
    return lines
