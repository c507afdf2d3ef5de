"""The rewrite's safety net: an input that trains through the captured graph still trains after the rewrite.

`record_gradient_paths` (first pass) finds the inputs whose gradient reaches an output; `check_gradient_paths`
(last pass, and after a decode step's rewrite) refuses a rewritten graph where one no longer does, naming
the value, the op that cut its path and its source line. Unit tests of the reachability on small graphs,
then through `ringpass.inspect` (offline) with passes that cut a path on purpose.
"""

import operator
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ringpass
import ringpass.passes as passes
from lowering.masks import register_mask
from lowering.ring_args import RingArgs
from ringpass.fx.context import PassContext
from ringpass.fx.gradient_reach import (
    GRADIENT_ARGUMENTS,
    differentiable_arguments,
    gradient_reach,
    has_autograd_formula,
)
from ringpass.fx.nodes import copy_origin, user_name
from ringpass.fx.report import Report
from ringpass.options import RingOptions
from ringpass.passes.check_gradient_paths import check_gradient_paths
from ringpass.passes.inline_subgraphs import inline_subgraphs
from ringpass.passes.record_gradient_paths import record_gradient_paths
from ringpass.passes.remove_unread_values import remove_unread_values
from ringpass.passes.spell_properties_as_attributes import spell_properties_as_attributes

HERE = Path(__file__).name
RING = torch.ops.ringpass.ring_attention.default


def _line(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def _reaching(gm: fx.GraphModule) -> set[str]:
    live, _ = gradient_reach(gm)
    return {n.target for n in gm.graph.nodes if n.op == "placeholder" and n in live}


def _captured(fn, *inputs) -> list[fx.GraphModule]:
    """The graphs Dynamo captures of ``fn`` (with their example values)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    finally:
        torch._dynamo.reset()
    return graphs


def _context(gm: fx.GraphModule) -> PassContext:
    return PassContext(gm, [], RingOptions.from_dict({"report": "off"}), 2, "", Report(world_size=2))


# ---- the reachability on small graphs ---------------------------------------------------------------------
def test_a_detach_cuts_the_path_a_plain_use_does_not():
    def plain(x, w, b):
        return (x * w + b).sum()

    def detached(x, w, b):
        return (x * w.detach() + b).sum()

    assert _reaching(fx.symbolic_trace(plain)) == {"x", "w", "b"}
    assert _reaching(fx.symbolic_trace(detached)) == {"x", "b"}


def test_an_erased_use_cuts_the_path():
    gm = fx.symbolic_trace(lambda x, w: torch.tanh(x * w))
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    mul.replace_all_uses_with(mul.args[0])  # a "pass" that drops the multiplication
    gm.graph.erase_node(mul)
    assert _reaching(gm) == {"x"}


def test_comparisons_sizes_and_integer_casts_carry_no_gradient():
    def f(x, w, m):
        return x.new_zeros(w.size(0)) + (w > 0).float() + m.long().float() + x

    assert _reaching(fx.symbolic_trace(f)) == {"x"}


def _ring_graph(table_also_added: bool) -> fx.GraphModule:
    graph = fx.Graph()
    q, k, v, table = (graph.placeholder(name) for name in ("q", "k", "v", "table"))
    ring = graph.call_function(
        RING,
        (q, k, v, *RingArgs("contiguous", 2, 16, False, 0.5, "", bias_id="bias-id", bias_inputs=[table]).op_args()),
    )
    out = graph.call_function(operator.getitem, (ring, 0))
    if table_also_added:
        out = graph.call_function(operator.add, (out, table))
    graph.output((out,))
    return fx.GraphModule(nn.Module(), graph)


def test_the_ring_op_passes_gradient_to_the_arguments_its_backward_differentiates():
    expected = {"q", "k", "v"} | ({"table"} if "bias_inputs" in GRADIENT_ARGUMENTS["ring_attention"] else set())
    assert _reaching(_ring_graph(False)) == expected
    assert _reaching(_ring_graph(True)) == {"q", "k", "v", "table"}  # another path


def test_an_op_without_an_autograd_formula_raises_in_the_backward_so_it_cuts_nothing_silently():
    graph = fx.Graph()
    q, k, v, q_pos, kv_pos = (graph.placeholder(name) for name in ("q", "k", "v", "q_pos", "kv_pos"))
    call = graph.call_function(
        torch.ops.ringpass.decode_attention.default, (q, k, v, q_pos, kv_pos, None, None, False, None, 0.5, "")
    )
    graph.output((call,))
    assert not has_autograd_formula("decode_attention")
    assert differentiable_arguments(call) == {q, k, v, q_pos, kv_pos}


def test_a_value_written_in_place_reaches_through_what_it_writes():
    def f(x, w):
        buf = x.clone()
        buf[:, :2] = w[:2] * 2
        return buf.sum()

    def g(x, w):
        buf = x.clone()
        buf.add_(w * 2)
        return buf.sum()

    assert _reaching(fx.symbolic_trace(g)) == {"x", "w"}
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    (gm,) = _captured(f, x, w)
    assert _reaching_captured(gm) == {"x", "w"}


def _reaching_captured(gm: fx.GraphModule) -> set[str]:
    ctx = _context(gm)
    record_gradient_paths(ctx)
    return {user_name(p) for p in ctx.gradient_paths.inputs} if ctx.gradient_paths else set()


class Checkpointed(nn.Module):
    """A checkpointed region whose body reads ``c`` detached only: ``c`` does not train, ``a`` and ``b`` do."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))

    def forward(self, x):
        return checkpoint(lambda t: self.a(t) * self.b + self.c.detach(), x, use_reentrant=False).sum()


def test_a_checkpointed_body_is_walked_and_inlining_it_cuts_nothing():
    (gm,) = _captured(Checkpointed(), torch.randn(2, 4))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)  # the body is a subgraph here
    ctx = _context(gm)
    record_gradient_paths(ctx)
    assert {user_name(p) for p in ctx.gradient_paths.inputs} == {"a.weight", "a.bias", "b"}
    inline_subgraphs(ctx)
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    check_gradient_paths(ctx)  # no refusal


def test_inference_graphs_record_nothing():
    (gm,) = _captured(Checkpointed(), torch.randn(2, 4))
    assert _reaching_captured(gm)
    with torch.no_grad():
        (gm,) = _captured(Checkpointed(), torch.randn(2, 4))
    ctx = _context(gm)
    record_gradient_paths(ctx)
    assert ctx.gradient_paths is None
    frozen = Checkpointed().requires_grad_(False)
    (gm,) = _captured(frozen, torch.randn(2, 4))
    assert _reaching_captured(gm) == set()


# ---- the rule table against the ops ----------------------------------------------------------------------
def test_every_ringpass_op_with_an_autograd_formula_says_what_it_differentiates():
    names = [n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("ringpass::")]
    assert "ring_attention" in names
    for name in names:
        if has_autograd_formula(name):
            assert name in GRADIENT_ARGUMENTS, f"ringpass::{name} has an autograd formula: list what it differentiates"
    for name, arguments in GRADIENT_ARGUMENTS.items():
        schema = getattr(torch.ops.ringpass, name).default._schema
        assert set(arguments) - {"*"} <= {a.name for a in schema.arguments}, name


def test_the_table_says_what_the_ring_ops_backward_returns():
    """A ring of one: the gradient the op's autograd returns for q, k, v and for a bias program's input is
    what `GRADIENT_ARGUMENTS` says (a colleague making program inputs differentiable updates the table)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    per_head = torch.rand(2, dtype=torch.float64, requires_grad=True)
    bias_id = register_mask(lambda q_pos, kv_pos, h: h[:, None, None] * (q_pos[:, None] - kv_pos[None, :]).abs())
    out, _ = RING(
        q, k, v, *RingArgs("contiguous", 1, 6, True, 0.5, "", bias_id=bias_id, bias_inputs=[per_head]).op_args()
    )
    grads = torch.autograd.grad((out * out).sum(), (q, k, v, per_head), allow_unused=True)
    returned = {name for name, g in zip(("q", "k", "v", "bias_inputs"), grads) if g is not None}
    assert returned == set(GRADIENT_ARGUMENTS["ring_attention"]) & {"q", "k", "v", "bias_inputs"}


# ---- through ringpass.inspect -------------------------------------------------------------------------------
class Tempered(nn.Module):
    """Causal SDPA whose queries a learned per-head temperature scales: a parameter in the attention scores."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.temperature = nn.Parameter(torch.ones(2, 1, 1))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        q = q * self.temperature  # TEMPERATURE
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, 8)


class RelativeBias(nn.Module):
    """Written-out attention plus a learned table indexed by the clamped query-key distance (T5's bias):
    the table becomes an input of the ring's bias program."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.table = nn.Parameter(torch.randn(32))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 4).transpose(1, 2) for t in self.proj(x).split(8, -1))
        pos = torch.arange(n, device=x.device)
        scores = q @ k.transpose(-1, -2) * 0.5 + self.table[(pos[None, :] - pos[:, None]).clamp(-15, 16) + 15]
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, n, 8)  # RELATIVE


def _with_pass(monkeypatch, cut) -> None:
    """``cut`` runs after every rewrite, just before the check."""
    first = (remove_unread_values, spell_properties_as_attributes, record_gradient_paths)  # before any cut
    assert passes.PIPELINE[:3] == first
    assert passes.PIPELINE[-1] is check_gradient_paths
    monkeypatch.setattr(passes, "CHECK", passes.Stage("check", (cut, *passes.CHECK.passes)))


def _placeholder(ctx, name: str) -> fx.Node:
    return next(n for n in ctx.gm.graph.nodes if n.op == "placeholder" and user_name(n) == name)


def _detach_uses_of(ctx, name: str) -> None:
    """A broken pass: every use of ``name`` reads it detached."""
    graph, param = ctx.gm.graph, _placeholder(ctx, name)
    for user in list(param.users):
        with graph.inserting_before(user):
            detached = copy_origin(graph.call_method("detach", (param,)), user)
        user.replace_input_with(param, detached)


def test_a_learned_parameter_in_the_scores_trains_through_the_rewrite():
    inspection = ringpass.inspect(Tempered(), (torch.randn(1, 16, 8),), world_size=2)
    assert inspection.status == "rewritten" and inspection.reports[0].refusal is None


def test_a_pass_that_detaches_a_parameter_is_refused_naming_it_the_op_and_the_line(monkeypatch):
    _with_pass(monkeypatch, lambda ctx: _detach_uses_of(ctx, "temperature"))
    inspection = ringpass.inspect(Tempered(), (torch.randn(1, 16, 8),), world_size=2)
    assert inspection.status == "refused" and inspection.exit_code == 2
    refusal = inspection.reports[0].refusal
    assert (refusal.op, refusal.source) == ("detach", f"{HERE}:{_line('TEMPERATURE')}")
    assert refusal.message.startswith(
        "The gradient of `temperature` no longer reaches the outputs after the ring "
        f"rewrite: it reaches `detach` at {HERE}:{_line('TEMPERATURE')}"
    ), refusal.message
    assert "silently" in refusal.message and "requires_grad_(False)" in refusal.message


def test_a_pass_that_drops_a_parameters_use_is_refused_naming_the_removed_op(monkeypatch):
    def drop_the_temperature(ctx):
        wrapped = list(_placeholder(ctx, "temperature").users)  # reduce_grad(temperature)
        (mul,) = [u for w in wrapped for u in w.users if u.target is operator.mul]
        mul.replace_all_uses_with(mul.args[0])
        ctx.gm.graph.erase_node(mul)

    _with_pass(monkeypatch, drop_the_temperature)
    refusal = ringpass.inspect(Tempered(), (torch.randn(1, 16, 8),), world_size=2).reports[0].refusal
    assert refusal is not None and (refusal.op, refusal.source) == ("mul", f"{HERE}:{_line('TEMPERATURE')}")
    assert (
        f"`temperature` no longer reaches the outputs after the ring rewrite: it fed `mul` at {HERE}:"
        f"{_line('TEMPERATURE')}, which the rewrite removed" in refusal.message
    ), refusal.message


def test_a_learned_bias_table_trains_through_the_ring_op_or_is_refused(monkeypatch):
    """The bug this net was made for: the table lifted into the bias program's inputs. Where the ring op's
    backward differentiates them, the model is rewritten; where it returns no gradient for them (as before
    `lowering.op.PROGRAM_INPUTS`, simulated here), the rewrite is refused, naming the table and the op."""
    inspection = ringpass.inspect(RelativeBias(), (torch.randn(1, 16, 8),), world_size=2)
    assert inspection.status == "rewritten", inspection.reports[0].refusal
    monkeypatch.setitem(GRADIENT_ARGUMENTS, "ring_attention", ("q", "k", "v"))
    inspection = ringpass.inspect(RelativeBias(), (torch.randn(1, 16, 8),), world_size=2)
    refusal = inspection.reports[0].refusal
    where = f"{HERE}:{_line('RELATIVE')}"
    assert inspection.status == "refused" and (refusal.op, refusal.source) == ("ring_attention", where)
    assert (
        "The gradient of `table` no longer reaches the outputs after the ring rewrite: it reaches `ring_attention` "
        f"at {where} as its argument `bias_inputs`, for which the op's backward returns no "
        "gradient" in refusal.message
    ), refusal.message


def test_inference_never_refuses(monkeypatch):
    _with_pass(monkeypatch, lambda ctx: _detach_uses_of(ctx, "temperature"))
    with torch.no_grad():
        assert ringpass.inspect(Tempered(), (torch.randn(1, 16, 8),), world_size=2).status == "rewritten"
    frozen = Tempered()
    frozen.temperature.requires_grad_(False)
    assert ringpass.inspect(frozen, (torch.randn(1, 16, 8),), world_size=2).status == "rewritten"


class DecodeStep(nn.Module):
    """One new token's query against a KV cache held sharded (read whole through ``ringpass::whole_cache``)."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, k_slots, v_slots, slot_pos):
        q = self.q(x).view(1, 1, 2, 4).transpose(1, 2)
        k = torch.ops.ringpass.whole_cache(k_slots, slot_pos, 16, "")
        v = torch.ops.ringpass.whole_cache(v_slots, slot_pos, 16, "")
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 1, 8))


def test_a_decode_steps_rewrite_is_checked_too(monkeypatch):
    inputs = (torch.randn(1, 1, 8), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.arange(8))
    inspection = ringpass.inspect(DecodeStep(), inputs, world_size=2)
    assert inspection.status == "rewritten" and inspection.reports[0].decode == 1

    def decode_and_cut(ctx):
        rewrite(ctx)
        _detach_uses_of(ctx, "q.weight")

    rewrite = passes.rewrite_decode_attention
    monkeypatch.setattr(passes, "DECODE", passes.Stage("decode", (decode_and_cut,)))
    refusal = ringpass.inspect(DecodeStep(), inputs, world_size=2).reports[0].refusal
    assert refusal is not None and "The gradient of `q.weight` no longer reaches the outputs" in refusal.message
