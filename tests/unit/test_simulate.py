"""The single-process simulation of a P-rank ring against unsharded fp64 attention."""

import pytest
import torch
import torch.nn.functional as F
from reference import attention_fp64, rel_err

from lowering import Layout, record_ring_events, simulate_ring


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "world_size,seq_len,heads,head_dim",
    [
        (1, 9, (4, 4), 8),
        (2, 64, (8, 2), 16),
        (3, 1000, (5, 5), 8),
        (4, 999, (8, 1), 96),
        (8, 70, (4, 2), 16),
    ],
)
def test_simulated_ring_matches_unsharded_fp64(kind, is_causal, world_size, seq_len, heads, head_dim):
    torch.manual_seed(0)
    hq, hkv = heads
    q = torch.randn(1, hq, seq_len, head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, seq_len, head_dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, seq_len, head_dim, dtype=torch.float64, requires_grad=True)
    out, lse = attention_fp64(q, k, v, is_causal=is_causal)
    dout = torch.randn_like(out)
    out.backward(dout)

    layout = Layout(kind, world_size, seq_len)
    sim = simulate_ring(q.detach(), k.detach(), v.detach(), layout=layout, is_causal=is_causal, dout=dout)
    assert rel_err(sim.out, out) < 1e-10 and rel_err(sim.lse, lse) < 1e-10
    for got, want in ((sim.dq, q.grad), (sim.dk, k.grad), (sim.dv, v.grad)):
        assert rel_err(got, want) < 1e-10


def test_simulation_never_calls_the_kernel_on_a_masked_block():
    layout = Layout("contiguous", 4, 64)
    q = torch.randn(1, 2, 64, 8)
    with record_ring_events() as events:
        simulate_ring(q, q, q, layout=layout, is_causal=True)
    calls = [e for e in events if e.kind == "block_forward"]
    # contiguous + causal: rank r computes its diagonal and the r blocks before it
    assert len(calls) == 1 + 2 + 3 + 4
    for call in calls:
        q_pos, kv_pos = call.fields["q_pos"], call.fields["kv_pos"]
        assert (kv_pos[None, :] <= q_pos[:, None]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_simulated_half_precision_error_is_within_twice_the_unsharded_error(dtype, world_size):
    torch.manual_seed(world_size)
    q, k, v = (torch.randn(1, 4, 384, 64, dtype=torch.float64, requires_grad=True) for _ in range(3))
    reference, _ = attention_fp64(q, k, v, is_causal=True)
    dout = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, (q, k, v), dout)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    unsharded = F.scaled_dot_product_attention(*low, is_causal=True)
    unsharded_grads = torch.autograd.grad(unsharded, low, dout.to(dtype))
    sim = simulate_ring(
        *(t.detach() for t in low), layout=Layout("zigzag", world_size, 384), is_causal=True, dout=dout.to(dtype)
    )
    assert sim.out.dtype == dtype and sim.lse.dtype == torch.float32
    assert rel_err(sim.out, reference) <= 2 * rel_err(unsharded, reference)
    for got, base, want in zip((sim.dq, sim.dk, sim.dv), unsharded_grads, expected):
        assert rel_err(got, want) <= 2 * rel_err(base, want)


def test_simulated_ring_honours_a_given_scale():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 8, dtype=torch.float64) for _ in range(3))
    sim = simulate_ring(q, k, v, layout=Layout("zigzag", 3, 50), is_causal=True, scale=0.7)
    out, lse = attention_fp64(q, k, v, is_causal=True, scale=0.7)
    assert rel_err(sim.out, out) < 1e-12 and rel_err(sim.lse, lse) < 1e-12
