"""`RankPools`: the ranks of one ring size kept up between a test module's calls (hypothesis examples)."""

from __future__ import annotations

from ringpass.cli.launch import RankPool


class RankPools:
    """One `RankPool` at a time (the ranks of one ring size), started when a call needs it."""

    def __init__(self):
        self.pool = None

    def run(self, world_size: int, fn, args=(), *, timeout: float = 600.0) -> list:
        """``fn(rank, world_size, *args)`` on ``world_size`` ranks; their return values by rank."""
        if self.pool is None or self.pool.procs is None or self.pool.world_size != world_size:  # none, closed, other
            self.close()
            self.pool = RankPool(world_size)
        return self.pool.run(fn, args, timeout=timeout)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
