"""The torch block kernels (fused CPU path and math path) against fp64 math with explicit positions."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import SCORE_CASES, check_case
from reference import lse_fp64, rel_err

from lowering.kernels import block_attention, block_attention_backward, torch_attention


def _math_reference(q, k, v, q_pos, kv_pos, scale, is_causal):
    """fp64 attention over visible keys; rows with none give 0 (autograd-friendly)."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if is_causal:
        scores = scores.masked_fill(kv_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).nan_to_num(0.0)
    return weights @ v, lse


CASES = {
    # name: (q positions, kv positions, causal)
    "full": (torch.arange(10, 20), torch.arange(0, 12), False),
    "aligned-causal (fused)": (torch.arange(5, 17), torch.arange(5, 17), True),
    "zigzag-causal (fused)": (torch.cat([torch.arange(0, 4), torch.arange(12, 16)]),) * 2 + (True,),
    "offset-causal (math)": (torch.arange(8, 16), torch.arange(4, 14), True),
    "rows without keys (math)": (torch.arange(0, 8), torch.arange(4, 14), True),
}


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_forward_and_backward_fp64(case, heads):
    q_pos, kv_pos, causal = CASES[case]
    hq, hkv = heads
    torch.manual_seed(0)
    q = torch.randn(2, hq, len(q_pos), 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, len(kv_pos), 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, len(kv_pos), 16, dtype=torch.float64, requires_grad=True)
    scale = 0.3
    ref_out, ref_lse = _math_reference(q, k, v, q_pos, kv_pos, scale, causal)
    dout, dlse = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    no_keys = torch.isneginf(ref_lse)

    out, lse = block_attention(q.detach(), k.detach(), v.detach(), q_pos, kv_pos, scale=scale, is_causal=causal)
    assert rel_err(out, ref_out) < 1e-12
    assert torch.equal(torch.isneginf(lse), no_keys) and rel_err(lse[~no_keys], ref_lse[~no_keys]) < 1e-12
    assert torch.all(out[no_keys.unsqueeze(-1).expand_as(out)] == 0)

    for with_dlse in (False, True):
        q.grad = k.grad = v.grad = None
        loss = (ref_out * dout).sum() + (ref_lse.masked_fill(no_keys, 0) * dlse).sum() * with_dlse
        loss.backward(retain_graph=True)
        grads = block_attention_backward(
            dout,
            q.detach(),
            k.detach(),
            v.detach(),
            out,
            lse,
            q_pos,
            kv_pos,
            scale=scale,
            is_causal=causal,
            dlse=dlse.masked_fill(no_keys, 0) if with_dlse else None,
        )
        for got, want in zip(grads, (q.grad, k.grad, v.grad)):
            assert got.shape == want.shape and not got.isnan().any()
            assert rel_err(got, want) < 1e-11


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_block_results_stay_in_fp32_for_low_precision_inputs(dtype, tol):
    torch.manual_seed(0)
    pos = torch.arange(32)
    q, k, v = (torch.randn(1, 4, 32, 16) for _ in range(3))
    out, lse = block_attention(q.to(dtype), k.to(dtype), v.to(dtype), pos, pos, scale=0.25, is_causal=True)
    assert out.dtype == lse.dtype == torch.float32  # unrounded partial results for the ring's merge
    assert rel_err(out, _math_reference(q, k, v, pos, pos, 0.25, True)[0]) < tol
    assert rel_err(lse, lse_fp64(q, k, is_causal=True, scale=0.25)) < tol
    grads = block_attention_backward(
        torch.ones_like(out).to(dtype),
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        out.to(dtype),
        lse,
        pos,
        pos,
        scale=0.25,
        is_causal=True,
    )
    assert all(g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize(
    "case,fused",
    [
        ("full", True),
        ("aligned-causal (fused)", True),
        ("zigzag-causal (fused)", True),
        ("offset-causal (math)", False),
        ("rows without keys (math)", False),
    ],
)
def test_fused_cpu_kernel_is_used_where_it_applies(case, fused, monkeypatch):
    calls = []
    real = torch_attention._fused
    monkeypatch.setattr(torch_attention, "_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    q_pos, kv_pos, causal = CASES[case]
    q, k = torch.randn(1, 2, len(q_pos), 8), torch.randn(1, 2, len(kv_pos), 8)
    block_attention(q, k, k, q_pos, kv_pos, scale=0.3, is_causal=causal)
    assert len(calls) == int(fused)


@pytest.mark.parametrize("case", SCORE_CASES)
def test_score_modifiers_match_fp64(case):
    """Soft-capping, ALiBi slopes and a dense bias in the torch kernels (fp64: forward, LSE, gradients)."""
    check_case(case, torch.float64, backend="torch")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(2, 90),
    leaf=st.integers(1, 24),
    below=st.integers(2, 100),
    heads=st.sampled_from([(4, 4), (4, 2), (2, 1)]),
    offset=st.booleans(),
)
def test_a_causal_square_split_into_halves_on_the_fused_kernel_is_exact(monkeypatch, n, leaf, below, heads, offset):
    """The fused CPU kernel runs a causal square of ``2 * CAUSAL_LEAF`` to ``CAUSAL_SPLIT_BELOW`` rows as its halves
    (split again) and the rectangle between them: drawn sizes, leaves (down to single rows) and bounds, MHA / GQA /
    MQA, positions from 0 or zigzag-like (two runs): out, lse and the gradients against fp64 math, split only there."""
    monkeypatch.setattr(torch_attention, "CAUSAL_LEAF", leaf)
    monkeypatch.setattr(torch_attention, "CAUSAL_SPLIT_BELOW", below)
    calls = []
    real = torch_attention._fused
    monkeypatch.setattr(torch_attention, "_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    pos = torch.cat([torch.arange(n // 2), torch.arange(n // 2, n) + 3 * n]) if offset else torch.arange(n)
    torch.manual_seed(n)
    hq, hkv = heads
    q = torch.randn(1, hq, n, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ref_out, ref_lse = _math_reference(q, k, v, pos, pos, 0.3, True)
    out, lse = block_attention(q.detach(), k.detach(), v.detach(), pos, pos, scale=0.3, is_causal=True)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    assert (len(calls) > 1) == (2 * leaf <= n < below), calls
    dout = torch.randn_like(ref_out)
    (ref_out * dout).sum().backward()
    detached = (t.detach() for t in (q, k, v))
    grads = block_attention_backward(dout, *detached, out, lse, pos, pos, scale=0.3, is_causal=True)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert rel_err(got, want) < 1e-11
