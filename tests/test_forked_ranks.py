"""The tests' forked toolkit processes (tests/forked_ranks.py): what the server forks and what it execs, and
its messages."""

import socket

import forked_ranks


def test_two_messages_read_in_one_go_are_two_messages():
    # a fast process ends before its client reads the pid: both replies then come in one recv
    ours, theirs = socket.socketpair()
    forked_ranks._send(theirs, {"pid": 12})
    forked_ranks._send(theirs, {"status": 512})
    theirs.close()
    messages = forked_ranks._Messages(ours)
    assert [messages.next(), messages.next(), messages.next()] == [{"pid": 12}, {"status": 512}, None]


def test_an_environment_differing_in_what_libraries_read_at_import_is_execd(monkeypatch):
    monkeypatch.setattr(forked_ranks, "_SERVER_ENV", {"PATH": "/bin", "HF_HUB_OFFLINE": "1"})
    monkeypatch.setattr(forked_ranks, "_DEFAULTS", {"HF_HUB_OFFLINE": "1"})  # the toolkit's default, added
    assert forked_ranks._differences({"PATH": "/bin"}) == []  # the rank adds the same default
    assert forked_ranks._differences({"PATH": "/bin", "RANK": "1", "TORCHELASTIC_RUN_ID": "x",
                                      "OMP_NUM_THREADS": "1", "TOOLKIT_FAULT": "y"}) == []  # read when used
    assert forked_ranks._differences({"PATH": "/bin", "HF_HUB_OFFLINE": "0"}) == ["HF_HUB_OFFLINE"]
    assert forked_ranks._differences({"PATH": "/bin", "MALLOC_ARENA_MAX": "2"}) == ["MALLOC_ARENA_MAX"]
    assert forked_ranks._differences({}) == ["PATH"]
