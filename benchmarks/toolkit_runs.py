"""What the benchmarks share: one real `toolkit launch` run of a recipe with overrides."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def launch(recipe: str, *, nproc: int, sets: list[str], label: str) -> None:
    """`toolkit launch --nproc N RECIPE --set ...` from the repository root; its stderr's tail on failure."""
    cmd = [sys.executable, "-m", "toolkit", "launch", "--nproc", str(nproc), recipe]
    for item in sets:
        cmd += ["--set", item]
    print(f"[benchmark] {label} ...", file=sys.stderr, flush=True)
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{label} failed:\n{result.stderr[-3000:]}")


def print_table(head: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, columns padded (what docs/benchmarks.md shows)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
