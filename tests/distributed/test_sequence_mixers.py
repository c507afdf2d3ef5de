"""Sequence mixers other than attention on a sharded sequence: causal depthwise convolutions and cumulative sums pass
each chunk a summary of the chunks before it (`lowering.sequence_mixers`; the graph side: `find_sequence_mixers`,
`rewrite_sequence_mixers`). The ops against the unsharded ops over drawn sizes, ring sizes, layouts and dtypes; a model
of them, with and without attention, through the ring backend against the model run whole (logits and every gradient
by name), sharded (local lengths) and with the summaries exchanged (events counted); what is not a causal convolution
refused with the op and the user's source line. Chunked scans: `lowering.state_passing` against fp64 token-by-token
references, and a model of every mixer kind (the delta rule and SSD in fp64, `fp64_scans`) under each strategy,
``inputs="per_rank"`` and Ulysses x ring. Hugging Face's hybrids: tests/models/test_hf.py."""

from __future__ import annotations

import mixer_workers
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import ringpass
from ringpass.cli.launch import RankFailure

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


@st.composite
def runtime_cases(draw, world_sizes=(2, 3, 4)) -> dict:
    return dict(
        world_size=draw(st.sampled_from(world_sizes)),
        layout=draw(st.sampled_from(["contiguous", "zigzag"])),
        seq_len=draw(st.one_of(st.integers(1, 9), st.integers(10, 70))),  # shorter than the chunks, or many tokens
        width=draw(st.integers(1, 7)),  # 1: no halo; wider than a chunk: the halo spans chunks
        channels=draw(st.integers(1, 5)),
        batch=draw(st.integers(1, 3)),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float64", "float64", "float32"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _check_runtime(pools, case: dict) -> None:
    results = pools.run(case["world_size"], mixer_workers.runtime_case, (case,), timeout=300)
    for rank, result in enumerate(results):
        bound = TOLERANCE[case["dtype"]]
        assert max(result["errors"]) <= bound, (rank, case, result["errors"])
        # one all-gather each: the convolution's forward and backward (none at width 1), the cumsum's forward
        assert result["exchanges"] == (3 if case["width"] > 1 else 1), (rank, case, result)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.timeout(600)
@settings(max_examples=3, derandomize=True, **SETTINGS)  # (suite time: the drawn ones below are heavy)
@given(case=runtime_cases())
def test_a_sharded_convolution_and_cumsum_equal_the_unsharded_ops(pools, case):
    _check_runtime(pools, case)


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@settings(max_examples=150, **SETTINGS)
@given(case=runtime_cases())
def test_many_drawn_convolutions_and_cumsums_equal_the_unsharded_ops(pools, case):
    _check_runtime(pools, case)


@st.composite
def head_exchange_cases(draw) -> dict:
    """A tensor of 2 to 4 dims with a sequence dim and a head dim anywhere (either first), P dividing the heads."""
    world_size = draw(st.sampled_from([2, 3, 4]))
    rank = draw(st.integers(2, 4))
    seq_dim, head_dim = draw(st.permutations(range(rank)))[:2]
    shape = [draw(st.integers(1, 3)) for _ in range(rank)]
    shape[seq_dim] = draw(st.integers(1, 20))
    shape[head_dim] = world_size * draw(st.integers(1, 3))
    layout = draw(st.sampled_from(["contiguous", "zigzag"]))
    return dict(
        world_size=world_size,
        shape=shape,
        seq_dim=seq_dim,
        head_dim=head_dim,
        layout=layout,
        seed=draw(st.integers(0, 99)),
    )


@pytest.mark.timeout(600)
@settings(max_examples=4, derandomize=True, **SETTINGS)
@given(case=head_exchange_cases())
def test_a_shard_exchanged_for_a_share_of_the_heads_equals_slices_of_the_whole_tensor(pools, case):
    """`lowering.head_exchange`: this rank's tokens of every head become every token of its heads and back, forward and
    backward, exactly; a per-head weight is narrowed to this rank's heads (its gradient zero elsewhere)."""
    _check_head_exchange(pools, case)


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@settings(max_examples=100, **SETTINGS)
@given(case=head_exchange_cases())
def test_many_drawn_head_exchanges_equal_slices_of_the_whole_tensor(pools, case):
    _check_head_exchange(pools, case)


def _check_head_exchange(pools, case: dict) -> None:
    results = pools.run(case["world_size"], mixer_workers.head_exchange_case, (case,), timeout=300)
    for rank, result in enumerate(results):
        assert result["error"] == 0.0, (rank, case, result)
        assert result["exchanges"] == 4, (rank, case, result)  # two ops, forward and backward


@st.composite
def state_passing_cases(draw) -> dict:
    """A delta rule or an SSD scan of drawn sizes on 2 to 4 ranks: the token-by-token reference in fp64 or Hugging
    Face's chunked function in fp32 (its chunk size drawn apart from the layout's)."""
    scan = draw(st.sampled_from(["delta rule", "ssd"]))
    function = draw(st.sampled_from(["reference", "hugging face"]))
    heads = draw(st.integers(1, 4))
    return dict(
        scan=scan,
        function=function,
        dtype="float64" if function == "reference" else "float32",
        world_size=draw(st.sampled_from([2, 3, 4])),
        layout=draw(st.sampled_from(["contiguous", "zigzag"])),
        seq_len=draw(st.one_of(st.integers(1, 9), st.integers(10, 40))),  # shorter than the chunks, or many tokens
        batch=draw(st.integers(1, 2)),
        heads=heads,
        groups=draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])),  # SSD's B and C shared by heads
        # (dk, dv) or (head_dim, state size); a key of one feature l2-normed is +-1, its gradient eps-small: fp32 noise
        dims=(draw(st.integers(1 if scan == "ssd" else 2, 5)), draw(st.integers(1, 5))),
        function_chunk=draw(st.integers(1, 8)),
        flag=draw(st.booleans()),  # the delta rule's l2 norm of q and k, SSD's softplus of dt
        seed=draw(st.integers(0, 2**16)),
    )


def _check_state_passing(pools, case: dict) -> None:
    results = pools.run(case["world_size"], mixer_workers.state_passing_case, (case,), timeout=300)
    rows, width = (
        (case["dims"][0], sum(case["dims"])) if case["scan"] == "delta rule" else (case["dims"][0] + 1, case["dims"][1])
    )
    summary_bytes = case["batch"] * case["heads"] * rows * width * (8 if case["dtype"] == "float64" else 4)
    for rank, result in enumerate(results):
        bound = TOLERANCE[case["dtype"]]
        assert max(result["errors"].values()) <= bound, (rank, case, result["errors"])
        assert result["local_len"] == result["expected_local_len"], (rank, case, result)  # this rank's chunks only
        assert result["exchanges"] == 1, (rank, case, result)  # one all-gather of the summaries
        assert result["bytes"] == result["chunks"] * summary_bytes, (rank, case, result)  # whatever the length


@pytest.mark.timeout(600)
@settings(max_examples=1, derandomize=True, **SETTINGS)  # (suite time: the drawn ones below are heavy)
@given(case=state_passing_cases())
@example(  # Hugging Face's delta rule, zigzag, padded; its SSD on 3 ranks with B and C in 2 groups
    case=dict(scan="delta rule", function="hugging face", dtype="float32", world_size=2, layout="zigzag", seq_len=23,
              batch=1, heads=2, groups=1, dims=(4, 3), function_chunk=4, flag=True, seed=0)
)  # fmt: skip
@example(
    case=dict(scan="ssd", function="hugging face", dtype="float32", world_size=3, layout="contiguous", seq_len=17,
              batch=2, heads=4, groups=2, dims=(3, 5), function_chunk=4, flag=True, seed=1)
)  # fmt: skip
def test_a_scan_passed_the_state_before_each_chunk_equals_the_unsharded_scan(pools, case):
    """`lowering.state_passing`: each chunk's scan starts from the state the chunks before it leave (their summaries
    all-gathered): output and every gradient as the unsharded scan's, bytes independent of the length."""
    _check_state_passing(pools, case)


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@settings(max_examples=100, **SETTINGS)
@given(case=state_passing_cases())
def test_many_drawn_scans_passed_state_equal_the_unsharded_scans(pools, case):
    _check_state_passing(pools, case)


@st.composite
def model_cases(draw, world_sizes=(2, 3, 4)) -> dict:
    """`mixer_workers.ConvNet` and how it is compiled and called: the ring size, layout, length (shorter than the
    chunks, or many tokens; duck sizing aside: a symbolic length never equals the batch of 2), convolution width
    (1: no halo), a chunked scan's chunk (0: none; never the whole length: that reshape is no cut, see
    `test_a_scan_of_exactly_one_chunk_is_computed_whole_or_refused`), attention or none (a graph of mixers alone),
    a padded row, dtype, static or symbolic lengths."""
    dynamic = draw(st.booleans())
    seq_len = draw(st.one_of(st.integers(3, 9), st.integers(10, 40))) if dynamic else draw(st.integers(2, 40))
    return dict(
        world_size=draw(st.sampled_from(world_sizes)),
        layout=draw(st.sampled_from(["auto", "zigzag", "contiguous"])),
        seq_len=seq_len,
        width=draw(st.integers(1, 6)),
        # (with static shapes only, so far)
        scan=0 if dynamic else draw(st.sampled_from([0, 0, 2, 3, 5, 8]).filter(lambda chunk: chunk != seq_len)),
        attention=draw(st.booleans()),
        padding=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float64", "float64", "float32"])),
        dynamic=dynamic or None,
        seed=draw(st.integers(0, 2**16)),
    )


def _check_model(pools, case: dict) -> None:
    for rank, result in enumerate(pools.run(case["world_size"], mixer_workers.conv_model_step, (case,), timeout=600)):
        bound = TOLERANCE[case["dtype"]]
        assert result["logits"] <= bound, (rank, case, result)
        assert result["grads"] and max(result["grads"].values()) <= bound, (rank, case, result["grads"])
        zigzag = case["layout"] == "zigzag" or (case["layout"] == "auto" and case["attention"])  # auto: causal
        chunks = case["world_size"] * (2 if zigzag else 1)
        local = -(-case["seq_len"] // chunks) * chunks // case["world_size"]
        assert result["local_len"] == local, (rank, case, result)  # sharded, padded to whole chunks
        # 2 cumsums (forward), and 2 convolutions' halos (forward and backward) where the width reads tokens before
        assert result["mixer_exchanges"] == (6 if case["width"] > 1 else 2), (rank, case, result)
        assert (result["kv_exchanges"] > 0) == case["attention"], (rank, case, result)
        conv = f"causal depthwise conv1d, width {case['width']}, 8 channels"
        scans = ["`chunked_decay_scan`: a chunked scan (`reshape` cuts the sequence into chunks)"] * 2
        kinds = [conv] * 2 + ["cumulative sum along dim 1"] * 2 + (scans if case["scan"] else [])
        assert [m["kind"] for m in result["mixers"]] == kinds, (rank, case, result["mixers"])
        passing = [m for m in result["mixers"] if m["strategy"].startswith("state passing")]
        assert len(passing) == (4 if case["width"] > 1 else 2) and all(m["bytes_per_call"] > 0 for m in passing)
        split = [m for m in result["mixers"] if m["strategy"].startswith("split by heads: every token of")]
        whole = [m for m in result["mixers"] if m["strategy"].startswith("computed whole on every rank")]
        assert all(m["bytes_per_call"] > 0 for m in split + whole)
        # 4 heads (of 2 features; the batch is 2 too): a share of them at P = 2 and 4, unless the sequence, the
        # chunk count or the padded length is 4 too (the heads would be ambiguous): then computed whole
        chunks = -(-case["seq_len"] // case["scan"]) if case["scan"] else 0
        ambiguous = 4 in (case["seq_len"], chunks, chunks * case["scan"])
        splits = case["scan"] and case["world_size"] in (2, 4) and not ambiguous
        assert (len(split), len(whole)) == ((2, 0) if splits else (0, 2) if case["scan"] else (0, 0)), (rank, case)
        # split: the scan's two per-token inputs and its output exchanged in each block, both ways; whole: those inputs
        # all-gathered in each block, and its output's gradient in the backward
        assert result["heads_exchanges"] == 6 * len(split), (rank, case, result)
        assert result["all_gathers"] == 3 * len(whole), (rank, case, result)


@pytest.mark.timeout(600)
@settings(max_examples=1, derandomize=True, **SETTINGS)
@given(case=model_cases())
@example(  # a chunked scan over 3-token chunks with attention and padding (split by heads), whatever else is drawn
    case=dict(world_size=2, layout="auto", seq_len=13, width=4, scan=3, attention=True, padding=True, dtype="float64",
              dynamic=None, seed=1)
)  # fmt: skip
@example(  # and on 3 ranks, which do not divide its 4 heads: computed whole
    case=dict(world_size=3, layout="contiguous", seq_len=13, width=2, scan=5, attention=False, padding=False,
              dtype="float32", dynamic=None, seed=2)
)  # fmt: skip
def test_a_model_of_convolutions_and_cumsums_trains_exactly_and_sharded(pools, case):
    """Logits and every gradient by name against the model run whole, the sequence sharded, the state exchanged."""
    _check_model(pools, case)


@pytest.mark.heavy
@pytest.mark.timeout(3600)
@settings(max_examples=60, **SETTINGS)
@given(case=model_cases())
def test_many_drawn_models_of_convolutions_and_cumsums_train_exactly(pools, case):
    _check_model(pools, case)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chunk", [2, 3])
def test_a_scan_of_exactly_one_chunk_is_computed_whole_or_refused(pools, chunk):
    """A sequence exactly one chunk long: ``reshape(B, -1, N, ...)`` cuts nothing, the probe reads the chunk as the
    sequence, and the scan's decay matrix (sequence x sequence) then needs the whole sequence: the model runs whole on
    every rank, exactly (chunk 3), or an op inside the scan is refused with its line (chunk 2). Never a wrong answer;
    not sharded either (open: a reshape whose chunk is the whole length could be read as a cut)."""
    case = dict(world_size=2, layout="auto", seq_len=chunk, width=1, scan=chunk, attention=False, padding=False)
    case |= dict(dtype="float64", dynamic=None, seed=0)
    if chunk == 2:
        with pytest.raises(RankFailure, match=r"NotSupportedError: `mul` at .*mixer_workers.py"):
            pools.run(2, mixer_workers.conv_model_step, (case,), timeout=600)
        return
    for result in pools.run(2, mixer_workers.conv_model_step, (case,), timeout=600):
        assert result["logits"] <= 1e-12 and max(result["grads"].values()) <= 1e-12, result
        assert all(m["strategy"].startswith("computed whole on every rank (its") for m in result["mixers"]), result
        assert result["mixer_exchanges"] == 0, result  # nothing passes state: every mixer runs whole


STATIC_SCAN = "traced again with static shapes: a chunked scan"
VARIABLE_LENGTHS = [
    pytest.param("conv", None, [13, 17], id="split-automatic"),
    pytest.param("conv", True, [13, 17], id="split-dynamic", marks=pytest.mark.heavy),
    pytest.param("every", None, [13, 17, 22], id="state-automatic", marks=pytest.mark.heavy),
    pytest.param("every", True, [13, 17], id="state-dynamic", marks=pytest.mark.heavy),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model, dynamic, lengths", VARIABLE_LENGTHS)
def test_a_chunked_scan_under_dynamic_shapes_is_traced_again_static_at_each_length(pools, model, dynamic, lengths):
    """A model compiled once and trained at several lengths: the second length makes Dynamo trace it with a symbolic
    length (``dynamic=None``), or every trace is symbolic (``dynamic=True``). A chunked scan's loop over its chunks is
    unrolled at the traced count, so the backend has Dynamo trace the frame again with static shapes (the report says
    so) and each length gets a graph of its own: every step exact (logits and every gradient by name), sharded (local
    length), the scans split by heads or passing their state as at static shapes (exchanges counted)."""
    case = dict(model=model, dynamic=dynamic, lengths=lengths)
    steps = pools.run(2, mixer_workers.variable_length_steps, (case,), timeout=900)[0]
    for i, (n, step) in enumerate(zip(lengths, steps)):
        assert step["logits"] <= 1e-10 and max(step["grads"].values()) <= 1e-10, (n, step)
        assert step["local_len"][0] == step["local_len"][1] < n
        graphs = step["graphs"]
        assert [length for length, _, _ in graphs] == lengths[: i + 1]  # one graph per length, each static
        retraced = [any(STATIC_SCAN in n for n in notes) for _, notes, _ in graphs]
        assert retraced == [dynamic is True or j > 0 for j in range(i + 1)], graphs  # automatic: from the second on
        assert step["events"] == steps[0]["events"]  # the same exchanges at each length
    strategies = {kind.split("`")[1]: strategy for kind, strategy in steps[-1]["mixers"] if kind.startswith("`")}
    if model == "every":  # as at static shapes (torch 2.13 under dynamic=True: SSD split, see below)
        assert strategies["torch_chunk_gated_delta_rule"].startswith("state passing"), strategies
        if strategies["mamba2_chunk_scan"].startswith("state passing"):
            assert steps[0]["events"]["mixer_exchange"] == 5
        else:  # torch 2.13 passes dt_limit's floats as symbols under dynamic=True: the binding cannot read them
            assert dynamic and "no assignment of its values" in strategies["mamba2_chunk_scan"], strategies
            assert steps[0]["events"]["mixer_exchange"] == 4 and steps[0]["events"]["heads_exchange"] > 0
    else:
        assert steps[0]["events"]["heads_exchange"] == 12 and steps[0]["events"]["mixer_exchange"] == 6


@pytest.mark.heavy  # suite time: the same retrace under dynamic shapes runs by default (below)
@pytest.mark.timeout(600)
def test_a_chunked_scan_after_a_graph_break_is_traced_again_static_at_each_length(pools):
    """Attention, a graph break, then a chunked scan, under ``dynamic=True`` and ``outputs="sharded"``: the attention's
    graph serves both lengths (one compile, symbolic) and, as it ends at a graph break, carries its output sharded into
    the scan's graph (before: plain shards, which the scan's graph took as whole: a wrong answer with a warning) marked
    dynamic (a hint), which the static retrace takes off: the scan's graph is traced again static at each length.
    Every step exact and sharded."""
    case = dict(model="break", dynamic=True, lengths=[13, 17])
    steps = pools.run(2, mixer_workers.variable_length_steps, (case,), timeout=600)[0]
    for n, step in zip(case["lengths"], steps):
        assert step["logits"] <= 1e-10 and max(step["grads"].values()) <= 1e-10, (n, step)
        assert step["local_len"][0] == step["local_len"][1] < n
        assert step["events"]["heads_exchange"] == 6 and step["events"]["exchange"] == 4, step["events"]
    graphs = steps[-1]["graphs"]
    assert all(status == "rewritten" for _, _, status in graphs), graphs
    assert any("ends at a graph break: its outputs are carried" in n for n in graphs[0][1]), graphs
    assert [length for length, notes, _ in graphs if any(STATIC_SCAN in n for n in notes)] == case["lengths"]
    assert len(graphs) == 3  # the attention's graph once


def test_the_last_compile_dynamo_allows_warns_that_the_next_length_runs_unsharded(pools):
    """Each length compiles again (a chunked scan); with ``recompile_limit=2`` the second compile is the last, after
    which Dynamo would run the frame eagerly, unsharded: that compile's report warns, naming the limit and the ways
    out; the first does not."""
    case = dict(model="conv", dynamic=None, lengths=[13, 17], recompile_limit=2)
    first, second = pools.run(2, mixer_workers.variable_length_steps, (case,), timeout=600)[0]
    assert first["limit_warnings"] == [] and first["logits"] <= 1e-10
    assert len(second["limit_warnings"]) == 1 and second["logits"] <= 1e-10
    assert "compile 2 of its frame, torch._dynamo.config.recompile_limit = 2" in second["limit_warnings"][0]
    assert "fail_on_recompile_limit_hit" in second["limit_warnings"][0]


@pytest.mark.heavy  # suite time
def test_a_chunked_scan_under_a_length_marked_dynamic_is_refused_naming_it(pools):
    """The user's ``mark_dynamic`` wins over a static mark, so the frame cannot be traced again with static shapes:
    refused with the reshape's line, the input and what to do (before any of this: the scan ran as per-token ops and
    the backend's own check failed on a size mismatch)."""
    refused = (
        r"(?s)NotSupportedError: `reshape` at .*fp64_scans.py.* cuts the sequence into chunks.*"
        r"keeps dims \[1\] of `ids` symbolic \(marked dynamic.*take the mark off"
    )
    case = dict(model="every", dynamic=None, lengths=[13], mark_dynamic=True)
    with pytest.raises(RankFailure, match=refused):
        pools.run(2, mixer_workers.variable_length_steps, (case,), timeout=600)


class CenteredConv(nn.Module):
    """A convolution over the sequence that reads the tokens after each token too (padding on both sides)."""

    def __init__(self):
        super().__init__()
        self.embed, self.conv = nn.Embedding(11, 4), nn.Conv1d(4, 4, 3, groups=4, padding=1)

    def forward(self, ids):
        x = self.embed(ids)
        q = x.unsqueeze(1)
        x = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


def test_a_convolution_that_reads_later_tokens_is_refused_with_its_source_line():
    report = ringpass.inspect(CenteredConv(), torch.randint(0, 11, (2, 16)), world_size=2).reports[0]
    assert report.status == "refused" and report.refusal.op.startswith("conv1d")
    assert (
        "test_sequence_mixers.py" in report.refusal.source and "causal depthwise convolutions" in report.refusal.message
    )
    assert "self.conv(x.transpose(1, 2))" in report.refusal.message  # the user's line, in the message too


def test_inspect_lists_each_mixer_with_its_strategy_and_bytes():
    model = mixer_workers.ConvNet(29, 8, 4, attention=False)
    report = ringpass.inspect(model, torch.randint(0, 29, (2, 64)), world_size=4).reports[0]
    text = str(report)
    assert "sequence mixers" in text and "causal depthwise conv1d, width 4, 8 channels" in text
    assert report.status == "rewritten" and report.layout == "contiguous"
    # the halo: 3 tokens x 8 channels x batch 2 x 4 bytes from the one chunk a rank holds, whatever the length
    assert [m.bytes_per_call for m in report.mixers] == [3 * 8 * 2 * 4] * 2 + [8 * 2 * 4] * 2


class ConvBeforeARunningProduct(nn.Module):
    """A causal convolution whose output a running product reads before the first attention (RecurrentGemma's
    convolution before its unrolled recurrence): both are computed whole on every rank, the attention is the ring."""

    def __init__(self):
        super().__init__()
        self.embed, self.conv = nn.Embedding(11, 4), nn.Conv1d(4, 4, 3, groups=4, padding=2)

    def forward(self, ids):
        x = self.conv(self.embed(ids).transpose(1, 2))[..., : ids.shape[1]].transpose(1, 2)
        q = torch.sigmoid(x).cumprod(1).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_convolution_whose_output_is_needed_whole_is_computed_whole():
    report = ringpass.inspect(ConvBeforeARunningProduct(), torch.randint(0, 11, (2, 16)), world_size=2).reports[0]
    assert report.status == "rewritten" and len(report.attention) == 1
    (mixer,) = report.mixers
    assert mixer.strategy == "computed whole on every rank (its input is needed whole)" and mixer.bytes_per_call == 0
    assert any("cumprod" in name for name in report.computed_whole), report.computed_whole


@pytest.mark.parametrize(
    "heads,head_dim,seq_len,world_size,strategy,collectives",
    [
        # a multiple of the chunk (the reshape cuts the sequence), or padded; at P = 2 and 4. Exchanged: the hidden
        # states and dt (this rank's tokens of every head for every token of its heads) and the output back;
        # all-gathered: B and C (one group for all heads), their gradient all-reduced in the backward
        (6, 4, 24, 2, "split by heads: every token of 3 of its 6 heads", (3, 2, 2)),
        pytest.param(
            6, 4, 13, 2, "split by heads: every token of 3 of its 6 heads", (3, 2, 2), marks=pytest.mark.heavy
        ),
        (4, 6, 13, 4, "split by heads: every token of 1 of its 4 heads", (3, 2, 2)),
        # 3 heads of 5 features over 2 ranks: neither divides, so it runs whole, its four per-token inputs all-gathered
        (3, 5, 13, 2, "computed whole on every rank: its per-token inputs all-gathered, its outputs sharded again "
         "(not split by heads: 3 does not divide by 2 ranks; 5 does not divide by 2 ranks)", (0, 4, 0)),
        # 24 tokens in chunks of 8, padded by one chunk inside the scan's decay: 4 chunks as the 4 heads (ambiguous)
        (4, 3, 24, 2, "computed whole on every rank: its per-token inputs all-gathered, its outputs sharded again "
         "(not split by heads: split into 4 heads, `ones` makes 2 dims of size 4; 3 does not divide by 2 ranks)",
         (0, 4, 0)),
    ],
)  # fmt: skip
def test_a_chunked_scan_in_a_function_of_its_own_is_split_by_heads_or_computed_whole(
    heads, head_dim, seq_len, world_size, strategy, collectives
):
    """Mamba2 (no attention; its short convolution passes state): its SSD cuts the sequence into chunks of 8 and
    carries a state across them; its function call, ``mamba2_chunk_scan``, runs on every token of a share of its heads
    on each rank where the heads divide by P and nothing else in it is as many, else whole on every rank; everything
    around it stays sharded. The report says which, and why not split."""
    import transformers

    config = transformers.Mamba2Config(
        vocab_size=64, hidden_size=heads * head_dim, expand=1, state_size=8, num_heads=heads, head_dim=head_dim,
        n_groups=1, num_hidden_layers=1, conv_kernel=4, chunk_size=8,
    )  # fmt: skip
    model = transformers.Mamba2ForCausalLM(config)
    kwargs = {"input_ids": torch.randint(0, 64, (2, seq_len)), "use_cache": False}
    report = ringpass.inspect(model, kwargs, world_size=world_size).reports[0]
    assert report.status == "rewritten", report.refusal
    conv, scan = report.mixers
    assert conv.strategy.startswith("state passing"), conv
    assert scan.kind.startswith("`mamba2_chunk_scan`: ") and "modeling_mamba2.py" in scan.source + scan.module, scan
    assert scan.strategy.startswith(strategy) and scan.bytes_per_call > 0, scan
    kinds = [(c.kind, c.phase) for c in report.collectives if "mamba2_chunk_scan" in c.what]
    counts = tuple(
        kinds.count(k) for k in [("all-to-all", "forward"), ("all-gather", "forward"), ("all-reduce", "backward")]
    )
    assert counts == collectives, report.collectives
    assert [i.placement for i in report.inputs if i.name == "input_ids"] == ["sharded"]


def test_a_scan_split_by_heads_whose_output_is_also_read_whole_is_exact(pools):
    """The scan's output goes back to this rank's tokens for the attention's shard, and is all-gathered for the flip."""
    for result in pools.run(2, mixer_workers.scan_read_whole_step, (), timeout=300):
        assert max(result["outputs"]) <= 1e-12 and max(result["grads"].values()) <= 1e-12, result
        assert result["mixers"][0].startswith("split by heads: every token of 2 of its 4 heads"), result
        assert result["heads_exchanges"] == 6, result  # x and its decays in, the output out; forward and backward


@pytest.mark.heavy  # suite time
def test_a_converted_model_with_a_scan_split_by_heads_saves_loads_and_trains_exactly(pools, tmp_path):
    for result in pools.run(2, mixer_workers.converted_scan_step, (str(tmp_path),), timeout=300):
        assert result["logits"] <= 1e-12 and max(result["grads"].values()) <= 1e-12, result
        assert result["heads_exchanges"] == 12, result  # two scans: x and its decays in, the output out, both ways


@pytest.mark.timeout(600)
def test_a_converted_model_passing_a_scans_state_saves_loads_and_trains_exactly(pools, tmp_path):
    """``ringpass.convert(..., scans="state")``: the call of Hugging Face's delta rule bound and passed its state in the
    saved artifact too (the function named by its module, imported again when it runs)."""
    for rank, result in enumerate(pools.run(2, mixer_workers.converted_state_step, (str(tmp_path),), timeout=600)):
        assert result["output"] <= 1e-4 and max(result["grads"].values()) <= 1e-4, (rank, result)
        assert len(result["grads"]) == 4 and result["summaries"] == 1, (rank, result)


@pytest.mark.heavy  # suite time
def test_converting_a_chunked_scan_for_every_length_is_refused_naming_it():
    """``ringpass.convert(..., dynamic=True)`` promises one artifact for every length, which a chunked scan (its loop
    over its chunks unrolled at the traced count) cannot keep: refused with the reshape's line, not converted at the
    example's length only (the backend's answer, tracing again with static shapes, is no answer here)."""
    model = mixer_workers.ConvNet(29, 8, 3, attention=True, scan_chunk=3).double()
    ids = torch.randint(0, 29, (2, 13))
    with pytest.raises(ringpass.NotSupportedError, match=r"`reshape` at .*mixer_workers.py.* cuts the sequence into"):
        ringpass.convert(model, (ids,), world_size=2, dynamic=True)
    assert ringpass.convert(model, (ids,), world_size=2).report.reports[0].mixers  # static: converts


@st.composite
def every_mixer_kind_cases(draw) -> dict:
    """`mixer_workers.EveryMixerKind` and how it is compiled: the ring size, layout, length, the scans' chunk (never the
    whole length, nor 4 chunks or a padded length of 4: as many as the heads, which are then ambiguous), each scan
    split by heads or passed its state, dtype."""
    seq_len = draw(st.integers(6, 30))
    chunk = draw(st.sampled_from([2, 3, 5, 8]).filter(lambda c: c != seq_len and 4 not in (-(-seq_len // c), c)))
    return dict(
        world_size=draw(st.sampled_from([2, 3, 4])),
        layout=draw(st.sampled_from(["auto", "zigzag", "contiguous"])),
        seq_len=seq_len,
        chunk=chunk,
        scans=draw(st.sampled_from(["heads", "state"])),
        dtype=draw(st.sampled_from(["float64", "float64", "float32"])),
        ulysses=1,
        seed=draw(st.integers(0, 2**16)),
    )


def _check_every_mixer_kind(pools, case: dict) -> None:
    results = pools.run(case["world_size"], mixer_workers.every_mixer_kind_step, (case,), timeout=600)
    p = case["world_size"]
    chunks = p * (1 if case["layout"] == "contiguous" else 2)  # auto: zigzag (the attention is causal)
    passing = "state passing: each of this rank's chunks scanned from the state the chunks before it leave"
    split = f"split by heads: every token of {4 // p} of its 4 heads"
    scans = passing if case["scans"] == "state" else split if 4 % p == 0 else "computed whole on every rank"
    # conv halo (forward and backward) and cumsum totals, each scan's summaries; split: the delta rule's 5 per-token
    # inputs and output, the SSD's x, dt and output each way (B and C, one group, all-gathered); whole: every per-token
    # input all-gathered and each output's gradient
    events = {
        passing: {"mixer_exchange": 5, "heads_exchange": 0, "all_gather": 0},
        split: {"mixer_exchange": 3, "heads_exchange": 18, "all_gather": 2},
    }.get(scans, {"mixer_exchange": 3, "heads_exchange": 0, "all_gather": 11})
    for rank, result in enumerate(results):
        bound = TOLERANCE[case["dtype"]]
        assert result["logits"] <= bound, (rank, case, result)
        assert len(result["grads"]) == 18 and max(result["grads"].values()) <= bound, (rank, case, result["grads"])
        assert result["local_len"] == -(-case["seq_len"] // chunks) * chunks // p, (rank, case, result)
        strategies = [strategy for _, strategy in result["mixers"]]
        assert strategies[0].startswith("state passing: the last 2 token(s)") and strategies[1].startswith(
            "state passing: each chunk's total"
        ), (rank, case, result["mixers"])
        assert all(s.startswith(scans) for s in strategies[2:]) and len(strategies) == 4, (rank, case, strategies)
        got = {kind: result["events"].get(kind, 0) for kind in events}
        assert got == events and result["events"]["exchange"] > 0, (rank, case, result["events"])


@pytest.mark.timeout(900)
@settings(max_examples=1, phases=[Phase.explicit], **SETTINGS)  # suite time: the drawn ones are heavy, below
@given(case=every_mixer_kind_cases())
@example(  # fp64 through both scans passing their state, zigzag, padded (split by heads: the heavy draws, ConvNet)
    case=dict(world_size=2, layout="auto", seq_len=23, chunk=5, scans="state", dtype="float64", ulysses=1, seed=0)
)  # fmt: skip
def test_every_kind_of_mixer_trains_exactly_under_each_strategy(pools, case):
    """A causal convolution, a cumsum, the gated delta rule and Mamba2's SSD (`fp64_scans`: the known names, in the
    inputs' dtype) and attention in one model: logits and every gradient by name against the model run whole (fp64
    to 1e-10), sharded (local lengths), each scan split by heads, computed whole or passed its state as asked, the
    exchanges of each counted."""
    _check_every_mixer_kind(pools, case)


@pytest.mark.heavy
@pytest.mark.timeout(3600)
@settings(max_examples=30, **SETTINGS)
@given(case=every_mixer_kind_cases())
def test_many_drawn_models_of_every_mixer_kind_train_exactly(pools, case):
    _check_every_mixer_kind(pools, case)


@pytest.mark.timeout(900)
@pytest.mark.heavy  # suite time (22 s): Ulysses runs by default through strategy="auto" (test_strategy_ranks)
@pytest.mark.parametrize("scans", ["state", "heads"])
def test_every_kind_of_mixer_runs_over_every_rank_under_ulysses_x_ring(pools, scans):
    """Ulysses x ring (4 ranks, groups of 2): the attention all-to-alls its heads inside a group, the mixers still
    see one sequence over the 4 ranks: convolution and cumsum pass their state, the scans pass theirs (or split by
    heads over the 4 ranks), exact."""
    case = dict(world_size=4, layout="auto", seq_len=21, chunk=3, scans=scans, dtype="float64", ulysses=2, seed=2)
    strategy = "state passing: each of this rank's chunks" if scans == "state" else "split by heads: every token of 1"
    for rank, result in enumerate(pools.run(4, mixer_workers.every_mixer_kind_step, (case,), timeout=900)):
        assert result["logits"] <= 1e-10 and max(result["grads"].values()) <= 1e-10, (rank, result)
        assert result["local_len"] == 6 and len(result["grads"]) == 18, (rank, result)  # 21 padded to 24, zigzag
        assert [s.startswith(strategy) for _, s in result["mixers"]] == [False, False, True, True], result["mixers"]
        # the convolution's halo both ways and the cumsum's totals, each scan's summaries where they pass their state
        assert result["events"]["mixer_exchange"] == (5 if scans == "state" else 3), (rank, result["events"])


def test_a_chunked_scan_with_sharded_inputs_is_refused_naming_it():
    """inputs='sharded': the graph is traced at a rank's length, so the call's sizes are not the whole sequence's."""
    import transformers

    config = transformers.Mamba2Config(
        vocab_size=64, hidden_size=32, state_size=8, num_heads=4, head_dim=16, n_groups=1, num_hidden_layers=1,
        conv_kernel=4, chunk_size=4,
    )  # fmt: skip
    model = transformers.Mamba2ForCausalLM(config)
    kwargs = {"input_ids": torch.randint(0, 64, (2, 12)), "use_cache": False}
    report = ringpass.inspect(model, kwargs, world_size=2, inputs="sharded").reports[0]
    assert report.status == "refused" and "`mamba2_chunk_scan`" in report.refusal.message, report.refusal
    assert "inputs='full'" in report.refusal.message and "modeling_mamba2.py" in report.refusal.source


class InlineScan(nn.Module):
    """`mixer_workers.chunked_decay_scan` written out in the model's own forward (no function call around it)."""

    def __init__(self):
        super().__init__()
        self.embed, self.decay = nn.Embedding(11, 4), nn.Linear(4, 1)

    def forward(self, ids):
        x = self.embed(ids)
        b, n, d = x.shape
        cum = F.pad(-F.softplus(self.decay(x)), (0, 0, 0, 3 - n % 3)).reshape(b, -1, 3).cumsum(2)
        q = (x + cum.flatten(1)[:, :n, None]).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_chunked_scan_outside_any_function_call_is_refused_with_its_line():
    report = ringpass.inspect(InlineScan(), (torch.randint(0, 11, (2, 10)),), world_size=2).reports[0]
    assert report.status == "refused" and report.refusal.op.startswith("reshape"), report.refusal
    assert "test_sequence_mixers.py" in report.refusal.source, report.refusal
    assert "a chunked scan" in report.refusal.message and "function call of its own" in report.refusal.message


def test_mixers_of_a_value_needed_whole_run_whole_and_exactly(pools):
    """A cumsum and a convolution of a value a flip needs whole: computed whole on every rank, sharded after them (they
    once ran as plain ops on one rank's shard: wrong)."""
    for rank, result in enumerate(pools.run(2, mixer_workers.whole_input_mixers, ("aot_eager",), timeout=300)):
        assert max(result["outputs"]) <= 1e-10 and max(result["grads"].values()) <= 1e-10, (rank, result)
        assert result["mixers"] == ["computed whole on every rank (its input is needed whole)"] * 2, result
        assert result["kv_exchanges"] > 0


@pytest.mark.heavy  # suite time (README, "Heavier cases")
@pytest.mark.timeout(900)
def test_inductor_compiles_the_mixers_ops(pools):
    """Inductor checks each op's strides against its fake: a convolution over a transposed input included."""
    for rank, result in enumerate(pools.run(2, mixer_workers.inductor_step, (), timeout=900)):
        assert result["logits"] <= 1e-4 and max(result["grads"].values()) <= 1e-4, (rank, result)
        assert result["mixer_exchanges"] == 6


class SideConvolution(nn.Module):
    """Attention over the tokens, and a causal convolution over a side input of another length (no sequence)."""

    def __init__(self):
        super().__init__()
        self.embed, self.conv = nn.Embedding(11, 4), nn.Conv1d(4, 4, 3, groups=4, padding=2)

    def forward(self, ids, side):
        q = self.embed(ids).unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out, self.conv(side)[..., : side.shape[-1]]


def test_a_convolution_over_something_else_than_the_sequence_is_left_alone():
    report = ringpass.inspect(SideConvolution(), (torch.randint(0, 11, (2, 16)), torch.randn(2, 4, 8)), world_size=2)
    assert report.reports[0].status == "rewritten" and report.reports[0].mixers == []


class CumsumInAnotherDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)

    def forward(self, ids):
        x = self.embed(ids).to(torch.bfloat16)
        q = torch.cumsum(x, dim=1, dtype=torch.float32).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_cumsum_accumulated_in_another_dtype_is_not_passed_state():
    """``cumsum(x, dtype=float32)`` of bf16 values: not a mixer (the op would lose the dtype); computed whole."""
    report = ringpass.inspect(CumsumInAnotherDtype(), torch.randint(0, 11, (2, 16)), world_size=2).reports[0]
    assert report.status == "rewritten" and report.mixers == []
    assert any("`cumsum`" in name for name in report.computed_whole), report.computed_whole


def test_each_rank_passing_its_own_batch_trains_exactly(pools):
    """``inputs="per_rank"``: the ranks' batches form the global batch, whose sequence the mixers run sharded, the
    scans passing their state."""
    for rank, result in enumerate(pools.run(2, mixer_workers.per_rank_step, (), timeout=600)):
        assert result["output"] <= 1e-10 and max(result["grads"].values()) <= 1e-10, (rank, result)
        assert len(result["grads"]) == 18, (rank, result)
        assert all(m.startswith("state passing") for m in result["mixers"]) and len(result["mixers"]) == 4, result
        # the graph runs once per rank's batch: the convolution's halo both ways, the cumsum's totals, each scan's
        # summaries
        assert (result["mixer_exchanges"], result["heads_exchanges"]) == (2 * 5, 0), (rank, result)
