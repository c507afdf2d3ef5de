"""`ringpass.launch.spawn_ranks` starts its ranks forked from a server that imported torch (fast), in the caller's
environment, and as fresh interpreters where a variable read at process start differs from the server's."""

import os

from ringpass.launch import spawn_ranks


def _started(rank: int, world_size: int) -> tuple:
    return os.getppid(), os.environ.get("RINGPASS_PROBE"), os.environ.get("MALLOC_MMAP_THRESHOLD_")


def test_ranks_are_forked_in_the_callers_environment_or_spawned_when_it_must_be_read_at_start(monkeypatch):
    spawn_ranks(_started, 2, timeout=60)  # the server runs from here on (the suite's first call started it)
    monkeypatch.setenv("RINGPASS_PROBE", "set after the server started")  # read at run time
    for parent, probe, _ in spawn_ranks(_started, 2, timeout=60):
        assert parent != os.getpid(), "the ranks were not forked from the server"
        assert probe == "set after the server started"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # read by malloc when a process starts
    for parent, probe, threshold in spawn_ranks(_started, 2, timeout=60):
        assert parent == os.getpid() and threshold == "131072" and probe == "set after the server started"
