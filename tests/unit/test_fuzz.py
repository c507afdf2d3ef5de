"""Fuzzing the ring against fp64 attention: random batch, query/KV head ratios, head dims, lengths (N < P,
N = 1, N not divisible by 2P), P from 1 to 4, layouts, causal / sliding window / mask programs (key
padding, packed documents) with every fully-masked convention, soft-capping, fp64 and fp32; forward,
LSE and every gradient, through the simulated ring (the ring's per-rank code, blocks moved in-process).

The default suite runs a fixed set of examples (``derandomize``); ``./dev test -m heavy tests/unit/test_fuzz.py``
runs many more random ones, and ``RINGPASS_FUZZ_EXAMPLES=N`` sets how many (hypothesis prints the
failing example and how to reproduce it). Random model architectures through the ring on gloo ranks:
tests/distributed/test_random_architectures.py.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import masked_attention_fp64, masked_lse_fp64, rel_err

from lowering import Layout, simulate_ring

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


@st.composite
def ring_cases(draw):
    world_size = draw(st.integers(1, 4))
    seq_len = draw(st.one_of(st.integers(1, 2 * world_size + 1), st.integers(1, 40)))
    kv_heads = draw(st.integers(1, 3))
    mask = draw(
        st.sampled_from(["none", "causal", "window", "padding", "documents", "causal+padding", "causal+documents"])
    )
    return dict(
        world_size=world_size,
        seq_len=seq_len,
        kv_heads=kv_heads,
        groups=draw(st.integers(1, 3)),
        batch=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([1, 4, 8, 16])),
        layout=draw(st.sampled_from(["contiguous", "zigzag"])),
        mask=mask,
        window=draw(st.integers(1, seq_len)) if mask == "window" else None,
        fully_masked=draw(st.sampled_from(["zero", "uniform", "uniform_values"]))
        if "+" in mask or mask in ("padding", "documents")
        else "zero",
        softcap=draw(st.sampled_from([None, None, 2.0])),
        scale=draw(st.sampled_from([None, 0.3, 1.5])),
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        seed=draw(st.integers(0, 2**16)),
    )


def check_ring_case(case: dict) -> None:
    """The simulated ring's out, finite LSE and dq, dk, dv equal dense fp64 attention's under the same mask."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, n, hkv, d = case["batch"], case["seq_len"], case["kv_heads"], case["head_dim"]
    hq = hkv * case["groups"]
    q = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(n)
    causal = "causal" in case["mask"] or case["mask"] == "window"
    visible = torch.ones(b, 1, n, n, dtype=torch.bool)
    if causal:
        visible &= pos[None, :] <= pos[:, None]
    if case["window"] is not None:
        visible &= pos[:, None] - pos[None, :] < case["window"]
    options = dict(
        is_causal=causal,
        window=case["window"],
        softcap=case["softcap"],
        scale=case["scale"],
        fully_masked=case["fully_masked"],
    )
    if "padding" in case["mask"]:  # some keys of each row hidden, sometimes all of them
        keep = torch.rand(b, n, generator=gen) < 0.6
        visible &= keep[:, None, None, :]
        options.update(mask=lambda q_pos, kv_pos, keep: keep[:, None, None, kv_pos], mask_inputs=[keep])
    if "documents" in case["mask"]:
        doc = torch.randint(0, 3, (b, n), generator=gen).sort(dim=1).values
        visible &= (doc[:, :, None] == doc[:, None, :])[:, None]
        options.update(
            mask=lambda q_pos, kv_pos, doc: doc[:, None, q_pos, None] == doc[:, None, None, kv_pos], mask_inputs=[doc]
        )

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked_attention_fp64(
        *leaves, visible, case["scale"], softcap=case["softcap"], fully_masked=case["fully_masked"]
    )
    dout = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected.backward(dout)
    expected_lse = masked_lse_fp64(q, k, visible, case["scale"], softcap=case["softcap"])

    dtype = case["dtype"]
    layout = Layout(case["layout"], case["world_size"], n)
    sim = simulate_ring(*(t.to(dtype) for t in (q, k, v)), layout=layout, dout=dout.to(dtype), **options)
    bound = TOLERANCE[dtype]
    assert rel_err(sim.out, expected) < bound, ("out", rel_err(sim.out, expected))
    finite = expected_lse.isfinite()
    assert torch.equal(sim.lse.isfinite(), finite), "rows with no visible key must have lse -inf"
    if finite.any():
        assert rel_err(sim.lse[finite], expected_lse[finite]) < bound, "lse"
    scale = max(leaf.grad.abs().max().item() for leaf in leaves)
    for name, got, leaf in zip(("dq", "dk", "dv"), (sim.dq, sim.dk, sim.dv), leaves):
        # a gradient that is 0 in exact arithmetic (one key: dq and dk) comes out as the rounding noise of
        # dP - delta (two equal sums, computed apart): measured against 10% of the largest gradient; every
        # other one against itself (or 1% of the largest, for a small one)
        exact_zero = leaf.grad.abs().max().item() <= 1e-12 * scale
        reference = max(1e-1 * scale if exact_zero else max(leaf.grad.abs().max().item(), 1e-2 * scale), 1e-300)
        error = ((got.double() - leaf.grad).abs().max() / reference).item()
        assert not got.isnan().any() and error < bound * 10, (name, error)


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ring_cases())
def test_fuzzed_ring_matches_fp64_attention(case):
    check_ring_case(case)


@pytest.mark.heavy
@settings(
    max_examples=int(os.environ.get("RINGPASS_FUZZ_EXAMPLES", "1000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ring_cases())
def test_fuzzed_ring_matches_fp64_attention_long(case):
    check_ring_case(case)
