"""One ring call as the timing examples make it (`mask_cost.py`, `perf_record.py`, `compare_commits.py`): this rank's
shards of q, k, v for zigzag causal attention (B=1, Hq=8, Hkv=2, D=64, fp32, drawn from the rank's seed), and the
seconds of one forward+backward started together with the other ranks. It needs only `lowering.Layout` and
`lowering.ring_attention`, so it runs against any checkout's `lowering` (compare_commits.py)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def ring_inputs(rank: int, world_size: int, seq_len: int):
    """(layout, q, k, v): this rank's shards, requiring gradients."""
    from lowering import Layout

    layout = Layout("zigzag", world_size, seq_len)
    generator = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 8, layout.local_len, 64, generator=generator).requires_grad_()
    k, v = (torch.randn(1, 2, layout.local_len, 64, generator=generator).requires_grad_() for _ in range(2))
    return layout, q, k, v


def timed_call(layout, q, k, v, **options) -> float:
    """Seconds of one causal ``ring_attention(...).sum().backward()`` after a barrier (``options``: the mask's)."""
    from lowering import ring_attention

    q.grad = k.grad = v.grad = None
    dist.barrier()
    start = time.perf_counter()
    ring_attention(q, k, v, layout=layout, is_causal=True, **options).sum().backward()
    return time.perf_counter() - start
