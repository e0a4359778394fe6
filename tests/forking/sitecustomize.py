"""Imported as every Python process starts whose PYTHONPATH holds this folder (the tests' forked toolkit
processes, and what they start: conftest's forked_env). A `python [-u] -m toolkit ARGS` started with
forked_ranks.FORKED_RANKS_ENV set becomes that server's client here, before it imports anything: its fork of
the server is the toolkit process, and this one waits for it as forked_ranks' client does. So the ranks that a
forked `toolkit launch` or `toolkit compare` starts, and a benchmark's `toolkit` runs, are forked too (each
plain rank spent ~3 s importing torch, transformers and the toolkit). Refused (an environment a fork cannot
give) or without a server, the process goes on as the plain command it is. Any other command, or other
interpreter options (`-X importtime`), is left alone."""

import os
import sys


def _toolkit_args() -> list[str] | None:
    """ARGS of `python [-u] -m toolkit ARGS`, or None for any other command line."""
    argv = list(getattr(sys, "orig_argv", []))[1:]
    while argv[:1] == ["-u"]:
        argv.pop(0)
    return argv[2:] if argv[:2] == ["-m", "toolkit"] else None


if os.environ.get("TOOLKIT_TEST_RANK_SERVER") and (_args := _toolkit_args()) is not None:
    _tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _tests)
    try:
        import forked_ranks

        forked_ranks.client(_args, started=True)  # returns only where the process is not forked
    finally:
        sys.path.remove(_tests)
        sys.modules.pop("forked_ranks", None)
