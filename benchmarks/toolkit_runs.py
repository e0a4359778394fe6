"""What the benchmarks share: one real `toolkit launch` run of a recipe with overrides, or one `toolkit compare`."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
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


def compare(recipe: str, *, arms: str, nproc: int, steps: int, sets: list[str], output: str | None) -> dict:
    """`toolkit compare RECIPE --strategies ARMS ...` from the repository root: its results.json (an arm that
    failed is a row that says so; the compare failing as a whole stops the benchmark)."""
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
        out = Path(output) if output else Path(tmp) / "exp"
        cmd = [sys.executable, "-m", "toolkit", "compare", recipe, "--strategies", arms, "--nproc", str(nproc),
               "--steps", str(steps), "--output", str(out), *[a for s in sets for a in ("--set", s)]]
        print(f"[benchmark] {' '.join(cmd[1:])} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode not in (0, 1) or not (out / "results.json").is_file():  # 1: an arm failed (its row says)
            raise SystemExit(f"toolkit compare failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return json.loads((out / "results.json").read_text())


def print_table(head: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, columns padded (what docs/benchmarks.md shows)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
