"""Sliding windows and mask programs in the ring: exact against dense-masked fp64 attention, evaluated
tile by tile (so mask memory does not grow with the sequence), empty tiles skipped."""

import pytest
import torch
from reference import masked_attention_fp64, rel_err
from ring_checks import check_simulated_ring, qkv_fp64

import lowering.masks
from lowering import InvalidInputError, Layout, record_ring_events, simulate_ring
from lowering.kernels import block_attention, block_attention_backward


def packed_documents(q_pos, kv_pos, document):
    """Packed sequences: a key is visible from queries of its own document at or after it."""
    return ((document[q_pos][:, None] == document[kv_pos][None, :]) & (kv_pos[None, :] <= q_pos[:, None]))[None, None]


def left_padding(q_pos, kv_pos, keep):
    """A [B, S] padding mask on the keys (HF's attention_mask), with causality."""
    return keep[:, kv_pos][:, None, None, :] & (kv_pos[None, :] <= q_pos[:, None])[None, None]


def _cases(seq_len):
    pos = torch.arange(seq_len)
    document = torch.repeat_interleave(torch.arange(4), torch.tensor([5, seq_len - 20, 3, 12]))
    keep = torch.ones(2, seq_len, dtype=torch.bool)
    keep[0, :7] = False  # left padding: the first 7 queries of sequence 0 see no key at all
    causal = pos[None, :] <= pos[:, None]
    return {
        "packed": (dict(mask=packed_documents, mask_inputs=[document]), packed_documents(pos, pos, document)),
        "left-padded": (dict(mask=left_padding, mask_inputs=[keep]), left_padding(pos, pos, keep)),
        "window": (dict(window=6), causal & (pos[:, None] - pos[None, :] < 6)),
        "window+packed": (
            dict(window=9, mask=packed_documents, mask_inputs=[document]),
            packed_documents(pos, pos, document) & (pos[:, None] - pos[None, :] < 9),
        ),
    }


@pytest.mark.parametrize("case", ["packed", "left-padded", "window", "window+packed"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_masked_ring_matches_dense_masked_fp64(monkeypatch, case, kind, world_size):
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 8)  # many tiles per block: full, empty and partial ones
    options, visible = _cases(45)[case]
    check_simulated_ring(Layout(kind, world_size, 45), visible, options)


def hidden_heads(q_pos, kv_pos, keep, heads):
    """Left padding, and on the heads marked in ``heads`` the first 11 queries see no key at all."""
    return left_padding(q_pos, kv_pos, keep) & ~(heads[None, :, None, None] & (q_pos < 11)[None, None, :, None])


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("fully_masked", ["uniform", "uniform_values"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fully_masked_rows_give_what_eager_attention_gives(monkeypatch, softcap, fully_masked, kind, world_size):
    """Queries whose keys are all hidden (left padding; some heads only) average every key as eager attention
    with a finfo.min mask does, and their gradients are eager's: into q and k through the uniform softmax
    when the mask is added, into v only when it replaces the scores."""
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 8)
    pos = torch.arange(43)
    keep = torch.ones(2, 43, dtype=torch.bool)
    keep[0, :7] = False
    heads = torch.tensor([False, True, True, False])
    options = dict(mask=hidden_heads, mask_inputs=[keep, heads], fully_masked=fully_masked, softcap=softcap)
    reference = dict(fully_masked=fully_masked, softcap=softcap)
    check_simulated_ring(Layout(kind, world_size, 43), hidden_heads(pos, pos, keep, heads), options, reference)


def test_mask_memory_is_bounded_by_the_tile_not_the_sequence(monkeypatch):
    """The largest mask tensor the ring evaluates is one strip of tiles, at any sequence length (not S x S,
    not S/P x S)."""
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 16)
    monkeypatch.setattr(lowering.masks, "MASK_STRIP", 2)
    largest = {}
    for seq_len in (512, 2048):
        q, k, v = qkv_fp64(seq_len, heads=(2, 1))
        document = torch.arange(seq_len) // 300
        with record_ring_events() as events:
            simulate_ring(
                q,
                k,
                v,
                layout=Layout("zigzag", 2, seq_len),
                is_causal=True,
                mask=packed_documents,
                mask_inputs=[document],
            )
        tiles = [e.fields["numel"] for e in events if e.kind == "mask_tile"]
        largest[seq_len] = max(tiles)
    assert largest[512] == largest[2048] == 16 * 2 * 16


def test_tiles_that_the_mask_empties_are_never_computed(monkeypatch):
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 16)
    seq_len = 64
    q, k, v = qkv_fp64(seq_len, heads=(2, 2), batch=1)
    document = torch.arange(seq_len) // 16  # four documents: most of the causal triangle is masked
    with record_ring_events() as events:
        simulate_ring(
            q,
            k,
            v,
            layout=Layout("contiguous", 2, seq_len),
            is_causal=True,
            mask=packed_documents,
            mask_inputs=[document],
        )
    calls = [e for e in events if e.kind == "block_forward"]
    assert len(calls) == 4  # the four documents' diagonal tiles; every other tile is empty and skipped
    assert all(e.fields["causal"] and not e.fields["masked"] for e in calls)  # each one exactly causal: fused path


def _calls(monkeypatch, **options):
    """Kernel calls and mask evaluations of one simulated causal zigzag ring (P=2, N=128, tiles of 8)."""
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 8)
    q, k, v = qkv_fp64(128, heads=(2, 1), batch=1)
    with record_ring_events() as events:
        simulate_ring(q, k, v, layout=Layout("zigzag", 2, 128), is_causal=True, **options)
    return [e for e in events if e.kind == "block_forward"], [e for e in events if e.kind == "mask_tile"]


def test_a_window_or_program_that_hides_nothing_keeps_each_task_whole(monkeypatch):
    """No per-tile work where nothing is hidden: a window as long as the sequence and a program that
    shows everything give the plain causal ring's kernel calls, the window without evaluating any mask."""
    plain, _ = _calls(monkeypatch)
    window, evaluated = _calls(monkeypatch, window=128)
    assert len(window) == len(plain) and not evaluated and not any(e.fields["masked"] for e in window)
    one_document, evaluated = _calls(
        monkeypatch, mask=packed_documents, mask_inputs=[torch.zeros(128, dtype=torch.long)]
    )
    assert len(one_document) == len(plain) and not any(e.fields["masked"] for e in one_document)
    assert evaluated and max(e.fields["numel"] for e in evaluated) <= 8 * 8 * lowering.masks.MASK_STRIP


def test_a_window_runs_its_fully_visible_tiles_as_one_call_per_row(monkeypatch):
    """A window of 40 over tiles of 8: each row of tiles is at most one merged rectangle, one causal
    diagonal tile and the partial tiles at the window's edge (two here) — never one call per tile."""
    calls, _ = _calls(monkeypatch, window=40)
    rows = 2 * 128 // 2 // 8  # two ranks' query tiles: forward calls per row of tiles, both steps together
    assert len(calls) <= rows * 4
    assert sum(e.fields["masked"] for e in calls) <= rows * 2


def test_an_additive_mask_carrying_a_bias_applies_both():
    """An additive mask program's values: at or below -1e4 hide the key, anything else adds to the score."""
    seq_len = 20
    q, k, v = qkv_fp64(seq_len)
    pos = torch.arange(seq_len)

    def alibi_and_causal(q_pos, kv_pos):
        distance = (kv_pos[None, :] - q_pos[:, None]).double()
        return torch.where(distance <= 0, 0.3 * distance, float("-inf"))[None, None]

    expected = masked_attention_fp64(
        q, k, v, (pos[None, :] <= pos[:, None])[None, None], bias=0.3 * (pos[None, :] - pos[:, None]).double()
    )
    for kind in ("contiguous", "zigzag"):
        sim = simulate_ring(q, k, v, layout=Layout(kind, 2, seq_len), mask=alibi_and_causal)
        assert rel_err(sim.out, expected) < 1e-12


def test_a_window_needs_causal():
    q, k, v = qkv_fp64(16)
    with pytest.raises(InvalidInputError, match="needs is_causal=True"):
        simulate_ring(q, k, v, layout=Layout("contiguous", 2, 16), window=4)


def test_block_kernel_with_a_mask_and_a_window_on_scattered_positions():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    q_pos, kv_pos = torch.tensor([3, 4, 5, 20, 21, 22]), torch.tensor([0, 1, 2, 3, 4, 17, 18, 19, 20])
    mask = torch.rand(2, 1, 6, 9) > 0.3
    visible = mask & (kv_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - kv_pos[None, :] < 4)
    expected = masked_attention_fp64(q, k, v, visible)
    out, lse = block_attention(q, k, v, q_pos, kv_pos, is_causal=True, window=4, mask=mask)
    assert rel_err(out, expected) < 1e-12
    dout = torch.randn_like(expected)
    expected.backward(dout)
    grads = block_attention_backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, q_pos, kv_pos, is_causal=True, window=4, mask=mask
    )
    for got, leaf in zip(grads, (q, k, v)):
        assert rel_err(got, leaf.grad) < 1e-12


def test_two_mask_functions_never_share_an_id():
    first, second = (
        (lambda q, k: (k[None, :] <= q[:, None])[None, None]),
        (lambda q, k: (k[None, :] >= q[:, None])[None, None]),
    )
    assert lowering.masks.register_mask(first) != lowering.masks.register_mask(second)
    assert lowering.masks.mask_program(lowering.masks.register_mask(second)) is second
