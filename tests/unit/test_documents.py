"""Packed documents. `lowering.documents.DocumentLayout`: a packed row's documents balanced over the ranks. Drawn
document lengths (long-tailed, uniform, single tokens) and ring sizes: every token on one rank, ``ceil(N / P)`` slots
each, the layout's invariants, shard / unshard, each rank's unmasked pairs counted from the dense mask and balanced
within 5 %; the ring on it (simulated) exact against dense fp64 attention under the documents' mask, forward and every
gradient. The documents mask (``documents=ids``): drawn rows, layouts, ring sizes, causal or not, windows, ids in order
or reused, exact in fp64; one packing planned per document (exactly the visible pairs scored), rows packed differently
decided per tile; wrong ids refused. What `lift_masks` reads as documents from each packing convention."""

from functools import partial
from unittest.mock import patch

import hf_workers
import models
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reference import masked_attention_fp64, rel_err
from ring_checks import qkv_fp64

import lowering
import lowering.masks
import ringpass
from lowering import Layout, simulate_ring
from lowering.documents import DocumentLayout, document_pairs
from lowering.ring import RingSpec
from lowering.schedule import visible_pairs

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same_document(q_pos, kv_pos, document):
    """Causal attention inside each document of a packed row."""
    return ((document[q_pos][:, None] == document[kv_pos][None, :]) & (kv_pos[None, :] <= q_pos[:, None]))[None, None]


@st.composite
def packings(draw, max_tokens: int = 6000) -> tuple[tuple[int, ...], int]:
    """(document lengths, ring size): a long-tailed mix (one long document among short ones), lengths alike, or
    anything (single tokens, primes), in a drawn order."""
    mix = draw(st.sampled_from(["long-tailed", "uniform", "any"]))
    if mix == "long-tailed":
        lengths = [draw(st.integers(500, max_tokens // 2))] + draw(st.lists(st.integers(1, 400), max_size=30))
    elif mix == "uniform":
        lengths = [draw(st.integers(1, 300))] * draw(st.integers(1, 40))
    else:
        lengths = draw(st.lists(st.integers(1, 2000), min_size=1, max_size=12))
    order = draw(st.permutations(range(len(lengths))))
    return tuple(lengths[i] for i in order), draw(st.sampled_from([2, 3, 4, 8]))


@settings(max_examples=200, **SETTINGS)
@given(packing=packings())
@example(packing=((2400, 900, 500, 296), 2))  # the row
@example(packing=((1, 7, 333), 4))
@example(packing=((3,), 4))  # fewer tokens than ranks: a rank holds only padding
def test_every_token_on_one_rank_in_order_with_ceil_n_over_p_slots(packing):
    lengths, p = packing
    layout = DocumentLayout(lengths, p)
    n = sum(lengths)
    assert layout.seq_len == n and layout.local_len == -(-n // p)
    positions = [layout.positions(r) for r in range(p)]
    assert all(len(x) == layout.local_len for x in positions)
    real = [x[: layout.valid_len(r)] for r, x in enumerate(positions)]
    assert sorted(torch.cat(real).tolist()) == list(range(n))  # each token once
    for r, x in enumerate(positions):
        assert torch.all(x[1:] > x[:-1]), x  # local order increases with position
        assert torch.all(x[layout.valid_len(r) :] >= n)  # padding after the real slots
        assert [p_ for s in layout.segments(r) for p_ in range(s.global_start, s.global_stop)] == real[r].tolist()
    x = torch.randn(2, n, 3, dtype=torch.float64)
    assert torch.equal(layout.unshard([layout.shard(x, 1, r) for r in range(p)], 1), x)
    assert DocumentLayout(list(lengths), p).positions(0).tolist() == positions[0].tolist()  # a list of lengths too


@settings(max_examples=200, **SETTINGS)
@given(packing=packings())
@example(packing=((2400, 900, 500, 296), 2))
@example(packing=((2400, 900, 500, 296), 4))
@example(packing=((6000, 1000, 500, 500, 192), 4))
def test_each_ranks_unmasked_pairs_are_within_five_percent_of_the_mean(packing):
    """Counted from the mask (each rank's queries against the keys of their document at or before them), not from
    the layout's own weights; held wherever a rank has at least 16 tokens (fewer cannot always be balanced)."""
    lengths, p = packing
    layout = DocumentLayout(lengths, p)
    document = layout.document_ids()
    starts = torch.cumsum(torch.tensor((0, *lengths)), 0)
    counted = []
    for r in range(p):
        queries = layout.positions(r)[: layout.valid_len(r)]
        counted.append(int((queries - starts[document[queries]] + 1).sum()))
        assert counted[-1] == layout.pairs(r)
    assert sum(counted) == sum(document_pairs(n) for n in lengths)
    if sum(lengths) >= 16 * p:
        assert max(counted) * p <= 1.05 * sum(counted), (counted, layout.balance())


def test_zigzag_over_the_row_is_what_the_documents_layout_balances():
    """The issue's row on 2 ranks: zigzag's causal split leaves the documents' pairs 1.49x the mean."""
    lengths = (2400, 900, 500, 296)
    document = DocumentLayout(lengths, 2).document_ids()
    zigzag = Layout("zigzag", 2, sum(lengths))
    starts = torch.cumsum(torch.tensor((0, *lengths)), 0)
    pairs = [
        int((q - starts[document[q]] + 1).sum()) for q in (zigzag.positions(r)[: zigzag.valid_len(r)] for r in range(2))
    ]
    assert max(pairs) * 2 / sum(pairs) > 1.45 and DocumentLayout(lengths, 2).balance() <= 1.05
    assert visible_pairs(zigzag, 0, True) == visible_pairs(zigzag, 1, True)  # one triangle: balanced as a row


@pytest.mark.parametrize(
    "lengths,world_size",
    [((20, 5, 3, 12, 1, 7), 2), ((20, 5, 3, 12, 1, 7), 3), ((9, 30, 2, 4), 4), ((45,), 4), ((1, 1, 3, 1, 1, 2, 1), 2)],
)
def test_the_ring_on_a_documents_layout_is_exact(monkeypatch, lengths, world_size):
    """`simulate_ring` with the documents' mask program on `DocumentLayout`: out, dq, dk, dv against dense fp64
    attention under the same mask (tiles of 4: empty, full and partial ones)."""
    monkeypatch.setattr(lowering.masks, "MASK_TILE", 4)
    layout = DocumentLayout(lengths, world_size)
    document = layout.document_ids()
    pos = torch.arange(layout.seq_len)
    q, k, v = qkv_fp64(layout.seq_len)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked_attention_fp64(*leaves, same_document(pos, pos, document))
    dout = torch.randn_like(expected)
    expected.backward(dout)
    sim = simulate_ring(
        q, k, v, layout=layout, is_causal=True, dout=dout, mask=same_document, mask_inputs=[document]
    )  # fmt: skip
    assert rel_err(sim.out, expected) < 1e-12
    for got, leaf in zip((sim.dq, sim.dk, sim.dv), leaves):
        assert rel_err(got, leaf.grad) < 1e-12


@st.composite
def packed_rows(draw):
    """(ids [B, N], layout, is_causal, window): each row packed by its own drawn lengths; ids numbered in order, or
    labels that repeat apart (padding id 0 at both ends, a label reused later) as no sorted-range shortcut may assume;
    a zigzag, contiguous or documents layout of 2, 3 or 4 ranks."""
    p = draw(st.sampled_from([2, 3, 4]))
    n = draw(st.integers(p, 64))
    rows = []
    for _ in range(draw(st.sampled_from([1, 2]))):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=8)))
        lengths = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
        labels = draw(st.sampled_from(["in order", "repeated"]))
        ids = (
            range(len(lengths))
            if labels == "in order"
            else draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
        )
        rows.append(torch.repeat_interleave(torch.tensor(list(ids)), torch.tensor(lengths)))
    ids = torch.stack(rows)
    kind = draw(st.sampled_from(["zigzag", "contiguous", "documents"]))
    if kind == "documents":  # (rows packed differently: the layout of their shared runs)
        layout = DocumentLayout.of_ids(ids, p)
    else:
        layout = Layout(kind, p, n)
    is_causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, n))) if is_causal else None
    return ids, layout, is_causal, window


@settings(max_examples=150, **SETTINGS)
@given(case=packed_rows())
def test_documents_give_the_dense_document_mask_exactly(case):
    """`simulate_ring(documents=ids)` (tiles of 4, so tiles hold one document, several, or none that meet): out, dq,
    dk, dv against dense fp64 attention under ``ids[q] == ids[kv]`` (and causal, and the window), per row."""
    ids, layout, is_causal, window = case
    n = layout.seq_len
    pos = torch.arange(n)
    visible = (ids[:, :, None] == ids[:, None, :])[:, None]
    if is_causal:
        visible = visible & (pos[None, :] <= pos[:, None])
    if window is not None:
        visible = visible & (pos[:, None] - pos[None, :] < window)
    q, k, v = qkv_fp64(n, batch=ids.size(0))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked_attention_fp64(*leaves, visible)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    with patch.object(lowering.masks, "MASK_TILE", 4):
        sim = simulate_ring(q, k, v, layout=layout, is_causal=is_causal, window=window, dout=dout, documents=ids)
    for got, want in zip((sim.out, sim.dq, sim.dk, sim.dv), (expected, *(leaf.grad for leaf in leaves))):
        assert (got - want).abs().max() <= 1e-12 * want.abs().max().clamp_min(1)  # (a window of 1: dq, dk are 0)


@settings(max_examples=150, **SETTINGS)
@given(case=packed_rows())
def test_a_block_travels_as_far_as_a_rank_sees_one_of_its_keys(case):
    """`RingSpec.hops` (how far each rank's KV block travels) against the dense mask: never short of the last rank
    whose queries see one of its keys in some row (the ring would lose pairs), and exactly that where every id is one
    run of its row and no window decides per tile (rows packed differently planned per packing)."""
    ids, layout, is_causal, window = case
    n, p = layout.seq_len, layout.world_size
    pos = torch.arange(n)
    visible = ids[:, :, None] == ids[:, None, :]
    if is_causal:
        visible = visible & (pos[None, :] <= pos[:, None])
    if window is not None:
        visible = visible & (pos[:, None] - pos[None, :] < window)
    real = [layout.positions(r)[layout.positions(r) < n] for r in range(p)]

    def sees(q_rank: int, kv_rank: int) -> bool:
        return bool(visible[:, real[q_rank]][:, :, real[kv_rank]].any())

    needed = [max((t for t in range(1, p) if sees((b + t) % p, b)), default=0) for b in range(p)]
    hops = RingSpec(layout, is_causal, 1.0, lowering.masks.BlockMask(is_causal, window, documents=ids)).hops()
    assert all(h >= need for h, need in zip(hops, needed)), (hops, needed)
    one_run_each = all(len(torch.unique_consecutive(row)) == len(torch.unique(row)) for row in ids)
    if window is None and one_run_each:
        assert list(hops) == needed, (hops, needed)


def _scored_pairs(events) -> tuple[int, list]:
    """(the pairs the forward kernel calls scored, the calls given a mask) of recorded ring events."""
    calls = [e.fields for e in events if e.kind == "block_forward"]
    scored = sum(
        len(f["q_pos"]) * (len(f["q_pos"]) + 1) // 2 if f["causal"] else len(f["q_pos"]) * len(f["kv_pos"])
        for f in calls
    )
    return scored, [f for f in calls if f["masked"]]


def test_one_packing_is_planned_per_document_scoring_exactly_the_visible_pairs():
    """The issue's row (2400, 900, 500, 296 tokens), zigzag over 2 ranks, causal inside each document: the ring plans
    each document's pieces (`plan_documents`): its kernels score exactly the visible pairs, none with a mask, and the
    rest of the row's causal triangle is counted as skipped."""
    lengths = (2400, 900, 500, 296)
    layout = Layout("zigzag", 2, sum(lengths))
    q, k, v = qkv_fp64(layout.seq_len, batch=1)
    with lowering.record_ring_events() as events:
        simulate_ring(q, k, v, layout=layout, is_causal=True, documents=DocumentLayout(lengths, 2).document_ids())
    scored, masked = _scored_pairs(events)
    visible, triangle = sum(document_pairs(n) for n in lengths), document_pairs(layout.seq_len)
    assert scored == visible and not masked
    assert sum(e.fields["pairs"] for e in events if e.kind == "document_skip") == triangle - visible


def test_rows_packed_alike_under_other_ids_are_planned_per_document():
    """Two rows cut at the same places but numbering their documents differently (as a data loader may): one packing,
    planned per document (no kernel call masked, exactly the visible pairs scored), exact against the dense mask."""
    lengths = (70, 30, 28)
    first = DocumentLayout(lengths, 1).document_ids()
    ids = torch.stack([first, first.max() - first + 5])
    layout = Layout("zigzag", 2, sum(lengths))
    q, k, v = qkv_fp64(layout.seq_len, batch=2)
    with lowering.record_ring_events() as events:
        sim = simulate_ring(q, k, v, layout=layout, is_causal=True, documents=ids)
    scored, masked = _scored_pairs(events)
    assert scored == sum(document_pairs(n) for n in lengths) and not masked
    pos = torch.arange(layout.seq_len)
    visible = (ids[:, :, None] == ids[:, None, :])[:, None] & (pos[None, :] <= pos[:, None])
    assert rel_err(sim.out, masked_attention_fp64(q, k, v, visible)) < 1e-12


def test_rows_packed_differently_skip_tiles_and_compare_ids_only_at_boundaries():
    """Two rows packed differently (the issue's documents, and in reverse order), real tile size: tiles where neither
    row's documents meet are skipped (counted), tiles inside one document on both sides in both rows run as plain or
    causal attention, and only the others get a mask."""
    packings = ((2400, 900, 500, 296), (296, 500, 900, 2400))
    layout = Layout("zigzag", 2, 4096)
    ids = torch.stack([DocumentLayout(lengths, 1).document_ids() for lengths in packings])
    q, k, v = qkv_fp64(layout.seq_len, batch=2)
    with lowering.record_ring_events() as events:
        simulate_ring(q, k, v, layout=layout, is_causal=True, documents=ids)
    scored, masked = _scored_pairs(events)
    assert scored < 0.8 * document_pairs(layout.seq_len)
    assert sum(e.fields["pairs"] for e in events if e.kind == "document_skip") > 0
    for f in masked:  # never a tile that lies inside one document on both sides in every row
        assert any(torch.cat((row[f["q_pos"]], row[f["kv_pos"]])).unique().numel() > 1 for row in ids)
    assert masked


@pytest.mark.parametrize(
    "given,mask,inputs",
    [
        ("cu_seqlens", "packed documents (document ids from `searchsorted`", ["packing"]),
        ("ids", "packed documents (document ids from input `packing`) + causal inside each", ["packing"]),
        ("rows_on_heads", "lifted mask program + causal", ["packing", "positions"]),  # rows not on the batch: a program
        ("longer_table", "lifted mask program + causal", ["packing", "positions"]),  # not one id per token of the row
    ],
)
def test_each_packing_convention_is_read_as_documents(given, mask, inputs):
    """What the report (and `ringpass inspect`) says of a packed mask: the documents and where their ids come from,
    no mask program; a mask whose ids are not the batch's rows, or not one per token of the row, stays a program."""
    x = torch.randn(2, 12, 16)
    packing = {
        "cu_seqlens": torch.tensor([0, 5, 9, 12]),
        "longer_table": torch.arange(17) // 5,
    }.get(given, torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9]))
    (report,) = ringpass.inspect(models.PackedAttention(given), (x, packing), world_size=2).reports
    (attention,) = report.attention
    assert attention.mask.startswith(mask) and attention.mask_inputs == inputs, attention


@pytest.mark.parametrize("name,window", [("qwen2", ""), ("mistral", ", sliding window 5")])
def test_hugging_face_position_ids_that_restart_are_read_as_documents(name, window):
    """HF's packed path (no attention mask, position ids restarting: `find_packed_sequence_indices`): its mask
    ``ids[b, q] == ids[b, k]`` and ``position_ids[b, k] <= position_ids[b, q]`` is causal inside each document
    (Mistral's window ``position_ids[b, k] > position_ids[b, q] - 5`` too)."""
    model = hf_workers.build(name)
    position_ids = torch.cat([torch.arange(n) for n in (5, 15, 4)]).expand(2, -1)
    ids = torch.randint(0, hf_workers.VOCAB, (2, 24))
    (report,) = ringpass.inspect(
        model, dict(input_ids=ids, position_ids=position_ids, use_cache=False), world_size=2
    ).reports
    for attention in report.attention:  # both layers
        assert attention.mask.startswith(
            f"packed documents (position_ids restarting at each) + causal inside each{window}"
        )
        assert attention.is_causal and attention.mask_inputs == ["position_ids"]


def test_documents_given_wrong_are_refused_saying_what_to_pass():
    """A `DocumentLayout` without its documents, or with ids of other lengths (rows packed differently: their shared
    runs are the layout's documents), a mask program besides documents, float ids: each refused with what to pass
    instead; on one rank it is exact."""
    layout = DocumentLayout((3, 5), 1)
    q, k, v = qkv_fp64(8)
    ids = layout.document_ids()
    call = partial(lowering.ring_attention, q, k, v, layout=layout, is_causal=True)
    with pytest.raises(lowering.InvalidInputError, match="needs documents=ids"):
        call()
    with pytest.raises(lowering.InvalidInputError, match=r"other lengths than the layout's \(3, 5\)"):
        call(documents=DocumentLayout((4, 4), 1).document_ids())
    rows = torch.stack([ids, DocumentLayout((4, 4), 1).document_ids()])
    with pytest.raises(lowering.InvalidInputError, match=r"other lengths than the layout's \(3, 5\)"):
        call(documents=rows)
    assert DocumentLayout.of_ids(rows, 1) == DocumentLayout((3, 1, 4), 1)  # the runs no row's id changes in
    with pytest.raises(lowering.NotSupportedError, match="documents or a mask program, not both"):
        call(documents=ids, mask=same_document, mask_inputs=[ids])
    with pytest.raises(lowering.InvalidInputError, match=r"one integer tensor of each token's document id, \[8\]"):
        call(documents=ids.double())
    pos = torch.arange(8)
    expected = masked_attention_fp64(q, k, v, same_document(pos, pos, ids))
    assert rel_err(call(documents=ids), expected) < 1e-12


@pytest.mark.parametrize("world_size", [2, 3])
def test_rows_packed_differently_share_one_documents_layout_exactly(world_size):
    """Rows packed differently on the `DocumentLayout` of their shared runs (`lowering.documents.shared_runs`): every
    row's documents are unions of those runs, so the ring (simulated over the ranks) is exact for each row."""
    lengths = [(70, 3, 100, 27), (20, 150, 30)]
    ids = torch.stack([DocumentLayout(lengths_, 1).document_ids() for lengths_ in lengths])
    layout = DocumentLayout.of_ids(ids, world_size)
    assert layout.lengths == (20, 50, 3, 97, 3, 27)  # (it balances these rows better than one document would)
    q, k, v = qkv_fp64(200, batch=2)
    pos = torch.arange(200)
    mask = ((ids[:, :, None] == ids[:, None, :]) & (pos[None, :] <= pos[:, None]))[:, None]
    out = simulate_ring(q, k, v, layout=layout, is_causal=True, documents=ids).out
    assert rel_err(out, masked_attention_fp64(q, k, v, mask)) < 1e-12


def _busiest_rank_pairs(layout, ids: torch.Tensor) -> int:
    """The most (query, key) pairs one rank's queries see, summed over the rows of ``ids``, counted from the dense
    mask (causal inside each document)."""
    n = ids.size(-1)
    pos = torch.arange(n)
    visible = (ids[:, :, None] == ids[:, None, :]) & (pos[None, :] <= pos[:, None])
    per_query = visible.sum((0, 2))
    owned = [layout.positions(rank)[: layout.valid_len(rank)] for rank in range(layout.world_size)]
    return max(int(per_query[positions].sum()) for positions in owned)


@settings(max_examples=60, **SETTINGS)
@given(
    world_size=st.sampled_from([2, 3, 4]),
    rows=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=2, max_size=4),
)
def test_rows_packed_differently_get_the_better_balanced_of_two_layouts(world_size, rows):
    """Rows packed differently (drawn lengths, each row cut to the shortest row's length): `DocumentLayout.of_ids`
    takes the layout of their shared runs or that of one document over the row, whichever leaves the busiest rank
    fewer visible pairs (counted from the dense mask, summed over the rows); rows packed alike get their documents'."""
    n = min(sum(row) for row in rows)
    ids = torch.stack([DocumentLayout(row, 1).document_ids()[:n] for row in rows])
    chosen = DocumentLayout.of_ids(ids, world_size)
    cuts = sorted({int(c) for row in ids for c in (row[1:] != row[:-1]).nonzero().flatten() + 1} | {n})
    shared = DocumentLayout(tuple(b - a for a, b in zip([0, *cuts], cuts)), world_size)
    if bool((ids == ids[:1]).all()):
        assert chosen == shared
        return
    whole = DocumentLayout((n,), world_size)
    assert chosen in (shared, whole)
    assert _busiest_rank_pairs(chosen, ids) == min(_busiest_rank_pairs(shared, ids), _busiest_rank_pairs(whole, ids))


def test_a_row_of_one_document_beside_short_ones_is_split_as_one_document():
    """At P = 4 rows of 5 + 7 and 3 + 9 tokens balance better as one document of 12 split by zigzag (rank loads 26,
    24, 22, 22 pairs) than as their shared runs 3, 2, 7."""
    ids = torch.stack([DocumentLayout(lengths, 1).document_ids() for lengths in [(5, 7), (3, 9)]])
    assert DocumentLayout.of_ids(ids, 4) == DocumentLayout((12,), 4)
    assert DocumentLayout.of_ids(ids, 2) == DocumentLayout((3, 2, 7), 2)


def test_the_documents_layout_option_reads_one_ids_value_or_refuses_saying_why():
    """``layout="documents"``: the report names the layout where every attention masks documents of one ids value;
    a graph whose attention masks no documents is refused, and graphs and options the documents layout is not built
    for yet (a convolution between the attentions, sharded inputs, another strategy, Ulysses) too, with what to use
    instead."""
    x = torch.randn(2, 12, 16)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 9])
    (report,) = ringpass.inspect(models.PackedAttention("ids"), (x, ids), world_size=2, layout="documents").reports
    assert report.layout == "documents" and report.attention[0].mask.startswith("packed documents")
    plain = hf_workers.build("qwen2")
    tokens = dict(input_ids=torch.randint(0, hf_workers.VOCAB, (2, 12)), use_cache=False)
    (report,) = ringpass.inspect(plain, tokens, world_size=2, layout="documents").reports
    assert report.status == "refused" and "this graph's attentions mask causal). Use layout='zigzag'" in str(
        report.refusal.message
    )
    hybrid = hf_workers.build("lfm2")  # short convolutions between its attention layers
    packed = dict(tokens, position_ids=torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1))
    (report,) = ringpass.inspect(hybrid, packed, world_size=2, layout="documents").reports
    assert "it needs no other sequence mixer (a convolution or scan needs equal chunks)" in report.refusal.message
    for options in ({"inputs": "sharded"}, {"strategy": "auto"}, {"ulysses": 2}):
        with pytest.raises(lowering.InvalidInputError, match="or 'per_rank', strategy='ring', no Ulysses"):
            ringpass.backend(layout="documents", **options)
