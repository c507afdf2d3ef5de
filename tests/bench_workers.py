"""What each rank runs in tests/test_bench.py (a module of its own so spawned ranks can import it)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from reference import rel_err

from lowering import Layout, record_ring_events, ring_attention


def gathered_matches_fp64_sdpa(rank: int, world_size: int, kind: str, causal: bool) -> dict:
    """``ring_attention(strategy="all-gather")`` on this rank's shard against fp64 SDPA on the whole sequence, with
    gradients; and the collectives it reported (its gathers and reduce-scatter) and the ring exchanges (none)."""
    generator = torch.Generator().manual_seed(3)
    n = 48 if kind == "contiguous" else 4 * world_size * 6
    q, dout = (torch.randn(1, 4, n, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, n, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    layout = Layout(kind, world_size, n)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    reference.backward(dout)
    local = [layout.shard(t.detach(), 2, rank).float().requires_grad_() for t in (q, k, v)]
    with record_ring_events() as events:
        out = ring_attention(*local, layout=layout, is_causal=causal, strategy="all-gather")
        out.backward(layout.shard(dout, 2, rank).float())
    errors = {"out": rel_err(out.double(), layout.shard(reference.detach(), 2, rank))}
    for name, mine, full in zip("qkv", local, leaves):
        errors["d" + name] = rel_err(mine.grad.double(), layout.shard(full.grad, 2, rank))
    waits = [e.fields["message"] for e in events if e.kind == "span" and e.fields["part"] == "wait"]
    return {"errors": errors, "waits": waits, "exchanges": sum(e.kind == "exchange" for e in events)}


def peak_of_a_freed_allocation(rank: int, world_size: int) -> dict:
    """`PeakMemory` around a call that allocates and frees 64 MiB, after a call that freed 128 MiB."""
    from ringpass.bench.measure import PeakMemory

    memory = PeakMemory(torch.device("cpu"))
    big = torch.ones(32 * 2**20)  # 128 MiB, freed before the measured call
    del big
    memory.start()
    during = torch.ones(16 * 2**20)  # 64 MiB
    del during
    peak = memory.peak()
    memory.start()
    small = torch.ones(2**18)  # 1 MiB
    return {
        "peak": peak,
        "small": memory.peak(),
        "unavailable": memory.unavailable,
        "kept": small.numel(),
        "threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
