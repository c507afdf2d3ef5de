"""Score modifiers in the ring (soft-capping, ALiBi slopes, bias programs): exact against fp64 attention with
the modifiers applied to the dense score matrix, on every layout and world size, bias memory bounded by
the tile."""

import pytest
import torch
from reference import masked_attention_fp64, rel_err
from ring_checks import check_simulated_ring, qkv_fp64

import lowering.masks
from lowering import InvalidInputError, Layout, record_ring_events, ring_attention, simulate_ring

SLOPES = [2.0 ** -(h + 1) for h in range(4)]


def document_bias(q_pos, kv_pos, document):
    """A bias program reading a per-token input: a penalty for keys of another document, per head."""
    other = (document[q_pos][:, None] != document[kv_pos][None, :]).double()
    return -torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)[:, None, None] * other


def packed_documents(q_pos, kv_pos, document):
    return ((document[q_pos][:, None] == document[kv_pos][None, :]) & (kv_pos[None, :] <= q_pos[:, None]))[None, None]


def _cases(seq_len):
    pos = torch.arange(seq_len)
    causal = (pos[None, :] <= pos[:, None])[None, None]
    document = torch.repeat_interleave(torch.arange(3), torch.tensor([11, seq_len - 20, 9]))
    alibi = torch.tensor(SLOPES, dtype=torch.float64)[:, None, None] * (pos[None, :] - pos[:, None]).double()
    return {
        "softcap": (dict(softcap=0.6), dict(softcap=0.6), causal),
        "alibi": (dict(alibi_slopes=SLOPES), dict(bias=alibi), causal),
        "bias-program": (
            dict(bias=document_bias, bias_inputs=[document]),
            dict(bias=document_bias(pos, pos, document)),
            causal,
        ),
        "all+mask-program": (
            dict(
                softcap=1.2,
                alibi_slopes=SLOPES,
                bias=document_bias,
                bias_inputs=[document],
                mask=packed_documents,
                mask_inputs=[document],
            ),
            dict(softcap=1.2, bias=alibi + document_bias(pos, pos, document)),
            packed_documents(pos, pos, document),
        ),
    }


@pytest.mark.parametrize("case", ["softcap", "alibi", "bias-program", "all+mask-program"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_score_modifiers_in_the_ring_match_fp64(monkeypatch, case, kind, world_size):
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 8)  # many tiles per block
    options, reference, visible = _cases(41)[case]
    check_simulated_ring(Layout(kind, world_size, 41), visible, options, reference)


def bucket_bias(q_pos, kv_pos, table):
    """A T5-style bias program: a learned table of relative-position buckets per head."""
    return table[(kv_pos[None, :] - q_pos[:, None]).clamp(-4, 3) + 4].permute(2, 0, 1)[None]


def sliced_bias(q_pos, kv_pos, whole):
    """A materialised S x S bias read at the tile's positions, as lifted programs read it (index_select)."""
    return whole.index_select(2, q_pos).index_select(3, kv_pos)


def padded_mask(q_pos, kv_pos, keep, whole):
    """An additive mask with a trainable bias in it: ``finfo.min`` on hidden keys plus a materialised bias,
    as Hugging Face's eager attention adds them (left padding: fully hidden queries average every key)."""
    hidden = ~(keep.index_select(1, kv_pos)[:, None, None, :] & (kv_pos[None, :] <= q_pos[:, None]))
    return sliced_bias(q_pos, kv_pos, whole) + hidden.double() * torch.finfo(torch.float64).min


@pytest.mark.parametrize("case", ["bucket-table", "materialised-bias", "bias-in-the-mask"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_trainable_program_inputs_get_the_gradient_of_fp64_attention(monkeypatch, case, kind, world_size):
    """The ring's per-tile pull-back of the scores' gradient through a program gives its inputs (a bucket
    table, a materialised bias read by tiles, a bias inside an additive padding mask whose fully hidden rows
    average every key) the gradient autograd gives them through dense fp64 attention, summed over ranks."""
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 8)  # many tiles per block
    n = 41
    q, k, v = qkv_fp64(n)
    pos = torch.arange(n)
    table = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    whole = torch.randn(1, 4, n, n, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[0, :6] = False  # left padding: queries 0-5 of row 0 see no key
    causal = (pos[None, :] <= pos[:, None])[None, None]
    options, bias, visible, trained = {
        "bucket-table": (
            dict(bias=bucket_bias, bias_inputs=[table]),
            lambda: bucket_bias(pos, pos, table),
            causal,
            [table],
        ),
        "materialised-bias": (dict(bias=sliced_bias, bias_inputs=[whole]), lambda: whole, causal, [whole]),
        "bias-in-the-mask": (
            dict(
                mask=padded_mask,
                mask_inputs=[keep, whole],
                bias=bucket_bias,
                bias_inputs=[table],
                fully_masked="uniform",
            ),
            lambda: bucket_bias(pos, pos, table) + padded_mask(pos, pos, keep, whole),
            None,
            [whole, table],
        ),
    }[case]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].repeat_interleave(2, 1).mT * 8**-0.5 + bias()
    expected = torch.softmax(scores if visible is None else scores.masked_fill(~visible, float("-inf")), -1) @ leaves[
        2
    ].repeat_interleave(2, 1)
    dout = torch.randn_like(expected)
    want = torch.autograd.grad(expected, [*leaves, *trained], dout)
    sim = simulate_ring(
        q, k, v, layout=Layout(kind, world_size, n), is_causal=visible is not None, dout=dout, **options
    )
    assert rel_err(sim.out, expected) < 1e-12
    assert len(sim.program_grads) == len(trained)
    for got, expected_grad in zip([sim.dq, sim.dk, sim.dv, *sim.program_grads], want):
        assert rel_err(got, expected_grad) < 1e-12


def test_bias_memory_is_bounded_by_the_tile_not_the_sequence():
    largest = {}
    for seq_len in (512, 1536):
        q, k, v = qkv_fp64(seq_len, heads=(4, 1), batch=1)
        document = torch.arange(seq_len) // 300
        with record_ring_events() as events:
            simulate_ring(
                q, k, v, layout=Layout("zigzag", 2, seq_len), is_causal=True, bias=document_bias, bias_inputs=[document]
            )
        largest[seq_len] = max(e.fields["numel"] for e in events if e.kind == "bias_tile")
    assert largest[512] == largest[1536] == 4 * lowering.masks.MASK_TILE**2  # one tile per head


def test_public_entry_point_with_slopes_and_softcap_and_lse():
    q, k, v = (t.requires_grad_() for t in qkv_fp64(12))
    pos = torch.arange(12)
    out, lse = ring_attention(
        q, k, v, layout=Layout("zigzag", 1, 12), is_causal=True, softcap=2.0, alibi_slopes=SLOPES, return_lse=True
    )
    alibi = torch.tensor(SLOPES, dtype=torch.float64)[:, None, None] * (pos[None, :] - pos[:, None]).double()
    visible = (pos[None, :] <= pos[:, None])[None, None]
    expected = masked_attention_fp64(q, k, v, visible, softcap=2.0, bias=alibi)
    assert rel_err(out, expected) < 1e-12
    scores = 2.0 * torch.tanh(q @ k.repeat_interleave(2, 1).mT * 8**-0.5 / 2.0) + alibi
    assert rel_err(lse, torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)) < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(expected.sum(), (q, k, v))
    assert all(rel_err(g, w) < 1e-11 for g, w in zip(grads, want))


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(softcap=0.0), "softcap=0.0"),
        (dict(softcap=float("inf")), "positive finite"),
        (dict(alibi_slopes=[0.5, 0.25]), "one per query head"),
        (dict(alibi_slopes=[float("nan")] * 4), "finite numbers"),
        (dict(bias=lambda q_pos, kv_pos: q_pos[:, None] > kv_pos[None, :]), "float tensor"),
        (dict(bias=lambda q_pos, kv_pos: torch.zeros(3, 1, 1, 1)), "must broadcast"),
    ],
)
def test_bad_score_options_are_refused(options, message):
    q, k, v = qkv_fp64(8)
    with pytest.raises(InvalidInputError, match=message):
        ring_attention(q, k, v, layout=Layout("contiguous", 1, 8), **options)
