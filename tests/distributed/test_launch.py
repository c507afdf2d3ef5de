"""`ringpass.cli.launch.spawn_ranks` starts its ranks forked from a server that imported torch (fast), in the caller's
environment, and as fresh interpreters where a variable read at process start differs from the server's;
`RankPool` keeps its ranks up between calls and closes at the first failure, never hanging."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ringpass.cli.launch import RankFailure, RankPool, spawn_ranks


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


def _summed(rank: int, world_size: int, x: int) -> tuple:
    value = torch.tensor([rank + x])
    dist.all_reduce(value)
    return value.item(), os.getpid()


def _rank_1_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that will never come
    return 0


@pytest.mark.timeout(60)
def test_a_rank_pool_runs_calls_on_the_same_ranks_and_closes_at_a_failure():
    with RankPool(2) as pool:
        first = pool.run(_summed, (1,), timeout=30)
        second = pool.run(_summed, (5,), timeout=30)
        assert [v for v, _ in first] == [3, 3] and [v for v, _ in second] == [11, 11]
        assert [pid for _, pid in first] == [pid for _, pid in second], "the calls ran in new processes"
        started = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1 of 2 raised:(.|\n)*rank 1 refuses"):
            pool.run(_rank_1_raises, timeout=30)
        assert time.monotonic() - started < 10, "a failed call must not wait for the rank stuck in a collective"
        with pytest.raises(RankFailure, match="closed"):
            pool.run(_summed, (1,))
