"""What each rank runs in tests/distributed/test_bench.py (a module of its own so spawned ranks can import it)."""

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
    from ringpass.cli.bench.measure import PeakMemory

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


def methods_in_turns_or_one_after_another(rank: int, world_size: int) -> dict:
    """`measure_methods` on three methods, three measured calls each, without and with ``interleave``: per
    setting, the methods in the order their measured calls started, and the largest error against fp32 SDPA."""
    import dataclasses

    from ringpass.cli.bench import BenchConfig
    from ringpass.cli.bench.attention import make_inputs, measure_methods
    from ringpass.cli.bench.measure import Progress
    from ringpass.hardware import default_hardware

    device, methods = torch.device("cpu"), ("ring-zigzag", "all-gather", "ulysses")
    result = {}
    for interleave in (False, True):
        config = BenchConfig(seq_lens=(64,), methods=methods, repeats=3, interleave=interleave, progress=False)
        config = dataclasses.replace(config, hardware=default_hardware())
        inputs = make_inputs(config, 64, device)
        measured = measure_methods(methods, inputs, config, rank, world_size, device, Progress(0))
        calls = sorted((s["started_s"], m) for m, r in measured.items() for s in r["samples"])
        errors = [s["error"] for r in measured.values() for s in r["samples"]]
        result[interleave] = {"order": [m for _, m in calls], "error": max(errors)}
    return result
