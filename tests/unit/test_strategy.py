"""``strategy="auto"``: the cost model's choice per attention (`lowering.costmodel.choose_strategies`), checked by
hand, offline and in one process. The backend running every choice on 2 ranks:
tests/distributed/test_strategy_ranks.py."""

import math

import pytest

from lowering.costmodel import (
    BACKWARD_FLOPS_RATIO,
    AttentionShape,
    Hardware,
    Strategy,
    choose_strategies,
    predict,
    ring_cost,
    strategy_memory,
    strategy_seconds,
)
from lowering.layout import Layout

MHA = AttentionShape(2, 4, 4, 8, 8, is_causal=True)  # tests/workers/models.py GPT in fp64, batch 2
GQA = AttentionShape(2, 4, 2, 8, 8, is_causal=True)  # tests/workers/models.py Llama
LAYOUTS = ("zigzag", "contiguous")
# hardware that makes each strategy the fastest for these shapes at 64 tokens on 2 ranks (see the test below)
COMPUTE_BOUND = Hardware(1e15, 0.0, 1e6)  # transfers free: the ring hides them and holds least
BANDWIDTH_BOUND = Hardware(1e8, 0.0, 1e9)  # MHA: one all-to-all each way moves less than a KV block and its dK/dV
LATENCY_BOUND = Hardware(1e3, 1e-3, 1e9)  # slow messages: one gather beats the ring; nothing sent beats both


def test_each_strategy_is_chosen_where_it_is_predicted_fastest():
    cases = [
        (MHA, COMPUTE_BOUND, True, "ring (zigzag)"),
        (MHA, BANDWIDTH_BOUND, True, "ulysses 2 (zigzag)"),
        (GQA, LATENCY_BOUND, False, "all-gather (zigzag)"),  # outputs sharded, say: no running whole
        (GQA, LATENCY_BOUND, True, "none"),
    ]
    for shape, hw, none, expected in cases:
        choice = choose_strategies([shape], 64, 2, hw, layouts=LAYOUTS, none=none)
        times = choice.alternatives[0]
        assert str(choice.chosen[0]) == expected, (expected, times)
        assert set(times) == {
            "ring (zigzag)",
            "ring (contiguous)",
            "all-gather (zigzag)",
            "all-gather (contiguous)",
            "ulysses 2 (zigzag)",
            "ulysses 2 (contiguous)",
            "none",
        }
        allowed = [t for name, t in times.items() if none or name != "none"]
        assert times[expected] == min(allowed)


def test_strategy_times_by_hand():
    hw = Hardware(1e6, 1e-3, 1e9)
    layout = Layout("zigzag", 2, 64)
    flops = 4 * 2 * 4 * 8 * (64 * 65 // 2)  # causal pairs of the whole sequence, 4·B·Hq·D each
    assert strategy_seconds(Strategy("none"), GQA, 64, 2, hw) == pytest.approx(flops / 1e9 * (1 + BACKWARD_FLOPS_RATIO))
    ring = predict(ring_cost(layout, GQA), hw)
    assert strategy_seconds(Strategy("ring", "zigzag"), GQA, 64, 2, hw) == ring.forward_s + ring.backward_s
    assert strategy_seconds(Strategy("ring", "zigzag"), GQA, 64, 2, hw, backward=False) == ring.forward_s
    kv_hop = 1e-3 + 2 * 2 * 2 * 32 * 8 * 8 / 1e6  # latency + K and V of 32 tokens, 2 heads, fp64
    busiest = max(sum(row) for row in ring_cost(layout, GQA).flops_forward) / 1e9
    assert strategy_seconds(Strategy("all-gather", "zigzag"), GQA, 64, 2, hw) == pytest.approx(
        kv_hop + busiest + kv_hop + BACKWARD_FLOPS_RATIO * busiest + kv_hop  # gather, gather again, reduce-scatter
    )
    # Ulysses over both ranks: four all-to-alls each way (q, k, v, out), half of each rank's tensors moved
    moved = 2 * 32 * 8 * (4 + 2 + 2 + 4) * 8 / 2
    ulysses = strategy_seconds(Strategy("ulysses", "zigzag", 2), GQA, 64, 2, hw)
    assert ulysses == pytest.approx(2 * (4e-3 + moved / 1e6) + busiest * (1 + BACKWARD_FLOPS_RATIO))
    assert not math.isnan(ulysses)
    # memory: at P=4 the all-gather holds two more KV blocks (K and V of 16 tokens, 2 heads, fp64) and two more
    # dK/dV blocks (fp64 accumulators) than the ring's two and three
    gathered = strategy_memory(Strategy("all-gather", "zigzag"), GQA, 64, 4)
    assert gathered - strategy_memory(Strategy("ring", "zigzag"), GQA, 64, 4) == 2 * (2 * 2 * 2 * 16 * 8 * 8) * 2


def test_a_layout_is_chosen_for_the_whole_graph_and_none_only_for_all_of_it():
    # causal attention: zigzag balances the ranks, so the ring in zigzag beats contiguous for every attention
    choice = choose_strategies([GQA, GQA], 4096, 4, COMPUTE_BOUND, layouts=("contiguous", "zigzag"), none=True)
    assert choice.layout == "zigzag" and [str(s) for s in choice.chosen] == ["ring (zigzag)"] * 2
    # a long attention that shards well and a short one that would rather run whole: the graph stays sharded
    long_and_short = choose_strategies([GQA, GQA], 64, 2, LATENCY_BOUND, layouts=LAYOUTS, none=True)
    assert [s.kind for s in long_and_short.chosen] == ["none", "none"]  # both short: the graph runs whole
    assert long_and_short.unsharded


def test_auto_offline_and_where_ulysses_cannot_run():
    """`ringpass.inspect` takes the strategy too (Ulysses groups named by role); an attention with a score bias
    program (learned ALiBi-like slopes), which Ulysses cannot split by heads, is never given Ulysses."""
    import models
    import torch

    import ringpass

    ids = torch.randint(0, 61, (2, 64))
    for model, ulysses in ((models.GPT(), True), (models.LearnedBias(), False)):
        inspection = ringpass.inspect(
            model.double(), (ids,), world_size=2, strategy="auto", hardware=BANDWIDTH_BOUND, outputs="sharded"
        )
        texts = [a.strategy for report in inspection.reports for a in report.attention]
        assert texts and all(t.startswith("ulysses 2 (zigzag)") == ulysses for t in texts), texts
        assert all(("ulysses" in t) == ulysses for t in texts), texts


def test_options_that_contradict_the_strategy_are_refused():
    from lowering.errors import InvalidInputError
    from ringpass.options import RingOptions

    with pytest.raises(InvalidInputError, match="strategy='auto' chooses how attention runs itself; ulysses=2"):
        RingOptions.from_dict({"strategy": "auto", "ulysses": 2})
    with pytest.raises(InvalidInputError, match="strategy='fastest' is not one of 'ring', 'auto', 'all-gather'"):
        RingOptions.from_dict({"strategy": "fastest"})


def test_strategy_auto_chooses_for_the_scans_too_unless_scans_is_given():
    from ringpass.options import RingOptions

    chosen = {
        (strategy, scans): RingOptions.from_dict({"strategy": strategy, "scans": scans}).scan_strategy
        for strategy in ("ring", "auto")
        for scans in (None, "heads", "state")
    }
    assert chosen == {
        ("ring", None): "heads",
        ("ring", "heads"): "heads",
        ("ring", "state"): "state",
        ("auto", None): "auto",
        ("auto", "heads"): "heads",
        ("auto", "state"): "state",
    }


def test_convert_refuses_a_model_auto_would_run_whole():
    """A converted model runs sharded: where ``strategy="auto"`` would run the graph whole, convert says so."""
    import models
    import torch

    import ringpass
    from lowering.errors import NotSupportedError

    ids = torch.randint(0, 61, (2, 64))
    with pytest.raises(NotSupportedError, match="convert: strategy='auto' chose no sequence parallelism"):
        ringpass.convert(models.Llama().double(), (ids,), world_size=2, strategy="auto", hardware=LATENCY_BOUND)
