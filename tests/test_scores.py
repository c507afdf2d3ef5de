"""Score modifiers in the ring (soft-capping, ALiBi slopes, bias programs): exact against fp64 attention with
the modifiers applied to the dense score matrix, on every layout and world size, bias memory bounded by
the tile."""

import pytest
import torch

import lowering.masks
from lowering import InvalidInputError, Layout, record_ring_events, ring_attention, simulate_ring
from reference import masked_attention_fp64, rel_err
from ring_checks import check_simulated_ring, qkv_fp64

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
        "bias-program": (dict(bias=document_bias, bias_inputs=[document]),
                         dict(bias=document_bias(pos, pos, document)), causal),
        "all+mask-program": (dict(softcap=1.2, alibi_slopes=SLOPES, bias=document_bias, bias_inputs=[document],
                                  mask=packed_documents, mask_inputs=[document]),
                             dict(softcap=1.2, bias=alibi + document_bias(pos, pos, document)),
                             packed_documents(pos, pos, document)),
    }


@pytest.mark.parametrize("case", ["softcap", "alibi", "bias-program", "all+mask-program"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_score_modifiers_in_the_ring_match_fp64(monkeypatch, case, kind, world_size):
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 8)  # many tiles per block
    options, reference, visible = _cases(41)[case]
    check_simulated_ring(Layout(kind, world_size, 41), visible, options, reference)


def test_bias_memory_is_bounded_by_the_tile_not_the_sequence():
    largest = {}
    for seq_len in (512, 1536):
        q, k, v = qkv_fp64(seq_len, heads=(4, 1), batch=1)
        document = torch.arange(seq_len) // 300
        with record_ring_events() as events:
            simulate_ring(q, k, v, layout=Layout("zigzag", 2, seq_len), is_causal=True, bias=document_bias,
                          bias_inputs=[document])
        largest[seq_len] = max(e.fields["numel"] for e in events if e.kind == "bias_tile")
    assert largest[512] == largest[1536] == 4 * lowering.masks.MASK_TILE ** 2  # one tile per head


def test_public_entry_point_with_slopes_and_softcap_and_lse():
    q, k, v = (t.requires_grad_() for t in qkv_fp64(12))
    pos = torch.arange(12)
    out, lse = ring_attention(q, k, v, layout=Layout("zigzag", 1, 12), is_causal=True, softcap=2.0,
                              alibi_slopes=SLOPES, return_lse=True)
    alibi = torch.tensor(SLOPES, dtype=torch.float64)[:, None, None] * (pos[None, :] - pos[:, None]).double()
    visible = (pos[None, :] <= pos[:, None])[None, None]
    expected = masked_attention_fp64(q, k, v, visible, softcap=2.0, bias=alibi)
    assert rel_err(out, expected) < 1e-12
    scores = 2.0 * torch.tanh(q @ k.repeat_interleave(2, 1).mT * 8 ** -0.5 / 2.0) + alibi
    assert rel_err(lse, torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)) < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(expected.sum(), (q, k, v))
    assert all(rel_err(g, w) < 1e-11 for g, w in zip(grads, want))


@pytest.mark.parametrize("options,message", [
    (dict(softcap=0.0), "softcap=0.0"),
    (dict(softcap=float("inf")), "positive finite"),
    (dict(alibi_slopes=[0.5, 0.25]), "one per query head"),
    (dict(alibi_slopes=[float("nan")] * 4), "finite numbers"),
    (dict(bias=lambda q_pos, kv_pos: (q_pos[:, None] > kv_pos[None, :])), "float tensor"),
    (dict(bias=lambda q_pos, kv_pos: torch.zeros(3, 1, 1, 1)), "must broadcast"),
])
def test_bad_score_options_are_refused(options, message):
    q, k, v = qkv_fp64(8)
    with pytest.raises(InvalidInputError, match=message):
        ring_attention(q, k, v, layout=Layout("contiguous", 1, 8), **options)
