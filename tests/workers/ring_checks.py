"""A check shared by the mask and score-modifier tests: the simulated ring against dense fp64 attention."""

from __future__ import annotations

import torch
from reference import masked_attention_fp64, rel_err

from lowering import Layout, simulate_ring


def qkv_fp64(seq_len, heads=(4, 2), batch=2):
    torch.manual_seed(0)
    q = torch.randn(batch, heads[0], seq_len, 8, dtype=torch.float64)
    k, v = (torch.randn(batch, heads[1], seq_len, 8, dtype=torch.float64) for _ in range(2))
    return q, k, v


def check_simulated_ring(layout: Layout, visible, options: dict, reference: dict | None = None) -> None:
    """Out and every gradient of the simulated causal ring with ``options`` equal, to 1e-12, fp64 attention
    under the dense ``visible`` mask with the ``reference`` score modifiers (soft-cap, dense bias)."""
    q, k, v = qkv_fp64(layout.seq_len)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked_attention_fp64(*leaves, visible, **(reference or {}))
    dout = torch.randn_like(expected)
    expected.backward(dout)
    sim = simulate_ring(q, k, v, layout=layout, is_causal=True, dout=dout, **options)
    assert rel_err(sim.out, expected) < 1e-12
    for got, leaf in zip((sim.dq, sim.dk, sim.dv), leaves):
        assert rel_err(got, leaf.grad) < 1e-12
