"""One focused test per pass of `ringpass.passes.PIPELINE` that no other test names: a tiny model captured by
Dynamo, the pipeline run on its graph up to and including the pass (offline, 2 ranks, no process group), and
what that pass writes (nodes, their arguments, `PassContext` fields, report records) checked against what the
model computes. Tested elsewhere: `record_gradient_paths`, `inline_subgraphs` and `check_gradient_paths`
(test_gradient_paths.py), `globalize_sharded_lengths` (test_sharded_lengths.py), `keep_cache_sharded`
(test_generation.py: the slots each rank holds, and its refusals)."""

import dataclasses
import math
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mixer_workers import DeltaRuleScan, ScanReadWhole, chunked_decay_scan
from torch import fx

import ringpass.passes as passes
from lowering import Layout, sequence_ops
from lowering.costmodel import Hardware
from lowering.state_passing import scan_region
from ringpass.fx.context import FULL, HEADS, LOCAL, NOSEQ, PARTIAL, PassContext
from ringpass.fx.findings import HeadSplit, MaskFindings, ScanBinding, SeqDim, SequenceFindings
from ringpass.fx.nodes import example_value
from ringpass.fx.report import Report
from ringpass.options import RingOptions
from ringpass.passes.spell_properties_as_attributes import spell_properties_as_attributes

SEQ = 11  # zigzag on 2 ranks pads it to 12: 6 slots per rank
RING = torch.ops.ringpass


def run_through(pass_name: str, model: nn.Module, *inputs, dynamic=None, **options) -> tuple[PassContext, dict]:
    """The context after ``model``'s captured graph went through `passes.PIPELINE` up to ``pass_name``, and a copy
    of its fields from just before that pass, with the graph's nodes as (op, target) pairs (``"nodes"``) and
    their arguments (``"args"``)."""
    found = {}

    def backend(gm, example_inputs):
        captured = fx.Graph()  # a copy the passes leave alone: what the compiled model runs
        captured.output(captured.graph_copy(gm.graph, {}))
        ctx = PassContext(gm, example_inputs, RingOptions.from_dict(options), 2, "", Report(world_size=2))
        *earlier, tested = passes.PIPELINE[: [p.__name__ for p in passes.PIPELINE].index(pass_name) + 1]
        for run_pass in earlier:
            run_pass(ctx)
        found["before"] = {
            **{name: _copy(value) for name, value in vars(ctx).items()},
            "nodes": _nodes(gm),
            "args": [node.args for node in gm.graph.nodes],
        }
        tested(ctx)
        found["ctx"] = ctx
        return fx.GraphModule(gm, captured)

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    return found["ctx"], found["before"]


def _copy(value):
    """A copy that a pass changing ``value`` in place leaves alone (containers, and findings records)."""
    if isinstance(value, (MaskFindings, SequenceFindings)):
        return dataclasses.replace(value, **{f.name: _copy(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return type(value)(value) if isinstance(value, (dict, set, list)) else value


def _nodes(gm) -> list:
    return [(node.op, node.target) for node in gm.graph.nodes]


def _names(nodes: list) -> list[str]:
    return [target if isinstance(target, str) else getattr(target, "__name__", "") for _, target in nodes]


def _calls(ctx: PassContext, target) -> list:
    return [node for node in ctx.gm.graph.nodes if node.target == target]


def _run_graph(ctx: PassContext):
    """The graph as the pass left it, run on the captured inputs (passes before the shard stage keep it whole)."""
    ctx.gm.recompile()
    return ctx.gm(*ctx.example_inputs)


class Heads(nn.Module):
    """q, k, v of ``[B, S, 8]``: two heads of 4 (``kv_heads=1``: one key-value head for both)."""

    def __init__(self, kv_heads: int = 2):
        super().__init__()
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 8 * kv_heads)
        self.kv_heads = kv_heads

    def forward(self, x):
        b, s, _ = x.shape
        k, v = self.kv(x).view(b, s, self.kv_heads, 8).transpose(1, 2).split(4, -1)
        return self.q(x).view(b, s, 2, 4).transpose(1, 2), k, v


def _tokens(y):
    return y.transpose(1, 2).flatten(2)


class Sdpa(nn.Module):
    """One SDPA: causal, or with the mask ``mask(x)`` builds; ``scale``: a float attribute of the model."""

    def __init__(self, causal=True, mask=None, kv_heads=2, scale=None):
        super().__init__()
        self.heads, self.causal, self.mask, self.scale = Heads(kv_heads), causal, mask, scale

    def forward(self, x):
        q, k, v = self.heads(x)
        mask = self.mask(x) if self.mask is not None else None
        return _tokens(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=self.causal and mask is None,
                scale=self.scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        )


def _x():
    return torch.randn(2, SEQ, 8, generator=torch.Generator().manual_seed(0))


def test_pin_model_numbers_writes_a_float_attribute_as_its_number():
    ctx, before = run_through("pin_model_numbers", Sdpa(scale=0.3), _x(), dynamic=True)
    assert ("call_method", "item") in before["nodes"]
    assert ("call_method", "item") not in _nodes(ctx.gm)
    (attention,) = _calls(ctx, F.scaled_dot_product_attention)
    assert attention.kwargs["scale"] == 0.3


class MultiHead(nn.Module):
    """``nn.MultiheadAttention`` over a sequence-first input, with a causal float mask."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, x):
        return self.attention(
            x,
            x,
            x,
            need_weights=False,
            attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[0]),
            is_causal=True,
        )[0]


def test_expand_multi_head_attention_writes_the_projections_and_one_sdpa():
    model, x = MultiHead(), _x().transpose(0, 1)
    ctx, before = run_through("expand_multi_head_attention", model, x)
    assert ("call_function", F.multi_head_attention_forward) in before["nodes"]
    assert ("call_function", F.multi_head_attention_forward) not in _nodes(ctx.gm)
    (attention,) = _calls(ctx, F.scaled_dot_product_attention)
    assert list(example_value(attention.args[0]).shape) == [2, 2, SEQ, 4]  # [B, H, L, E/H]
    (out,) = _run_graph(ctx)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def _vmapped_causal(x):
    i = torch.arange(x.shape[1])
    return torch.vmap(torch.vmap(lambda q, k: k <= q, in_dims=(None, 0)), in_dims=(0, None))(i, i)


def test_devectorize_vmaps_writes_the_nest_as_broadcasting():
    model = Sdpa(mask=_vmapped_causal)
    ctx, before = run_through("devectorize_vmaps", model, _x())
    assert _names(before["nodes"]).count("_vmap_increment_nesting") == 2
    assert not {"_vmap_increment_nesting", "_add_batch_dim", "_remove_batch_dim", "_vmap_decrement_nesting"} & set(
        _names(_nodes(ctx.gm))
    )
    assert "expand" in _names(_nodes(ctx.gm))
    (out,) = _run_graph(ctx)
    torch.testing.assert_close(out, model(_x()))


class HandWritten(nn.Module):
    """``softmax(q kᵀ / 2 + mask) v`` with an additive causal mask, next to a GQA SDPA."""

    def __init__(self):
        super().__init__()
        self.heads, self.gqa = Heads(), Heads(kv_heads=1)

    def forward(self, x):
        q, k, v = self.heads(x)
        i = torch.arange(x.shape[1])
        hidden = torch.zeros(x.shape[1], x.shape[1]).masked_fill(i[None, :] > i[:, None], float("-inf"))
        y = torch.softmax(q @ k.transpose(-2, -1) / 2 + hidden, dim=-1) @ v
        q, k, v = self.gqa(_tokens(y))
        return _tokens(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def test_find_attention_matches_an_sdpa_and_a_hand_written_attention():
    ctx, _ = run_through("find_attention", HandWritten(), _x())
    hand, sdpa = sorted(ctx.attention, key=lambda match: match.spelling)
    (call,) = _calls(ctx, F.scaled_dot_product_attention)
    assert (sdpa.spelling, sdpa.output, sdpa.is_causal, sdpa.scale) == ("sdpa", call, True, None)
    assert (sdpa.query, sdpa.key, sdpa.value) == tuple(call.args[:3])
    (softmax,) = _calls(ctx, torch.softmax)
    assert (hand.spelling, hand.scale, hand.is_causal) == ("hand-written", 0.5, False)
    assert hand.output.args[0] is softmax and softmax in hand.internal  # probabilities @ v
    assert hand.mask[0] == "additive" and list(example_value(hand.mask[1]).shape) == [SEQ, SEQ]
    assert [list(example_value(node).shape) for node in (hand.query, hand.key, hand.value)] == [[2, 2, SEQ, 4]] * 3


class PaddedAndCausal(nn.Module):
    """Two SDPAs: one masked by index comparisons alone (causal), one by them and a key padding input."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Heads(), Heads()

    def forward(self, x, keep):
        i = torch.arange(x.shape[1])
        causal = i[None, :] <= i[:, None]
        y = _tokens(F.scaled_dot_product_attention(*self.first(x), attn_mask=causal))
        return _tokens(F.scaled_dot_product_attention(*self.second(y), attn_mask=causal & keep[:, None, None, :]))


def _keep():
    keep = torch.rand(2, SEQ, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[:, 0] = True
    return keep


def test_lift_masks_reads_a_causal_mask_as_the_flag_and_lifts_a_padding_mask_as_a_program():
    ctx, _ = run_through("lift_masks", PaddedAndCausal(), _x(), _keep())
    causal, padded = ctx.attention
    keep, (arange,) = _placeholder(ctx, "keep"), _calls(ctx, torch.arange)
    plan = ctx.masks.plans[causal.output]
    assert (plan.is_causal, plan.window, plan.program_id, plan.inputs) == (True, None, "", [])
    plan = ctx.masks.plans[
        padded.output
    ]  # the program reads the positions and the padding; the causal part is the flag
    assert plan.is_causal and plan.program_id.startswith("mask-") and plan.inputs == [arange, keep]
    assert {causal.mask[1], padded.mask[1]} <= ctx.masks.lifted and {arange, keep} <= ctx.masks.whole_values


class RestoredOrder(nn.Module):
    """Tokens sorted by a router's choice, transformed, and put back with the inverse permutation written
    with ``index_put`` (Hugging Face's mixture of experts), after an attention."""

    def __init__(self):
        super().__init__()
        self.attention, self.router, self.expert = Sdpa(), nn.Linear(8, 3), nn.Linear(8, 8)

    def forward(self, x):
        h = self.attention(x).flatten(0, 1)
        perm = self.router(h).argmax(-1).argsort(stable=True)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return self.expert(h[perm])[inverse].view(x.shape)


def test_invert_permutations_writes_the_inverse_as_an_argsort():
    model = RestoredOrder()
    ctx, before = run_through("invert_permutations", model, _x())
    assert _names(_nodes(ctx.gm)).count("argsort") == _names(before["nodes"]).count("argsort") + 1
    assert not any("index_put" in str(target) or target is torch.empty_like for _, target in _nodes(ctx.gm))
    (out,) = _run_graph(ctx)
    torch.testing.assert_close(out, model(_x()))


class Positions(nn.Module):
    """Token ids, a position table sliced to the length, RoPE-like angles from an arange, a causal SDPA, a
    running sum of a per-token input, and the mean over the tokens."""

    def __init__(self):
        super().__init__()
        self.embed, self.table, self.attention = nn.Embedding(50, 8), nn.Parameter(torch.randn(32, 8)), Sdpa()

    def forward(self, ids, segments):
        n = ids.shape[1]
        angles = torch.arange(n)[:, None] * torch.ones(8)
        h = self.embed(ids) + self.table[:n] + angles.sin() + segments.cumsum(1)[..., None]
        y = self.attention(h)
        return y, y.mean(1)


def _ids():
    return torch.randint(0, 50, (2, SEQ), generator=torch.Generator().manual_seed(0)), torch.ones(2, SEQ)


def _placeholder(ctx: PassContext, name: str):
    return next(node for node in ctx.gm.graph.nodes if node.op == "placeholder" and name in node.name)


def test_find_sequence_axes_finds_the_length_the_axes_and_where_they_come_from():
    ctx, _ = run_through("find_sequence_axes", Positions(), *_ids())
    ids, segments = _placeholder(ctx, "ids"), _placeholder(ctx, "segments")
    (arange,) = _calls(ctx, torch.arange)
    (cumsum,) = [node for node in ctx.gm.graph.nodes if node.target == "cumsum"]
    (mean,) = [node for node in ctx.gm.graph.nodes if node.target == "mean"]
    assert (ctx.sequence.seq_len, ctx.sequence.global_seq_len) == (SEQ, SEQ)
    assert ctx.sequence.axes[ids] == ctx.sequence.axes[segments] == ctx.sequence.axes[cumsum] == (
        SeqDim(1),
    ) and ctx.sequence.axes[arange] == (SeqDim(0),)
    assert (ctx.sequence.sources[ids], ctx.sequence.sources[arange]) == ("input", "positions")
    assert set(ctx.sequence.mixing) == {cumsum} and ctx.sequence.reductions == {mean: "mean"}
    assert all(not ctx.sequence.axes.get(p) for p in ctx.gm.graph.nodes if p.op == "placeholder" and "weight" in p.name)


class WritesAndSolves(nn.Module):
    """A feature slice written into every token, a 2 x 2 triangular system solved per token, attention, then one
    token overwritten."""

    def forward(self, x):
        b, n = x.shape[:2]
        y = torch.zeros_like(x)
        y[:, :, :4] = x[:, :, :4]
        system = torch.eye(2) + x[..., :4].reshape(b, n, 2, 2).tril(-1)
        solved = torch.linalg.solve_triangular(system, x[..., 4:].reshape(b, n, 2, 2), upper=False)
        q = (y + solved.flatten(2).repeat(1, 1, 2))[:, None]
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out[:, :, 0] = 0
        return out


def test_find_sequence_axes_reads_writes_and_solves_per_token_and_a_write_into_one_token_as_mixing():
    ctx, _ = run_through("find_sequence_axes", WritesAndSolves(), _x())
    writes = [node for node in ctx.gm.graph.nodes if node.target is operator.setitem]
    (solve,) = [node for node in ctx.gm.graph.nodes if "solve_triangular" in str(node.target)]
    assert len(writes) == 2 and writes[0] not in ctx.sequence.mixing and solve not in ctx.sequence.mixing
    assert ctx.sequence.mixing.get(writes[1]) == "it writes into some tokens only", ctx.sequence.mixing


@pytest.mark.parametrize(
    "model,options,layout",
    [
        (Sdpa(), {}, "zigzag"),  # causal: balanced over the ranks
        (Sdpa(causal=False), {}, "contiguous"),
        (Sdpa(causal=False), {"inputs": "sharded"}, "zigzag"),  # what ringpass.shard gives by default
        (Sdpa(), {"layout": "contiguous"}, "contiguous"),
    ],
    ids=["causal", "unmasked", "unmasked-sharded-inputs", "causal-as-asked"],
)
def test_choose_layout(model, options, layout):
    ctx, before = run_through("choose_layout", model, _x(), **options)
    assert (before["layout_kind"], ctx.layout_kind) == ("", layout)


class SortedExperts(nn.Module):
    """After an attention, each token's expert chosen by a router: tokens gathered in expert order, each
    projected, and put back in token order."""

    def __init__(self):
        super().__init__()
        self.attention, self.router, self.expert = Sdpa(), nn.Linear(8, 3), nn.Linear(8, 8)

    def forward(self, x):
        h = self.attention(x)
        perm = self.router(h).argmax(-1).flatten().argsort(stable=True)
        return self.expert(h.flatten(0, 1)[perm])[perm.argsort()].view(x.shape)


def test_find_local_permutations_takes_a_sort_undone_again_off_the_mixing_ops():
    ctx, before = run_through("find_local_permutations", SortedExperts(), _x())
    sorts = [node for node in ctx.gm.graph.nodes if node.target in ("argsort", torch.argsort)]
    assert len(sorts) == 2 and set(sorts) <= set(before["sequence"].mixing)
    assert not set(sorts) & set(ctx.sequence.mixing), ctx.sequence.mixing


def test_decide_placements_places_every_value_and_reports_the_inputs():
    ctx, _ = run_through("decide_placements", Positions(), *_ids())
    (cumsum,) = [node for node in ctx.gm.graph.nodes if node.target == "cumsum"]
    (mean,) = [node for node in ctx.gm.graph.nodes if node.target == "mean"]
    (attention,) = _calls(ctx, F.scaled_dot_product_attention)
    placement = {name: ctx.placement[_placeholder(ctx, name)] for name in ("ids", "segments", "table", "embed")}
    assert placement == {"ids": LOCAL, "segments": FULL, "table": NOSEQ, "embed": NOSEQ}
    assert (ctx.placement[cumsum], ctx.placement[attention], ctx.placement[mean]) == (FULL, LOCAL, PARTIAL)
    inputs = {value.name: (value.placement, value.why) for value in ctx.report.inputs}
    assert inputs["ids"] == ("sharded", "") and inputs["segments"][0] == "whole"
    assert "cumsum" in inputs["segments"][1], inputs


class HeadScan(nn.Module):
    """`chunked_decay_scan` (chunks of 5: 11 tokens make 3, padded to 15) over ``heads`` heads of 2 features, then
    causal attention (a graph whose only sequence mixer is a scan has no length to shard yet)."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.proj, self.decay, self.heads = nn.Linear(8, 2 * heads), nn.Linear(8, heads), heads

    def forward(self, x):
        y = chunked_decay_scan(self.proj(x).unflatten(-1, (self.heads, 2)), -F.softplus(self.decay(x)), 5)
        y = y.flatten(2)[:, None]
        return F.scaled_dot_product_attention(y, y, y, is_causal=True)


def test_find_region_heads_probes_the_scan_at_a_share_of_its_heads():
    ctx, _ = run_through("find_region_heads", HeadScan(), _x())
    (region,) = ctx.sequence.regions
    split = ctx.sequence.heads[region]
    assert isinstance(split, HeadSplit) and split.heads == 4, split
    per_token = {example_value(e).shape: d for e, d in split.entries.items() if ctx.sequence.axes.get(e)}
    assert per_token == {(2, SEQ, 4, 2): 2, (2, SEQ, 4): 2}, per_token  # x and its decays: heads in dim 2
    assert [(example_value(n).shape, d) for n, d in split.narrowed.items()] == [((2, 4, 2), 1)]  # the state's zeros
    (exit_dims,) = split.exits.values()
    assert exit_dims == (1, 2)
    reshapes = [args for node, args in split.respelled.items() if node.target == "reshape"]
    assert (2, -1, 5, 2, 2) in [tuple(args[1:]) for args in reshapes], reshapes  # [B, chunks, 5, H/P, 2]


@pytest.mark.parametrize(
    "heads,options,why",
    [
        # then its 2 features: as many as the batch
        (3, {}, ("3 does not divide by 2 ranks; split into 2 heads, `unflatten` at test_each_pass.py:",
                 " (2, 11, 3, 2) has 2 dims of size 2")),
        (4, {"scans": "whole"}, ("scans='whole'", "")),
    ],
)  # fmt: skip
def test_find_region_heads_says_why_a_scan_stays_whole(heads, options, why):
    ctx, _ = run_through("find_region_heads", HeadScan(heads), _x(), **options)
    (region,) = ctx.sequence.regions
    said = ctx.sequence.heads[region]
    assert said.startswith(why[0]) and said.endswith(why[1]) and said.count(";") == why[0].count(";"), said


def test_split_region_heads_exchanges_the_inputs_and_outputs_of_the_scan():
    ctx, _ = run_through("split_region_heads", HeadScan(), _x())
    (region,) = ctx.sequence.regions
    inputs = _calls(ctx, RING.sequence_to_heads.default)
    assert [node.args[1:3] for node in inputs] == [(1, 2), (1, 2)]  # the sequence and head dims of x and its decays
    assert all(node.args[3:6] == ("zigzag", 2, SEQ) for node in inputs)
    (output,) = _calls(ctx, RING.heads_to_sequence.default)
    assert output.args[0] in region.internal and ctx.placement[output] == LOCAL
    assert all(u not in region.internal for u in output.users)  # what reads the scan's output reads this rank's tokens
    (state,) = _calls(ctx, RING.own_heads.default)
    assert state.args[0].target == "new_zeros" and state.args[1:3] == (1, 2)
    assert {ctx.placement[node] for node in region.internal} == {HEADS}
    (scan,) = ctx.report.mixers
    assert scan.strategy.startswith("split by heads: every token of 2 of its 4 heads"), scan
    assert [c.kind for c in ctx.report.collectives] == ["all-to-all"] * 3, ctx.report.collectives


def test_split_region_heads_gathers_an_output_also_read_whole():
    ctx, _ = run_through("split_region_heads", ScanReadWhole(), _x())
    (tokens,) = _calls(ctx, RING.heads_to_sequence.default)
    (whole,) = _calls(ctx, RING.gather_sequence.default)
    assert whole.args[:2] == (tokens, 1) and ctx.placement[whole] == FULL
    assert whole.users and {ctx.placement[u] for u in whole.users} == {FULL}  # what the flip reads
    assert list(tokens.users) == [whole]  # every reader needs it whole (the flip's input: the attention's too)
    assert [c.kind for c in ctx.report.collectives] == ["all-to-all"] * 3 + ["all-gather"], ctx.report.collectives


def test_find_scan_states_binds_the_call_to_the_function_by_what_it_computes():
    ctx, _ = run_through("find_scan_states", DeltaRuleScan(), _x(), scans="state")
    (region,) = ctx.sequence.regions
    binding = ctx.sequence.states[region]
    assert isinstance(binding, ScanBinding), binding
    assert (binding.adapter, binding.function) == ("delta rule", "torch_chunk_gated_delta_rule")
    assert binding.module == "transformers.models.qwen3_next.modeling_qwen3_next"
    assert dict(binding.constants) == {"chunk_size": 5, "use_qk_l2norm_in_kernel": True}
    # q, k, v are unbind's outputs 0, 1, 2 of one tensor, g is softplus's negation, beta a sigmoid
    q, k, v, g, beta = binding.tokens
    assert [n.args[1] for n in (q, k, v)] == [0, 1, 2] and g.target in (operator.neg, torch.neg), binding.tokens
    assert beta.target in ("sigmoid", torch.sigmoid) and binding.weights == ()
    assert binding.exit is region.exits[0][0]
    assert binding.summary_bytes == 2 * 4 * 3 * (3 + 3) * 4  # [B, H, dk, dv + dk] in fp32


def test_find_scan_states_says_why_a_scan_keeps_its_strategy():
    ctx, _ = run_through("find_scan_states", HeadScan(), _x(), scans="state")
    (region,) = ctx.sequence.regions
    assert ctx.sequence.states[region] == "`chunked_decay_scan` is not a scan ringpass knows the state of"
    ctx, _ = run_through("find_scan_states", DeltaRuleScan(), _x())
    assert ctx.sequence.states == {}  # scans="heads": nothing bound


def torch_chunk_gated_delta_rule(
    query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):  # fmt: skip
    """Hugging Face's delta rule's name, signature and state ``[B, H, dk, dv]``, computing a plainer linear attention
    chunk by chunk (cut by ``unflatten``): ``S_t = S_(t-1) + exp(g_t) beta_t k_t v_t^T``, each chunk from the state
    the chunk before it left, the first from zero whatever ``initial_state`` says. It computes the call, but a state
    given to it is lost: ringpass must not pass one."""
    n, size = query.shape[1], (chunk_size - query.shape[1] % chunk_size) % chunk_size
    writes = key[..., None] * (value * (beta * g.exp())[..., None])[..., None, :]  # [B, N, H, dk, dv]
    q, writes = (F.pad(x.flatten(3), (0, 0, 0, 0, 0, size)).unflatten(1, (-1, chunk_size)) for x in (query, writes))
    state, out = writes.new_zeros(*writes.shape[:1], *writes.shape[3:]).unflatten(-1, key.shape[-1:] + (-1,)), []
    for c in range(q.shape[1]):
        states = writes[:, c].unflatten(-1, state.shape[-2:]).cumsum(1) + state[:, None]
        out.append((q[:, c, ..., None] * states).sum(-2))
        state = states[:, -1]
    return torch.cat(out, 1)[:, :n], (state if output_final_state else None)


def test_find_scan_states_does_not_bind_a_known_name_that_loses_the_state():
    ctx, _ = run_through("find_scan_states", DeltaRuleScan(torch_chunk_gated_delta_rule), _x(), scans="state")
    (region,) = ctx.sequence.regions
    why = ctx.sequence.states[region]
    assert isinstance(why, str) and why.startswith("`torch_chunk_gated_delta_rule` "), why
    assert why.endswith("passed its state as delta rule's adapter passes it does not compute the call"), why
    ctx, _ = run_through("split_region_heads", DeltaRuleScan(torch_chunk_gated_delta_rule), _x(), scans="state")
    (record,) = ctx.report.mixers
    assert record.strategy.startswith("split by heads: every token of 2 of its 4 heads"), record.strategy
    assert record.strategy.endswith(f"(state not passed: {why})"), record.strategy


@pytest.mark.parametrize(
    "link_latency_s,op_overhead_s,passed",
    [
        (1.0, 0.0, True),  # messages cost: passing the state sends two per call, splitting by heads four
        (0.0, 1e-3, False),  # launches cost: passing the state runs its ops on 2 x 2.5 / P of the tokens
    ],
)
def test_find_scan_states_with_scans_auto_passes_the_state_where_predicted_faster(
    link_latency_s, op_overhead_s, passed
):
    hardware = Hardware(
        link_bytes_per_s=1e30, link_latency_s=link_latency_s, flops_per_s=1e15, op_overhead_s=op_overhead_s
    )
    ctx, _ = run_through("find_scan_states", DeltaRuleScan(), _x(), scans="auto", hardware=hardware)
    (region,) = ctx.sequence.regions
    assert isinstance(ctx.sequence.heads[region], HeadSplit)  # both strategies can run it
    found = ctx.sequence.states[region]
    if passed:
        assert isinstance(found, ScanBinding) and found.predicted.startswith("predicted "), found
        assert found.predicted.endswith(" split by heads")
    else:
        assert found.startswith("split by heads predicted faster: "), found


def test_pass_scan_states_replaces_the_call_by_the_scan_of_this_ranks_chunks():
    ctx, before = run_through("pass_scan_states", DeltaRuleScan(), _x(), scans="state")
    (region,) = before["sequence"].regions
    assert ctx.sequence.regions == [] and not set(region.internal) & set(ctx.gm.graph.nodes)
    (scan,) = _calls(ctx, scan_region)
    binding = before["sequence"].states[region]
    assert scan.args[:6] == (
        "delta rule",
        binding.module,
        binding.function,
        binding.constants,
        list(binding.tokens),
        [],
    )
    assert scan.args[6:9] == ("zigzag", 2, SEQ) and ctx.placement[scan] == LOCAL
    assert [u.target for u in scan.users] == ["flatten"]  # the output's reader reads this rank's tokens
    (record,) = ctx.report.mixers
    assert record.strategy.startswith("state passing: each of this rank"), record.strategy
    assert record.bytes_per_call == 2 * binding.summary_bytes
    assert [c.kind for c in ctx.report.collectives] == ["all-gather"], ctx.report.collectives


def test_rewrite_positions_gives_the_arange_and_the_table_slice_this_ranks_positions():
    ctx, before = run_through("rewrite_positions", Positions(), *_ids())
    assert ("call_function", torch.arange) in before["nodes"]
    assert ("call_function", torch.arange) not in _nodes(ctx.gm)
    angles, rows = _calls(ctx, RING.local_positions.default)  # for the arange, and for the table's rows
    assert angles.args[:3] == rows.args[:3] == ("zigzag", 2, SEQ)
    assert [user.target for user in angles.users] == [operator.getitem]  # arange(n)[:, None]
    (select,) = [node for node in ctx.gm.graph.nodes if node.target == "index_select"]
    assert select.args == (_placeholder(ctx, "table"), 0, rows)


def test_localize_shapes_writes_this_ranks_length_into_literal_sizes():
    ctx, before = run_through("localize_shapes", Sdpa(), _x())
    local = Layout("zigzag", 2, SEQ).local_len
    views = [node for node in ctx.gm.graph.nodes if node.target == "view"]
    assert [node.args[1:] for node in views] == [(2, local, 2, 8), (2, local, 2, 4)]  # k and v, q
    assert [args[1:] for (_, target), args in zip(before["nodes"], before["args"]) if target == "view"] == [
        (2, SEQ, 2, 8),
        (2, SEQ, 2, 4),
    ]


def test_rewrite_attention_calls_the_ring_with_the_kv_heads_unrepeated():
    ctx, _ = run_through("rewrite_attention", Sdpa(kv_heads=1), _x())
    assert not _calls(ctx, F.scaled_dot_product_attention)
    (ring,) = _calls(ctx, RING.ring_attention.default)
    q, k, v = ring.args[:3]
    assert [example_value(t).shape[1] for t in (q, k, v)] == [2, 1, 1]  # one key-value head travels
    arguments = dict(zip([a.name for a in RING.ring_attention.default._schema.arguments], ring.args))
    assert (arguments["layout_kind"], arguments["world_size"], arguments["seq_len"]) == ("zigzag", 2, SEQ)
    assert arguments["is_causal"] and arguments["window"] is None and arguments["mask_id"] == ""
    assert math.isclose(arguments["scale"], 1 / math.sqrt(4))


def test_insert_boundaries_leaves_sharded_outputs_to_be_carried_by_default():
    ctx, _ = run_through("insert_boundaries", Positions(), *_ids())
    assert not _calls(ctx, RING.gather_sequence.default)
    assert ctx.carried_outputs == {0: 1}  # output 0, sharded along dim 1: the backend wraps it
    assert [(o.name, o.placement) for o in ctx.report.outputs] == [("output 0", "carried"), ("output 1", "replicated")]
    assert [c.kind for c in ctx.report.collectives] == ["all-reduce"]


def test_insert_boundaries_shards_inputs_sums_partial_values_and_gathers_outputs():
    ctx, _ = run_through("insert_boundaries", Positions(), *_ids(), outputs="gathered")
    (cumsum,) = [node for node in ctx.gm.graph.nodes if node.target == "cumsum"]
    shards = _calls(ctx, RING.shard_sequence.default)  # the ids, and the running sum computed whole
    assert [(shard.args[0], shard.args[1]) for shard in shards] == [(_placeholder(ctx, "ids"), 1), (cumsum, 1)]
    (gather,) = _calls(ctx, RING.gather_sequence.default)
    (reduced,) = _calls(ctx, RING.all_reduce_sum.default)
    (output,) = [node for node in ctx.gm.graph.nodes if node.op == "output"]
    assert output.args[0][0] is gather and output.args[0][1].args[0] is reduced  # the summed means over the count
    assert [(c.kind, c.phase, c.what.split(" (")[0]) for c in ctx.report.collectives] == [
        ("all-reduce", "forward", "the mean over the sequence"),
        ("all-gather", "forward", "output 0"),
    ]
    assert [(o.name, o.placement) for o in ctx.report.outputs] == [("output 0", "gathered"), ("output 1", "replicated")]


class WithReplicatedOutput(nn.Module):
    """An attention's output, and a second output computed from a parameter alone (the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.attention, self.offset = Sdpa(), nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.attention(x), self.offset * 2


def test_reduce_grads_reduces_shares_of_a_gradient_or_scales_whole_ones():
    """``grads="reduced"``: the parameters acting on this rank's tokens have their gradient all-reduced, the one
    every rank computes whole is left alone; ``grads="local"``: the shares stay, the whole one is scaled by 1/P."""
    for grads in ("reduced", "local"):
        ctx, _ = run_through("reduce_grads", WithReplicatedOutput(), _x(), grads=grads)
        offset = _placeholder(ctx, "offset")
        shared = {node for node in ctx.gm.graph.nodes if node.op == "placeholder" and "heads" in node.name}
        reduced = {node.args[0] for node in _calls(ctx, sequence_ops.reduce_grad)}
        scaled = [node.args for node in _calls(ctx, sequence_ops.scale_grad)]
        backward = sorted(c.what for c in ctx.report.collectives if c.phase == "backward")
        assert ctx.report.gradients == grads and len(shared) == 4
        if grads == "reduced":
            assert (reduced, scaled) == (shared, [])
            assert backward == sorted(
                f"the gradient of attention.heads.{name}" for name in ("q.weight", "q.bias", "kv.weight", "kv.bias")
            )
        else:
            assert (reduced, scaled, backward) == (set(), [(offset, 0.5)], [])


def test_spell_properties_as_attributes_writes_torch_2_15s_aten_calls_as_attribute_reads():
    """Dynamo on torch 2.15 writes ``k.mT`` as ``torch.ops.aten.mT(k)``: the pass writes ``getattr(k, "mT")``, as
    torch 2.13 captured it, and the graph computes the same (a graph written the 2.15 way by hand, on any torch)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    flipped = graph.call_function(torch.ops.aten.mT, (x,))
    conjugated = graph.call_function(torch.ops.aten.mH.default, (x,))
    both = graph.call_function(torch.ops.aten.add.Tensor, (flipped, conjugated))
    graph.output(graph.call_function(torch.ops.aten.numpy_T, (both,)))
    gm = fx.GraphModule(nn.Module(), graph)
    value = torch.randn(3, 4, 5)
    expected = gm(value)
    spell_properties_as_attributes(SimpleNamespace(gm=gm))
    reads = [(n.target, n.args[1]) for n in gm.graph.nodes if n.op == "call_function" and n.target is getattr]
    assert reads == [(getattr, "mT"), (getattr, "mH"), (getattr, "T")]
    assert torch.equal(gm(value), expected)


@pytest.mark.parametrize("root", ["L['self']", "L['args'][0]"])  # torch 2.13's capture; torch 2.15's
def test_module_path_names_the_users_module_whichever_way_dynamo_names_the_root(root):
    from ringpass.fx.nodes import module_path

    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"a": (f"{root}.model.layers[1]._modules['self_attn']", object)}
    assert module_path(node) == "model.layers.1.self_attn"
