"""A console that outlives its reader: `toolkit train R | head -4`, a closed SSH session or a terminal gone under
nohup end the reader, not the run. The first write that finds the reader gone points the stream's file
descriptor at /dev/null, so every later write (the toolkit's lines, a library's, C code's on the same descriptor)
goes nowhere, and training, metrics.jsonl, run.json and checkpoints go on; the exit code is the run's own."""

from __future__ import annotations

import os
import sys
from typing import TextIO


class LastingStream:
    """`stream` (sys.stdout or sys.stderr), whose writes and flushes survive its reader leaving."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        """The descriptor now writes into /dev/null: what the stream still buffers drains there too."""
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):  # no descriptor (a test's StringIO): nothing to point elsewhere
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def outlive_reader() -> None:
    """sys.stdout and sys.stderr as LastingStreams (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, LastingStream):
            setattr(sys, name, LastingStream(stream))
