"""Progress lines for the one long silent step before a run's first line: rank 0 tokenizing a large split (300,000
short reviews took 30 s on one core here; documents for packing, minutes). A split tokenized within FIRST_S says
nothing; a longer one says how far it is every EVERY_S, and how long it took. A cached split is not tokenized
again and says nothing."""

from __future__ import annotations

import sys
import time

FIRST_S = 5.0  # the first line after this long
EVERY_S = 15.0  # then one every this long


class Progress:
    def __init__(self, key: str, *, total: int) -> None:
        self.key, self.total = key, total
        self.done = 0
        self.start: float | None = None
        self.said: float | None = None  # when the last line was printed

    def advance(self, rows: int) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = now
        self.done += rows
        since, wait = (now - self.said, EVERY_S) if self.said is not None else (now - self.start, FIRST_S)
        if since < wait:
            return
        self.said = now
        elapsed = now - self.start
        left = elapsed * (self.total - self.done) / self.done if self.done else 0.0
        share = 100 * self.done / self.total if self.total else 100.0
        self._say(f"tokenizing {self.done:,} of {self.total:,} rows ({share:.0f} %, {elapsed:.0f} s; about "
                  f"{left:.0f} s left; cached for later runs)")

    def finish(self) -> None:
        """The closing line, where a line was said (a long tokenizing)."""
        if self.said is not None and self.start is not None:
            self._say(f"tokenizing done: {self.done:,} rows in {time.monotonic() - self.start:.0f} s")

    def _say(self, text: str) -> None:
        print(f"[toolkit] {self.key}: {text}", file=sys.stderr, flush=True)
