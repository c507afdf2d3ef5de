"""The Triton block kernels in Triton's CPU interpreter (small sizes): forward, backward (the score
gradients included) and the merging variant against fp64 math attention and against the torch
implementation (cases and tolerances in `kernel_cases`). The interpreter computes half-precision dots in
fp32, so fp16 / bf16 differ from fp32 here only in the casts: three cases run in them by default, every case with
``-m heavy``; the GPU check runs every case compiled (examples/gpu_check.py).
"""

import os

import pytest
import torch

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, and again when they run
triton_attention = pytest.importorskip("lowering.kernels.triton_attention")
if _previous is None:  # other tests' processes keep their own setting; each test here sets it again
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _previous

from kernel_cases import CASES, DTYPES, TOLERANCE, case_inputs, check_case, inputs, visible  # noqa: E402
from reference import masked_attention_fp64, masked_lse_fp64, rel_err  # noqa: E402

from lowering.kernels import block_attention, block_attention_backward, block_attention_merge_  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


HALF_PRECISION_CASES = ("causal-zigzag", "causal-offset-MQA", "dense-mask")  # the others' fp16 / bf16: -m heavy


@pytest.mark.parametrize(
    "case,dtype",
    [
        pytest.param(
            case,
            dtype,
            id=f"{case}-{name}",
            marks=[] if dtype == torch.float32 or case in HALF_PRECISION_CASES else [pytest.mark.heavy],
        )
        for case in CASES
        for name, dtype in DTYPES.items()
    ],
)
def test_forward_and_backward_match_fp64_and_the_torch_kernels(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize(
    "case,dtype,with_dlse",
    [
        pytest.param(case, DTYPES[name], with_dlse, id=f"{case}-{name}" + "-dlse" * with_dlse)
        for case, name, with_dlse in (
            ("full-GQA", "fp32", False),
            ("causal-zigzag", "fp32", True),
            ("window", "fp32", False),
            ("dense-mask", "fp32", True),
            ("padding-bound", "fp32", False),
            ("padding-bound", "bf16", True),
            ("rows-without-keys", "fp32", True),
            ("bias+softcap+mask", "fp32", True),
            ("alibi-causal-zigzag", "fp32", False),
        )
    ],
)
def test_score_gradients_are_the_gradients_of_a_bias(case, dtype, with_dlse):
    """``score_grads=True`` adds ds, the gradient with respect to the modified scores: an fp64 bias's
    autograd gradient (a gradient into the LSE included), exactly 0 on hidden pairs."""
    q, k, v, q_pos, kv_pos, options, seen, scores = case_inputs(case, dtype)
    options = dict(scale=q.size(-1) ** -0.5, is_causal=False) | options
    bias = torch.zeros(*q.shape[:3], k.size(2), dtype=torch.float64)
    bias = (bias if scores["bias"] is None else bias + scores["bias"].double()).requires_grad_()
    expected_out = masked_attention_fp64(q, k, v, seen, softcap=scores["softcap"], bias=bias)
    expected_lse = masked_lse_fp64(q, k, seen, softcap=scores["softcap"], bias=bias)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(expected_out.shape, generator=g).to(dtype)
    loss = (expected_out * dout.double()).sum()
    dlse = torch.randn(expected_lse.shape, generator=g) if with_dlse else None
    if with_dlse:  # rows without keys take no part (their lse is -inf)
        loss = loss + (expected_lse.masked_fill(torch.isneginf(expected_lse), 0.0) * dlse.double()).sum()
    loss.backward()
    out, lse = expected_out.detach().float(), expected_lse.detach().float()  # the final (merged) ones
    *_, ds = triton_attention.backward(dout, q, k, v, out, lse, q_pos, kv_pos, **options, dlse=dlse, score_grads=True)
    assert ds.dtype == torch.float32 and ds.shape == bias.shape and ds.is_contiguous()
    assert rel_err(ds, bias.grad) <= 2 * TOLERANCE[dtype], (case, dtype, rel_err(ds, bias.grad))
    assert bool((ds[~seen.expand_as(ds)] == 0).all())


def test_storing_score_gradients_leaves_the_others_unchanged():
    """Without ``score_grads`` the backward returns (dq, dk, dv); with it, the same three exactly."""
    q, k, v = inputs(16, 20, (2, 1), 16, torch.float32)
    pos = torch.arange(20)
    bias = torch.randn(1, 2, 16, 20, generator=torch.Generator().manual_seed(1))
    options = dict(scale=0.25, is_causal=True, softcap=0.7, bias=bias)
    out, lse = triton_attention.forward(q, k, v, pos[4:], pos, **options)
    grads = triton_attention.backward(torch.ones_like(out), q, k, v, out, lse, pos[4:], pos, **options)
    *with_ds, _ = triton_attention.backward(
        torch.ones_like(out), q, k, v, out, lse, pos[4:], pos, **options, score_grads=True
    )
    assert len(grads) == 3 and all(torch.equal(a, b) for a, b in zip(grads, with_ds))


def test_merging_variant_folds_blocks_into_accumulators():
    q, k, v = inputs(20, 40, (4, 2), 16, torch.float32)
    q_pos, kv_pos = torch.arange(20, 40), torch.arange(40)
    out, lse = torch.zeros(2, 4, 20, 16), torch.full((2, 4, 20), float("-inf"))
    for part in (slice(24, 40), slice(0, 24)):  # the later keys first: some rows see nothing at first
        block_attention_merge_(
            q, k[:, :, part], v[:, :, part], q_pos, kv_pos[part], out, lse, is_causal=True, backend="triton"
        )
    causal = visible(q_pos, kv_pos, is_causal=True)
    assert rel_err(out, masked_attention_fp64(q, k, v, causal)) <= 1e-5
    assert rel_err(lse, masked_lse_fp64(q, k, causal)) <= 1e-5


def test_invisible_tiles_are_never_loaded():
    """Keys in tiles that the positions make invisible hold NaN: any load or math on them would show."""
    n, tile = 16, 16  # the interpreter's tile size
    q, k, v = inputs(n, 3 * tile, (2, 2), 16, torch.float32)
    q_pos = torch.arange(100, 116)
    kv_pos = torch.cat([torch.arange(0, tile), torch.arange(96, 96 + tile), torch.arange(200, 200 + tile)])
    k[:, :, :tile], v[:, :, :tile] = float("nan"), float("nan")  # out of the window
    k[:, :, 2 * tile :], v[:, :, 2 * tile :] = float("nan"), float("nan")  # after every query
    options = dict(is_causal=True, window=50)
    out, lse = block_attention(q, k, v, q_pos, kv_pos, backend="triton", **options)
    kept = slice(tile, 2 * tile)
    seen = visible(q_pos, kv_pos[kept], **options)
    k_kept, v_kept = k[:, :, kept], v[:, :, kept]
    assert rel_err(out, masked_attention_fp64(q, k_kept, v_kept, seen)) <= 1e-5
    assert rel_err(lse, masked_lse_fp64(q, k_kept, seen)) <= 1e-5
    dq, dk, dv = block_attention_backward(
        torch.ones_like(out), q, k, v, out, lse, q_pos, kv_pos, backend="triton", **options
    )
    assert torch.isfinite(dq).all() and torch.isfinite(dk[:, :, kept]).all()


def test_tiles_the_dense_mask_hides_are_never_loaded():
    """The dense mask hides the second key tile entirely (NaN there) and part of the third."""
    n, tile = 16, 16
    q, k, v = inputs(n, 3 * tile, (2, 1), 16, torch.float32)
    mask = torch.ones(2, 1, n, 3 * tile, dtype=torch.bool)
    mask[..., tile : 2 * tile] = False
    mask[..., 2 * tile : 2 * tile + 5] = False
    k[:, :, tile : 2 * tile], v[:, :, tile : 2 * tile] = float("nan"), float("nan")
    pos = torch.arange(3 * tile)
    out, lse = block_attention(q, k, v, pos[:n], pos, mask=mask, backend="triton")
    kept = torch.cat([torch.arange(tile), torch.arange(2 * tile, 3 * tile)])
    assert rel_err(out, masked_attention_fp64(q, k[:, :, kept], v[:, :, kept], mask[..., kept])) <= 1e-5
    dq, dk, dv = block_attention_backward(
        torch.ones_like(out), q, k, v, out, lse, pos[:n], pos, mask=mask, backend="triton"
    )
    assert torch.isfinite(dq).all()


def test_negative_positions_with_a_dense_mask():
    q, k, v = inputs(16, 16, (2, 2), 16, torch.float32)
    mask = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(4)) > 0.5
    pos = torch.arange(-16, 0)
    out, lse = block_attention(q, k, v, pos, pos, mask=mask, backend="triton")
    expected, expected_lse = masked_attention_fp64(q, k, v, mask), masked_lse_fp64(q, k, mask)
    finite = torch.isfinite(expected_lse)
    assert rel_err(out, expected) <= 1e-5 and rel_err(lse[finite], expected_lse[finite]) <= 1e-5


def test_an_fp32_output_gradient_with_half_inputs():
    """The forward returns fp32 out, so callers may hand back an fp32 gradient with bf16 q/k/v."""
    q, k, v = inputs(16, 16, (2, 1), 16, torch.bfloat16)
    pos = torch.arange(16)
    out, lse = block_attention(q, k, v, pos, pos, is_causal=True, backend="triton")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = block_attention_backward(dout, q, k, v, out, lse, pos, pos, is_causal=True, backend="triton")
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    masked_attention_fp64(*leaves, visible(pos, pos, is_causal=True)).backward(dout.double())
    assert all(rel_err(g, leaf.grad) <= 3e-2 for g, leaf in zip(got, leaves))


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(window=2.5), "whole number of keys"),
        (dict(seq_bound=4.5), "must be an int"),
        (dict(mask=torch.zeros(16, 16)), "block masks are bool"),
    ],
)
def test_inputs_the_kernels_cannot_honour_are_refused(bad, message):
    from lowering import InvalidInputError

    q, k, v = inputs(16, 16, (2, 2), 16, torch.float32)
    pos = torch.arange(16)
    with pytest.raises(InvalidInputError, match=message):
        block_attention(q, k, v, pos, pos, is_causal=True, backend="triton", **bad)


def test_query_heads_must_be_a_multiple_of_key_heads():
    from lowering import InvalidInputError

    q, k, v = inputs(16, 16, (6, 4), 16, torch.float32)
    with pytest.raises(InvalidInputError, match="multiple of key heads"):
        block_attention(q, k, v, torch.arange(16), torch.arange(16), backend="triton")
