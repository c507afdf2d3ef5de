"""Run a function on P local processes joined by a gloo process group on 127.0.0.1.

    results = spawn_ranks(fn, world_size=2, args=(...,), timeout=120)

Each rank calls ``fn(rank, world_size, *args)`` inside an initialised default process group and its
return value comes back in ``results[rank]``. Nothing hangs: a rank that raises, dies or outlives
``timeout`` seconds stops every rank, and `spawn_ranks` raises `RankFailure` with what went wrong
(the rank's traceback, its exit code, or the timeout). The ranks in ``may_die`` may die without a result
(failure-injection tests kill them); theirs is None. Used by ``ringpass demo``, ``ringpass bench`` and the
test-suite.

    with RankPool(world_size=2) as pool:              # the ranks stay up between calls
        results = pool.run(fn, args, timeout=120)      # as spawn_ranks, without starting processes

`RankPool` serves many short calls (a fuzzer's examples) from one set of ranks; a call that raises, dies or
times out on any rank closes the pool (a rank may be stuck in a collective) and raises `RankFailure`.

The ranks are forked from a server that has imported torch (`_context`): starting them costs a fraction of a
second instead of an import of torch per rank.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowering import compat
from lowering.errors import RingpassError


class RankFailure(RingpassError, RuntimeError):
    """A rank raised, died, or ran past the timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    may_die: Sequence[int] = (),
) -> list[Any]:
    ctx = _context()
    procs, results, all_reported = _start_ranks(ctx, fn, world_size, args, timeout)
    try:
        outputs = _collect(procs, results, world_size, timeout, set(may_die))
        _leave(procs, all_reported)
        return outputs
    finally:
        _stop(procs, results)


class RankPool:
    """``world_size`` ranks in one gloo group that run one call after another (`RankPool.run`) until
    `close` (or the end of a ``with`` block); ``lifetime``: seconds the ranks may live in all."""

    def __init__(self, world_size: int, lifetime: float = 7200.0):
        ctx = _context()
        self.world_size = world_size
        self.inboxes = [ctx.SimpleQueue() for _ in range(world_size)]
        self.outbox = ctx.SimpleQueue()
        self.procs, self.results, self.all_reported = _start_ranks(
            ctx, _serve, world_size, (self.inboxes, self.outbox), lifetime
        )

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), *, timeout: float = 120.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; their return values by rank."""
        if self.procs is None:
            raise RankFailure("this RankPool is closed (a call failed, or close() was called).")
        for inbox in self.inboxes:
            inbox.put((fn, tuple(args)))
        try:
            return _collect(self.procs, self.outbox, self.world_size, timeout, set())
        except BaseException:
            self.close(wait=False)  # a rank may be stuck in a collective of the failed call
            raise

    def close(self, wait: bool = True) -> None:
        """Ends the ranks: ``wait``, they leave as `spawn_ranks`'s do (a few seconds at most), else they are
        killed."""
        if self.procs is None:
            return
        try:
            if wait:
                for inbox in self.inboxes:
                    inbox.put(None)
                _collect(self.procs, self.results, self.world_size, 30.0, set())
                _leave(self.procs, self.all_reported)
        finally:
            _stop(self.procs, self.results)
            self.procs = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(rank: int, world_size: int, inboxes, outbox) -> None:
    """A pool rank: each call's result (as `_rank_main` reports one) until the pool sends None."""
    while (call := inboxes[rank].get()) is not None:
        fn, args = call
        try:
            outbox.put((rank, True, _saved(fn(rank, world_size, *args))))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


def _start_ranks(ctx, fn, world_size: int, args, timeout: float):
    results = ctx.SimpleQueue()
    all_reported = ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, tuple(args), timeout, results, all_reported, dict(os.environ)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, results, all_reported


def _leave(procs, all_reported) -> None:
    all_reported.set()  # the ranks leave together: none takes the store down while another still works
    for proc in procs:
        proc.join(5)


def _stop(procs, results) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    results.close()


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _context():
    """Processes forked from a server that imported torch once (``forkserver``): a rank starts in a fraction of a
    second instead of importing torch again (3-6 s on 2 CPU cores). The server also imports those of ``PRELOAD``
    the caller has imported (the modules rank functions use). A forked rank starts in the server's environment and
    takes the caller's before ``fn`` runs (`_rank_main`), which serves variables read at run time; where one
    that may be read earlier (at process start, as ``MALLOC_MMAP_THRESHOLD_``, or on import) differs from what it
    was when the server started, and where the platform has no forkserver, the ranks are fresh interpreters
    (``spawn``)."""
    global _server_environment
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if _server_environment is None:
        _server_environment = dict(os.environ)
        mp.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed", *(m for m in PRELOAD if m in sys.modules)]
        )
    changed = {k for k in {*os.environ, *_server_environment} if os.environ.get(k) != _server_environment.get(k)}
    read_early = {k for k in changed if k not in READ_AT_RUN_TIME and not k.startswith("RINGPASS_")}
    return mp.get_context("spawn" if read_early else "forkserver")


PRELOAD = ("ringpass", compat.DYNAMO_MODULE, "transformers")
# set while the caller runs (pytest, Inductor, torchrun) and read only when used
READ_AT_RUN_TIME = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "RANK", "LOCAL_RANK", "WORLD_SIZE"}
_server_environment: dict | None = None  # os.environ when the forkserver was started


def _collect(procs, results, world_size: int, timeout: float, may_die: set) -> list[Any]:
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        while not results.empty():
            rank, ok, payload = results.get()
            if not ok:
                raise RankFailure(f"rank {rank} of {world_size} raised:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for rank, proc in enumerate(procs):
            if rank not in outputs and not proc.is_alive() and results.empty():
                if rank in may_die:
                    outputs[rank] = None
                    continue
                raise RankFailure(
                    f"rank {rank} of {world_size} died (exit code {proc.exitcode}) before reporting a result."
                )
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise RankFailure(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s.")
        time.sleep(0.02)
    return [outputs[r] for r in range(world_size)]


def _rank_main(fn, rank, world_size, port, args, timeout, results, all_reported, environment) -> None:
    os.environ.clear()  # the caller's, not the forkserver's (`_context`)
    os.environ.update(environment)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        results.put((rank, True, _saved(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        os._exit(1)
    # Stay until every rank has reported: rank 0 hosts the rendezvous store that ranks still working use
    # (a replica that finishes first must not take it down). Then leave without interpreter teardown:
    # gloo can abort at exit after its work is done.
    all_reported.wait(timeout)
    dist.destroy_process_group()
    os._exit(0)
