"""Take attention masks out of the graph: what each ring step evaluates instead of an S x S tensor.

Matches the mask of every attention (SDPA's ``attn_mask``, or the mask a hand-written attention applies).
Walking back from the mask, each value is given *roles*: which of its dims index the mask's query rows
and which its key columns (through pointwise ops, casts, broadcasting, ``unsqueeze``/``expand``/``None``
indexing, and indexing with tensors, whose index tensors inherit the roles). Those values form the
*region*; the values the region reads are its *inputs*: per-token vectors whose role dims are restricted
to the block's positions (``arange``s, position ids, a padding mask), and whole tables indexed by the
region (segment ids, position ids indexed as ``pos[b, q_idx]``, an embedding table looked up by a bucket of
``kv_pos - q_pos`` as T5 and MPNet do, ``permute``d to heads first), all at most ``[B, S]``.

Then, per attention, in this order:
1. the region is read symbolically (positions as ``a*q + b*k + c``); a mask that is exactly causal,
   causal with a sliding window, or all-visible becomes the ring's position-based flags (no mask at all); one that
   also compares a per-token table at the query and the key (``ids[b, q] == ids[b, k]``: packed documents, HF's
   restarting position ids among them) becomes the documents mask (`lowering.masks.DOCUMENTS`, the ids its input);
2. otherwise the region becomes a mask program (`lowering.masks`), registered by content, evaluated by
   the ring per tile of (local query positions x arriving key positions);
3. a mask that needs an ``S x S`` tensor (``tril(ones(S, S))``, a registered causal buffer, a mask input)
   is evaluated once when it depends on shapes only (up to ``MASK_LIMIT`` tokens) and accepted when
   causal or a sliding window (with dynamic shapes: at several lengths, when it reads the length only as
   sizes of new tensors or ends of prefixes of module state); otherwise it is refused, naming the node and
   source line, unless ``masks="materialize"`` lets every rank hold the tensor whole (then it is a program
   input like the others).

Score modifiers of a hand-written attention (`lowering.scores`) join the plan: its soft-cap as a number,
and its additive bias (the term under the mask) lifted the same way: a bias that depends on shapes only
and is ``slope[h] · kv_pos + c`` along the keys (BLOOM's and MPT's ALiBi) becomes per-head slopes the
kernels apply from positions; any other bias becomes a bias program evaluated per tile; a bias that needs
an ``S x S`` tensor is refused unless ``masks="materialize"`` (then it is a program input held whole). A mask
or bias computed from a trainable value (a learned bucket table, learned slopes) is never evaluated here: it
stays a program, whose inputs the ring's backward trains tile by tile (`lowering.program_grads`).

Writes ``ctx.masks`` (`MaskFindings`): ``plans`` (attention output -> `MaskPlan`), ``lifted`` (masks and biases:
they and what only feeds them are gone after the rewrite) and ``whole_values`` (program inputs: kept whole on every
rank); a flex_attention's match in ``ctx.attention`` gets its ``score_mod``'s scale folded in. The report gets a
warning for each tensor materialised, and a note (``differs``) where a fully hidden query gets what eager attention
does not give it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from lowering.errors import NotSupportedError
from lowering.masks import DOCUMENTS as DOCUMENTS_MASK
from lowering.masks import MASKED_AT_OR_BELOW, register_mask, split_additive
from ringpass.fx.context import PassContext
from ringpass.fx.findings import MaskPlan
from ringpass.fx.flex_mods import FlexProgram, read_score_mod
from ringpass.fx.nodes import (
    ancestors,
    describe,
    example_value,
    is_module_state,
    numbers_in,
    placeholders_of,
    refusal,
    user_name,
)
from ringpass.fx.sizes import same
from ringpass.fx.spellings import CREATORS, KEEP_VALUES, LIKE, is_pointwise, op_name
from ringpass.fx.static_shapes import needs_static_shapes

NEW_LIKE = ("new_ones", "new_zeros", "new_full", "new_tensor")  # methods whose result reads no value of their source
MASK_LIMIT = 16384  # a mask built from an S x S tensor is checked on the host once: S x S booleans
# A finite hiding value at or below this makes every score it is added to the same number in float32 (its
# spacing there is 64: any score under 32 in size is lost), so a fully hidden query's softmax is uniform.
SWAMPS_EVERY_SCORE = -1e9
AND = {"bitwise_and", "logical_and"}
OR = {"bitwise_or", "logical_or"}
Q, KV = "q", "kv"


def lift_masks(ctx: PassContext) -> None:
    for i, match in enumerate(ctx.attention):
        if match.flex is not None:
            ctx.attention[i], ctx.masks.plans[match.output] = _plan_flex(ctx, match)
            continue
        plan = MaskPlan(match.is_causal) if match.mask is None else _plan(ctx, match)
        for mask, fill in match.inner_masks:
            plan = _combined(ctx, match, plan, _plan(ctx, replace(match, mask=mask, fill=fill, inner_masks=())))
        plan.softcap = match.softcap
        if match.bias is not None:
            _plan_bias(ctx, match, plan)
        ctx.masks.plans[match.output] = plan


def _plan_flex(ctx: PassContext, match):
    """(the match with the score_mod's scale folded in, the plan): ``mask_mod`` as a mask program, the
    score_mod's soft-cap, and its bias as a bias program (`flex_mods`)."""
    q = example_value(match.query)
    batch, heads = q.shape[0], q.shape[1]
    if isinstance(batch, torch.SymInt) or isinstance(heads, torch.SymInt):
        raise needs_static_shapes(
            ctx,
            f"flex_attention {describe(match.output)} with a dynamic batch or head count: its mask_mod is "
            "evaluated per (batch, head); compile with dynamic=False.",
            f"flex_attention {describe(match.output)} evaluates its mask_mod per (batch, head) at a known count",
            match.output,
        )
    mods = match.flex
    reading = read_score_mod(mods.score_mod, match.output)
    mask = FlexProgram(mods.mask_mod, int(batch), int(heads), score=False)
    plan = MaskPlan(
        program_id=register_mask(mask, source=mask.code), inputs=list(mods.mask_buffers), softcap=reading.softcap
    )
    ctx.masks.whole_values |= set(mods.mask_buffers)
    if reading.bias:
        bias = FlexProgram(mods.score_mod, int(batch), int(heads), score=True)
        plan.bias_id, plan.bias_inputs = register_mask(bias, source=bias.code), list(mods.score_buffers)
        ctx.masks.whole_values |= set(mods.score_buffers)
    return replace(match, scale=match.scale * reading.scale), plan


def _plan_bias(ctx: PassContext, match, plan: MaskPlan) -> None:
    """ALiBi slopes when the bias is one, else a bias program (refused when it needs an S x S tensor)."""
    bias = match.bias
    ctx.masks.lifted.add(bias)
    plan.slopes = _alibi_slopes(ctx, match)
    if plan.slopes is not None:
        return
    region = MaskRegion(bias)
    if region.oversized:
        big = region.oversized[0]
        if ctx.options.masks != "materialize":
            raise refusal(
                f"The score bias of {describe(match.output)} needs {describe(big)}, a sequence x sequence tensor; "
                "ring attention computes biases per tile from positions (ALiBi slopes, a bias built from per-token "
                "vectors), so no rank holds S x S values. Build the bias from positions, or allow holding it whole on "
                "every rank with options={'masks': 'materialize'}.",
                big,
            )
        ctx.report.warnings.append(
            f"bias materialised (masks='materialize'): {describe(big)} is held whole on every rank"
        )
    program = _program(ctx, region, "bias", _to_4d(match, example_value(bias)), match.outer_scale)
    ctx.masks.whole_values |= set(region.input_nodes)
    plan.bias_id, plan.bias_inputs = register_mask(program, source=program.code), region.input_nodes


def _to_4d(match, value):
    """How a bias of ``value``'s shape becomes ``[B or 1, H or 1, n, m]`` for the ring: a 3-D bias of merged
    batch and heads is unflattened (by its head count, a number also under dynamic shapes), one of single-head
    3-D attention gains a head axis."""
    if value.dim() != 3 or example_value(match.query).dim() != 3:
        return None
    if match.batch is None:
        return ("unsqueeze", 1)
    if same(value.shape[0], 1):
        return ("unsqueeze", 0)
    return ("unflatten", 0, (-1, _query_heads(match)))


def _alibi_slopes(ctx: PassContext, match) -> list | None:
    """Per-query-head slopes when the bias depends on shapes and frozen state only and equals
    ``slope[h] · kv_pos + c[h]`` at every key (with dynamic shapes: at two lengths, with the same slopes),
    else None. A bias computed from a trainable value (learned slopes) stays a program, which trains it."""
    if _trainable(match.bias):
        return None
    n = example_value(match.output).shape[-2]
    lengths = [None] if not isinstance(n, torch.SymInt) else [(n, n.node.hint), (n, 2 * n.node.hint + 3)]
    found = []
    for resize in lengths:
        values = _evaluate(ctx, match.bias, resize)
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            return None
        reshape = _to_4d(match, values)
        values = getattr(values, reshape[0])(*reshape[1:]) if reshape else values[(None,) * (4 - values.dim())]
        if values.dim() != 4 or values.shape[2] != 1 or values.shape[3] < 2:
            return None  # varies with the query, or too short to read a slope from
        lines = values[:, :, 0, :].double()
        slopes = lines[..., 1] - lines[..., 0]
        fitted = lines[..., :1] + slopes[..., None] * torch.arange(lines.shape[-1], dtype=torch.float64)
        tolerance = 1e-6 * max(1.0, float(lines.abs().max()))
        if not bool(((lines - fitted).abs() <= tolerance).all()) or not bool((slopes == slopes[:1]).all()):
            return None
        found.append((slopes[0] * match.outer_scale).expand(_query_heads(match)).tolist())
    return found[0] if all(f == found[0] for f in found) else None


def _trainable(node: fx.Node) -> bool:
    """``node`` is computed from a value that requires grad: evaluating it once would freeze that value."""
    return any(getattr(example_value(p), "requires_grad", False) for p in placeholders_of(node))


def _query_heads(match) -> int:
    """The query heads of the ring call this attention becomes."""
    q = example_value(match.query)
    return int(q.shape[1]) if q.dim() == 4 else (1 if match.batch is None else int(q.shape[0] // match.batch))


def _combined(ctx: PassContext, match, outer: MaskPlan, inner: MaskPlan) -> MaskPlan:
    """One plan for two masks of one attention (a key is visible when both keep it): their flags joined; at
    most one may need a program. Where the program hides every key of a query, eager attention averages
    the keys the other mask keeps (keys both hide get -inf), which the ring does not reproduce: such a
    query gets 0, and the report says so."""
    if outer.program_id and inner.program_id:
        raise refusal(
            f"{describe(match.output)} applies two masks that both need evaluating per tile; ring attention "
            "takes one mask program. Combine them into one mask (e.g. `keep & causal`).",
            match.output,
        )
    windows = [w for w in (outer.window, inner.window) if w is not None]
    program = outer if outer.program_id else inner
    combined = replace(program, is_causal=outer.is_causal or inner.is_causal, window=min(windows) if windows else None)
    if combined.program_id and combined.fully_masked != "zero":
        combined.fully_masked = "zero"
        ctx.report.differs.append(
            f"{describe(match.output)} applies two masks: where the mask program hides every key of a query (left "
            "padding), eager attention averages the keys the other mask keeps; the ring gives 0 there, so such a "
            "batch differs from eager at those positions (their labels should be ignored)"
        )
    return combined


def _plan(ctx: PassContext, match) -> MaskPlan:
    kind, mask = match.mask
    _check_additive(match, kind, mask)
    region = MaskRegion(mask)
    ctx.masks.lifted.add(mask)
    n = example_value(match.output).shape[-2]
    if region.oversized:
        dynamic = isinstance(n, torch.SymInt)
        flags = (
            None
            if _trainable(mask)
            else (_causal_from_sizes_alone(ctx, region, kind, n) if dynamic else _shape_only_flags(ctx, mask, kind, n))
        )
        if flags is not None:
            return MaskPlan(*flags)
        big = region.oversized[0]
        if ctx.options.masks != "materialize":
            if dynamic:  # at static shapes the mask is checked at this length
                raise needs_static_shapes(
                    ctx,
                    f"The attention mask of {describe(match.output)} needs {describe(big)}, a sequence x sequence "
                    "tensor that computes with the length, and ring attention evaluates masks per block from "
                    "per-token vectors: compile with dynamic=False (the mask is then checked at each length), or "
                    "allow holding it whole on every rank with options={'masks': 'materialize'}.",
                    f"the attention mask of {describe(match.output)} computes with the length (checked at each one)",
                    big,
                )
            raise refusal(
                f"The attention mask of {describe(match.output)} needs {describe(big)}, a sequence x sequence tensor; "
                "ring attention evaluates masks per block from per-token vectors (positions, segment ids, padding "
                "masks) compared pairwise, so no rank holds S x S. Build the mask from such vectors (e.g. "
                "`pos[:, None] >= pos[None, :]`)"
                + ", or allow holding it whole on every rank with options={'masks': 'materialize'}."
                + _unreadable_state(ctx, mask)
                + _mask_given_whole(ctx, big),
                big,
            )
        ctx.report.warnings.append(
            f"mask materialised (masks='materialize'): {describe(big)} is held whole on every rank"
        )
    implied, exact = _read(ctx, region, kind, n)
    documents = [term[1] for term in implied if term[0] == DOCUMENTS]
    positional = implied - {(DOCUMENTS, ids, None) for ids in documents}
    is_causal, window = _flags(positional)
    whole_row = all(same(example_value(ids).shape[-1], n) for ids in documents)  # (not a longer table)
    if (
        exact
        and positional <= {CAUSAL} | ({(1, -1, 1 - window)} if window else set())
        and len(documents) <= 1
        and whole_row
    ):
        if not documents:
            return MaskPlan(is_causal, window)
        ctx.masks.whole_values.add(documents[0])
        return MaskPlan(is_causal, window, DOCUMENTS_MASK, [documents[0]], documents=_convention(documents[0]))
    program = _program(ctx, region, kind, factor=match.outer_scale if kind == "additive" else 1.0)
    ctx.masks.whole_values |= set(region.input_nodes)
    return MaskPlan(
        is_causal,
        window,
        register_mask(program, source=program.code),
        region.input_nodes,
        fully_masked=_fully_masked(ctx, match, kind, region),
    )


def _convention(ids: fx.Node) -> str:
    """How the model packed its documents, in words for the report: the position ids that restart, or the ids."""
    positions = _restarts_of(ids)
    if positions is not None:
        return f"{user_name(_plain(positions))} restarting at each"
    return f"document ids from {f'input `{user_name(ids)}`' if ids.op == 'placeholder' else user_name(ids)}"


def _fully_masked(ctx: PassContext, match, kind: str, region: MaskRegion) -> str:
    """What the model gives a query whose keys are all hidden (left padding), for the ring to give the same
    (`lowering.fully_masked`): an added finite mask (``+ finfo.min``) makes its softmax uniform over every key,
    with gradients into the scores; a finite fill (``masked_fill``, ``where``) too, with none; a bool mask
    (SDPA: 0) or a ``-inf`` fill or added mask (the model: NaN) gives 0. A finite value too small to swamp every score
    (``-1e4``) leaves eager weighing such a query's keys by their scores: warned, not reproduced."""
    if kind == "additive":
        hiding = [x for node, _ in region.ops for x in numbers_in(node) if x <= MASKED_AT_OR_BELOW]
        if hiding and all(x == float("-inf") for x in hiding):
            return "zero"  # -inf added to every score: NaN in the model; 0 here
        mode = "uniform"
    elif match.fill is not None and match.fill != float("-inf"):
        hiding, mode = [match.fill], "uniform_values"
    else:
        return "zero"
    weak = sorted({x for x in hiding if x > SWAMPS_EVERY_SCORE})
    if weak:
        ctx.report.differs.append(
            f"{describe(match.output)} hides keys with {', '.join(f'{x:g}' for x in weak)}: where a query's keys are "
            "all hidden (left padding) the ring gives the mean of every key's value, as a fill of finfo.min gives; "
            "eager attention with this fill still weighs those keys by their scores there, so such a batch "
            "differs from eager at those positions (hide keys with torch.finfo(dtype).min to match)"
        )
    return mode


def _read(ctx: PassContext, region: MaskRegion, kind: str, n) -> tuple[frozenset, bool]:
    """The symbolic reading at the graph's length; with dynamic shapes also at another length, and only
    what both readings agree on counts (a table that is ``arange`` at one length only is not trusted)."""
    if not isinstance(n, torch.SymInt):
        return _Symbolic(ctx, region, None).read(kind)
    (implied, exact), (other, other_exact) = (
        _Symbolic(ctx, region, (n, length)).read(kind) for length in (n.node.hint, 2 * n.node.hint + 3)
    )
    return implied & other, exact and other_exact and implied == other


def _check_additive(match, kind: str, mask: fx.Node) -> None:
    """SDPA adds a float mask to the scores: a bool mask cast to float (0 / 1) masks nothing there."""
    node = mask
    while kind == "additive" and _keeps_values(node):
        node = node.args[0]
        if example_value(node).dtype == torch.bool:
            raise refusal(
                f"The attention mask of {describe(match.output)} is a boolean mask cast to a float ({describe(mask)}): "
                "SDPA adds float masks to the scores, so its 0 / 1 values mask nothing (a bias the ring does not "
                "support). Pass the boolean mask itself (True = attend).",
                mask,
            )


def _keeps_values(node: fx.Node) -> bool:
    """A cast, or a reshaping that only adds or broadcasts axes."""
    return node.op in ("call_function", "call_method") and (
        op_name(node) in KEEP_VALUES | {"expand", "unsqueeze"} or _only_new_axes(node)
    )


def _flags(implied: frozenset) -> tuple[bool, int | None]:
    """(causal, window) that the implied constraints guarantee: the ring's position-based fast paths."""
    if CAUSAL not in implied:
        return False, None
    windows = [1 - c for a, b, c in implied if (a, b) == (1, -1) and c <= 0]  # q - k + c <= 0: q - k < 1 - c
    return True, min(windows) if windows else None


# ---- roles ------------------------------------------------------------------------------------------
Use = tuple  # (node, roles): a value of the graph read with these dims restricted, as ((dim, Q | KV), ...)


class MaskRegion:
    """The mask's pairwise part. A value can be read per query and per key (``i[:, None] >= i[None, :]``),
    so the region is made of *uses* (node, roles). ``ops``: use -> {arg node: its use} for the region's
    ops; ``inputs``: the uses it reads from the rest of the graph; ``oversized``: inputs with both a
    query and a key dim (an S x S tensor)."""

    def __init__(self, mask: fx.Node):
        rank, shape = example_value(mask).dim(), example_value(mask).shape
        self.mask: Use = (
            mask,
            tuple((d, r) for d, r in ((rank - 2, Q), (rank - 1, KV)) if rank >= 2 and not same(shape[d], 1)),
        )
        self.ops: dict[Use, dict[fx.Node, Use]] = {}
        self.inputs: list[Use] = []
        pending: dict[fx.Node, set] = {mask: {self.mask[1]}}
        for node in reversed(list(mask.graph.nodes)):
            for roles in sorted(pending.pop(node, ())):
                arg_roles = _arg_roles(node, dict(roles)) if roles else None
                if arg_roles is None:
                    self.inputs.append((node, roles))
                    continue
                self.ops[(node, roles)] = {arg: (arg, tuple(sorted(dims.items()))) for arg, dims in arg_roles}
                for arg, use in self.ops[(node, roles)].items():
                    pending.setdefault(arg, set()).add(use[1])
        self.oversized = [node for node, roles in self.inputs if {Q, KV} <= {r for _, r in roles}]

    @property
    def input_nodes(self) -> list[fx.Node]:
        return list(dict.fromkeys(node for node, _ in self.inputs))


def _arg_roles(node: fx.Node, roles: dict[int, str]):
    """[(tensor arg, its roles)] when the op lets restriction to positions pass to its args, else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = op_name(node)
    out = example_value(node)
    if name == "getitem":
        return _getitem_roles(node, roles)
    if name == "unsqueeze":
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None) % out.dim()
        return [(node.args[0], {d - (d > dim): r for d, r in roles.items() if d != dim})]
    if name == "permute":  # output dim d is input dim order[d]
        order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [(node.args[0], {order[d] % out.dim(): r for d, r in roles.items()})]
    if name == "embedding" and node.op == "call_function":  # F.embedding(ids, table): the table is read whole
        ids, table = node.args[:2]
        return [(ids, {d: r for d, r in roles.items() if d < example_value(ids).dim()}), (table, {})]
    if name in KEEP_VALUES or name in LIKE or name == "expand" or is_pointwise(node):
        args = [
            a
            for a in (*node.args, *node.kwargs.values())
            if isinstance(a, fx.Node) and isinstance(example_value(a), torch.Tensor)
        ]
        return [(a, _aligned(example_value(a), out, roles)) for a in args]
    return None


def _aligned(arg_value, out_value, roles) -> dict[int, str]:
    """Roles of a broadcast operand: right-aligned dims of equal size (a size-1 dim broadcasts: no role)."""
    shift = out_value.dim() - arg_value.dim()
    return {
        d - shift: r for d, r in roles.items() if d >= shift and same(arg_value.shape[d - shift], out_value.shape[d])
    }


def _getitem_roles(node: fx.Node, roles):
    source, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    source_value, out = example_value(source), example_value(node)
    if all(isinstance(i, fx.Node) for i in index):  # advanced indexing: out = broadcast(indices) + rest
        values = [example_value(i) for i in index]
        if not all(isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool for v in values):
            return None  # boolean (or non-tensor) indices select a data-dependent set
        k = max(v.dim() for v in values)
        broadcast = _Shape(out.shape[:k])
        result = [(i, _aligned(v, broadcast, {d: r for d, r in roles.items() if d < k})) for i, v in zip(index, values)]
        rest = {d - k + len(index): r for d, r in roles.items() if d >= k}
        return result + [(source, rest)]
    if _new_axes_only(index):
        kept = _kept_dims(index, source_value.dim())
        return [(source, {kept[d]: r for d, r in roles.items() if d in kept})]
    return None


def _kept_dims(index, rank: int) -> dict[int, int]:
    """For an index that only adds axes (`_new_axes_only`) on a tensor of ``rank`` dims: output dim -> input dim."""
    index = index if isinstance(index, tuple) else (index,)
    expanded = []
    for i in index:
        if i is Ellipsis:
            expanded += [slice(None)] * (rank - sum(1 for j in index if j is not None and j is not Ellipsis))
        else:
            expanded.append(i)
    kept, d_out, d_in = {}, 0, 0
    for i in expanded:
        if i is not None:
            kept[d_out] = d_in
            d_in += 1
        d_out += 1
    for extra in range(d_in, rank):  # trailing dims not named by the index
        kept[d_out] = extra
        d_out += 1
    return kept


class _Shape:
    """A stand-in with ``dim()`` and ``shape`` for the broadcast shape of advanced indices."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def dim(self):
        return len(self.shape)


# ---- 1. reading the region symbolically ---------------------------------------------------------------
@dataclass(frozen=True)
class _Linear:
    """An integer tensor equal to ``q * a + k * b + c`` at every (query position q, key position k)."""

    a: int
    b: int
    c: int

    def shifted(self, c: int) -> _Linear:
        return _Linear(self.a, self.b, self.c + c)


TRUE = frozenset()  # a conjunction of constraints (a, b, c) meaning q * a + k * b + c <= 0
CAUSAL = (-1, 1, 0)  # k - q <= 0
# Terms over per-token data, in the same conjunctions: (DOCUMENTS, ids node, None) means ids[q] == ids[k];
# (RELATIVE, positions node, (a, b, c)) means (a, b, c) over those positions, which holds of q and k themselves
# inside a document where they count up by one (restarting position ids: `_restarts_of`).
DOCUMENTS, APART, RELATIVE = "documents", "apart", "relative"  # (APART: ids[q] != ids[k])


@dataclass(frozen=True)
class _TokenRead:
    """A per-token table (data, not a shape formula) read at each pair's query (``role`` Q) or key (KV) position:
    ``ids[b, q_idx]``, ``ids[:, None]``. Two reads of one table compared are a documents term."""

    table: fx.Node
    role: str
    batch: int | None  # where the table's rows (the batch) sit in this value; None: a table of one row
    offset: int = 0  # added to what the table holds (``pos[b, q] - window``)

    def moved(self, node: fx.Node) -> _TokenRead:
        """The read after ``node``, a cast, ``unsqueeze``, ``expand`` or indexing that only adds axes: its rows'
        dim where that puts it."""
        if self.batch is None:
            return self
        source, out = example_value(node.args[0]).dim(), example_value(node).dim()
        name = op_name(node)
        if name == "getitem":
            return replace(
                self, batch={d_in: d_out for d_out, d_in in _kept_dims(node.args[1], source).items()}[self.batch]
            )
        if name == "unsqueeze":
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None) % out
            return replace(self, batch=self.batch + (dim <= self.batch))
        return replace(self, batch=self.batch + out - source)  # expand adds leading dims; casts keep them


COMPARE = {"le": (1, 0), "lt": (1, 1), "ge": (-1, 0), "gt": (-1, 1)}  # x OP y as sign*(x - y) + strict <= 0


class _Symbolic:
    """Evaluates the region over symbols; anything it cannot read makes the whole reading None."""

    def __init__(self, ctx: PassContext, region: MaskRegion, resize: tuple | None):
        self.ctx, self.region, self.resize = ctx, region, resize
        self.values: dict[fx.Node, object] = {}

    def read(self, kind: str) -> tuple[frozenset, bool]:
        """(the constraints the mask implies, whether they are all of it). A mask ANDs terms (a mask of hidden
        pairs ORs them: each read term is then negated); the terms read symbolically are implied even when others
        (a padding mask) are not. An additive mask that is ``where(kept, 0, hiding)`` (HF's eager attention) is read
        as its boolean ``kept``."""
        root = self.region.mask
        if kind == "additive":
            root, kind = self._kept_of_additive(root), "kept"
        if kind not in ("kept", "masked_out") or root is None:
            return TRUE, False
        joined = AND if kind == "kept" else OR
        implied, exact, stack = set(), True, [root]
        while stack:
            use = stack.pop()
            try:
                terms = _as_constraints(self._value(use))
                implied |= terms if kind == "kept" else _negated(terms)
            except LookupError:
                node, args = use[0], self.region.ops.get(use, {})
                if args and op_name(node) in joined:
                    stack += list(args.values())
                elif args and _keeps_values(node):
                    stack.append(args[node.args[0]])
                else:
                    exact = False
        return self._resolve_relative(implied, exact)

    def _kept_of_additive(self, use: Use) -> Use | None:
        """The use of ``kept`` where the additive mask ``use`` is ``where(kept, 0, x)`` (through casts and new axes)
        with ``x`` a number that hides a key (<= `MASKED_AT_OR_BELOW`: its weight is exactly 0 next to any visible
        key), else None."""
        while _keeps_values(use[0]) and use in self.region.ops:
            use = self.region.ops[use][use[0].args[0]]
        node = use[0]
        if node.target is not torch.where or len(node.args) != 3 or use not in self.region.ops:
            return None
        kept, zero, hiding = node.args
        if not (isinstance(hiding, (int, float)) and hiding <= MASKED_AT_OR_BELOW):
            return None
        zero_value = zero if not isinstance(zero, fx.Node) else _evaluate(self.ctx, zero, self.resize)
        if not (isinstance(zero_value, (int, float, torch.Tensor)) and bool((torch.as_tensor(zero_value) == 0).all())):
            return None
        if not isinstance(kept, fx.Node) or example_value(kept).dtype != torch.bool:
            return None
        return self.region.ops[use][kept]

    def _resolve_relative(self, implied: set, exact: bool) -> tuple[frozenset, bool]:
        """The reading with each `RELATIVE` term replaced by its constraint on q and k where the same conjunction
        holds a documents term of the positions' restarts (`_restarts_of`); without one it is not read (the mask is
        then not exactly its reading). Restarts of positions that count up by one everywhere (``arange + c``, read
        at the lengths this reading is for: HF's positions of an unpacked row under dynamic shapes) are one document:
        that documents term is dropped."""
        restarted = {_plain(_restarts_of(t[1])) for t in implied if t[0] == DOCUMENTS} - {None}
        one_document = {positions for positions in restarted if self._counts_up(positions)}
        resolved = set()
        for term in implied:
            if term[0] == DOCUMENTS and _plain(_restarts_of(term[1])) in one_document:
                continue
            if term[0] != RELATIVE:
                resolved.add(term)
            elif _plain(term[1]) in restarted:
                resolved.add(term[2])
            else:
                exact = False
        return frozenset(resolved), exact

    def _counts_up(self, positions: fx.Node) -> bool:
        """``positions`` is ``arange + c`` along its last dim (every row alike)."""
        rank = example_value(positions).dim()
        try:
            value = self._evaluated_input((positions, ((rank - 1, Q),)))
        except LookupError:
            return False
        return isinstance(value, _Linear) and (value.a, value.b) == (1, 0)

    def _value(self, use: Use):
        if use not in self.values:
            self.values[use] = self._op(use) if use in self.region.ops else self._input(use)
        return self.values[use]

    def _input(self, use: Use):
        """A region input, evaluated on the host when it depends on shapes only; per-token data of one row read at
        the pair's query or key position is a `_TokenRead`."""
        try:
            return self._evaluated_input(use)
        except LookupError:
            node, roles = use[0], dict(use[1])
            value = example_value(node)
            if len(roles) == 1 and _token_table(value):
                ((dim, role),) = roles.items()
                if dim % value.dim() == value.dim() - 1:
                    return _TokenRead(node, role, 0 if value.numel() > value.size(-1) else None)
            raise

    def _evaluated_input(self, use: Use):
        node, roles = use[0], dict(use[1])
        if self.resize is not None and not _shape_formula(node):
            raise LookupError  # dynamic shapes: only values computed from the length alone hold at every length
        value = _evaluate(self.ctx, node, self.resize)
        if not isinstance(value, torch.Tensor):
            raise LookupError
        if not roles:
            return value  # a table (or a scalar): indexed or broadcast by the region
        if len(roles) != 1:
            raise LookupError
        ((dim, role),) = roles.items()
        if not _constant_over_others(value, dim):
            raise LookupError
        offset = _offset_from_arange(value, dim)
        if offset is None:
            raise LookupError
        return _Linear(1, 0, offset) if role == Q else _Linear(0, 1, offset)

    def _op(self, use: Use):
        try:
            return self._symbolic_op(use)
        except LookupError:
            node = use[0]
            read = self._token_getitem(node, self.region.ops[use]) if op_name(node) == "getitem" else None
            if read is None:
                raise
            return read

    def _symbolic_op(self, use: Use):
        node, uses = use[0], self.region.ops[use]
        name = op_name(node)
        args = list(fx.node.map_arg(node.args, lambda arg: self._value(uses[arg]) if arg in uses else _not_read(arg)))
        if isinstance(args[0], _TokenRead) and (
            name in KEEP_VALUES | {"expand", "unsqueeze"} or (name == "getitem" and _new_axes_only(args[1]))
        ):
            if _casts_to_bool(node):
                raise LookupError
            return args[0].moved(node)
        if name in KEEP_VALUES or name in ("expand", "unsqueeze"):
            if isinstance(args[0], _Linear) and _casts_to_bool(node):
                raise LookupError  # a position cast to bool is "nonzero", not the position
            return args[0]
        if node.kwargs:  # alpha=, out=, rounding modes: not read
            raise LookupError
        if name == "getitem":
            return self._getitem(*args)
        if name in ("add", "sub") and len(args) == 2:
            x, y = args
            if isinstance(x, _Linear) and isinstance(y, int):
                return x.shifted(y if name == "add" else -y)
            if isinstance(y, _Linear) and isinstance(x, int) and name == "add":
                return y.shifted(x)
            if isinstance(x, _TokenRead) and isinstance(y, int) and not isinstance(y, bool):
                return replace(x, offset=x.offset + (y if name == "add" else -y))
        if name in COMPARE and all(isinstance(a, _Linear) for a in args):
            sign, strict = COMPARE[name]
            x, y = args
            a, b, c = sign * (x.a - y.a), sign * (x.b - y.b), sign * (x.c - y.c) + strict
            return _constant_truth(c <= 0) if (a, b) == (0, 0) else frozenset({(a, b, c)})
        if name == "eq" and all(isinstance(a, _Linear) for a in args) and args[0] == args[1]:
            return TRUE
        reads = [a for a in args if isinstance(a, _TokenRead)]
        if (
            len(reads) == len(args) == 2
            and reads[0].table is reads[1].table
            and {a.role for a in reads} == {Q, KV}
            and _rows_on_the_batch(reads, node, self.region.mask[0])
        ):
            if name in ("eq", "ne") and reads[0].offset == reads[1].offset == 0:
                return frozenset({(DOCUMENTS if name == "eq" else APART, reads[0].table, None)})
            if name in COMPARE:  # as if the table held q and k themselves: true inside a document of restarts
                sign, strict = COMPARE[name]
                x, y = ((1, 0, a.offset) if a.role == Q else (0, 1, a.offset) for a in args)
                constraint = (sign * (x[0] - y[0]), sign * (x[1] - y[1]), sign * (x[2] - y[2]) + strict)
                return frozenset({(RELATIVE, reads[0].table, constraint)})
        if name in AND and len(args) == 2:
            left, right = (_as_constraints(a) for a in args)
            return left | right
        raise LookupError

    def _token_getitem(self, node: fx.Node, uses) -> _TokenRead | None:
        """``table[b, q_idx]`` / ``table[q_idx]`` (HF's index-based masks): a per-token table, read whole, indexed by
        the query (or key) position along its last dim and, for a ``[B, S]`` table, by the batch's arange along
        the mask's batch dim."""
        if node.kwargs:
            return None
        source, index = node.args
        index = index if isinstance(index, tuple) else (index,)
        value = example_value(source)
        if uses.get(source) != (source, ()) or not _token_table(value) or len(index) != value.dim():
            return None
        if not all(isinstance(i, fx.Node) and i in uses for i in index):
            return None
        try:
            *batch, position = (self._value(uses[i]) for i in index)
        except LookupError:
            return None
        if not isinstance(position, _Linear) or (position.a, position.b, position.c) not in ((1, 0, 0), (0, 1, 0)):
            return None
        if batch and not _batch_arange(batch[0], value.size(0), example_value(node).dim()):
            return None
        return _TokenRead(source, Q if position.a else KV, 0 if batch and value.size(0) > 1 else None)

    def _getitem(self, source, index):
        """``table[..., linear]``: a table that is ``arange + c`` along that dim reads as linear + c."""
        if _new_axes_only(index):
            return source  # a symbol is broadcast-agnostic
        index = index if isinstance(index, tuple) else (index,)
        if not isinstance(source, torch.Tensor):
            raise LookupError
        linear = [(d, i) for d, i in enumerate(index) if isinstance(i, _Linear)]
        if len(linear) != 1 or not all(isinstance(i, torch.Tensor) for d, i in enumerate(index) if d != linear[0][0]):
            raise LookupError
        dim, position = linear[0]
        if (position.a, position.b) not in ((1, 0), (0, 1)) or position.c < 0 or not _constant_over_others(source, dim):
            raise LookupError  # (a negative index would wrap around to the table's end)
        if bool((source == source.flatten()[0]).all()):
            return _Linear(0, 0, int(source.flatten()[0]))
        offset = _offset_from_arange(source, dim)
        if offset is None:
            raise LookupError
        return position.shifted(offset)


SHAPE_FORMULA = KEEP_VALUES | {"arange", "add", "sub", "unsqueeze", "expand", "getitem", "size", *NEW_LIKE}


def _shape_formula(node: fx.Node) -> bool:
    """The value is the sequence length run through aranges, offsets and broadcasting only (no module
    state, no data, no op whose result could change its form with the length, like ``%`` or ``cumsum``):
    a reading of it at one length is its reading at every length. (``x.new_ones(())`` reads no value of ``x``.)"""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if not _shape_op(current):
            return False
        skipped = current.args[0] if current.op == "call_method" and current.target in NEW_LIKE else None
        stack += [arg for arg in current.all_input_nodes if arg is not skipped]
    return True


def _shape_op(node: fx.Node) -> bool:
    if node.op == "placeholder":
        return isinstance(example_value(node), torch.SymInt)
    if node.op not in ("call_function", "call_method") or op_name(node) not in SHAPE_FORMULA:
        return False
    return not (
        op_name(node) == "getitem"
        and isinstance(example_value(node.args[0]), torch.Tensor)
        and not _new_axes_only(node.args[1])
    )


def _casts_to_bool(node: fx.Node) -> bool:
    return op_name(node) == "bool" or torch.bool in (*node.args, *node.kwargs.values())


def _not_read(arg):
    raise LookupError


def _new_axes_only(index) -> bool:
    """An index that only adds axes or keeps dims whole (``x[:, None]``, ``x[None, ..., :]``)."""
    index = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index)


def _only_new_axes(node: fx.Node) -> bool:
    return op_name(node) == "getitem" and _new_axes_only(node.args[1])


def _as_constraints(value):
    if isinstance(value, frozenset):
        return value
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() > 0 and bool(value.all()):
        return TRUE
    raise LookupError


def _negated(terms: frozenset) -> frozenset:
    """The one term of ``terms`` negated (a hidden pair's condition, as a visible pair's): ``a*q + b*k + c <= 0``
    becomes ``-a*q - b*k + 1 - c <= 0`` (integers), documents and apart swap; several terms (or none) are not read."""
    if len(terms) != 1:
        raise LookupError
    ((kind, x, y),) = terms
    if kind in (DOCUMENTS, APART):
        return frozenset({(APART if kind == DOCUMENTS else DOCUMENTS, x, None)})
    if kind == RELATIVE:
        return frozenset({(RELATIVE, x, (-y[0], -y[1], 1 - y[2]))})
    return frozenset({(-kind, -x, 1 - y)})


def _constant_truth(holds: bool):
    if holds:
        return TRUE
    raise LookupError  # never visible: not a flag (the general path evaluates it)


def _constant_over_others(value: torch.Tensor, dim: int) -> bool:
    """The tensor varies along ``dim`` at most: every line along ``dim`` is the first one."""
    if value.dim() == 0:
        return True
    lines = value.movedim(dim, -1)
    return bool((lines == lines.reshape(-1, value.size(dim))[0]).all())


def _offset_from_arange(value: torch.Tensor, dim: int) -> int | None:
    """c when ``value`` equals ``arange(size) + c`` along ``dim`` (integers), else None."""
    if value.is_floating_point() or value.dtype == torch.bool:
        return None
    line = value.reshape(-1) if value.dim() == 1 else value.movedim(dim, -1).reshape(-1, value.size(dim))[0]
    offsets = line - torch.arange(line.numel(), dtype=line.dtype, device=line.device)
    return int(offsets[0]) if bool((offsets == offsets[0]).all()) else None


def _token_table(value) -> bool:
    """Integers of one token each along the last dim, at most ``[B, S]``: ids a mask may compare per pair."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() in (1, 2)
        and not value.is_floating_point()
        and value.dtype != torch.bool
    )


def _rows_on_the_batch(reads: list[_TokenRead], node: fx.Node, mask: fx.Node) -> bool:
    """The table has one row, or both reads' rows sit at one dim of ``node`` that lands on the batch dim of the
    4-D ``mask`` (``[B, H, n, m]``)."""
    if all(r.batch is None for r in reads):
        return True
    return (
        reads[0].batch == reads[1].batch
        and example_value(mask).dim() == 4
        and _lands_at(node, reads[0].batch, mask) == 0
    )


BROADCASTING = KEEP_VALUES | AND | OR | {"expand", "bitwise_not", "logical_not", "eq", "ne", "where", *COMPARE}


def _lands_at(node: fx.Node, dim: int, target: fx.Node) -> int | None:
    """Where dim ``dim`` of ``node``'s value lands in ``target``'s, along the one path of users from ``node`` to
    ``target`` through casts, broadcasting ops (dims align right), ``unsqueeze`` and indexing that adds axes; None
    where the path branches or passes another op."""
    while node is not target:
        if len(node.users) != 1:
            return None
        (user,) = node.users
        if user.op not in ("call_function", "call_method"):
            return None
        name, rank, out = op_name(user), example_value(node).dim(), example_value(user).dim()
        if name == "getitem" and user.args[0] is node and _new_axes_only(user.args[1]):
            dim = {d_in: d_out for d_out, d_in in _kept_dims(user.args[1], rank).items()}[dim]
        elif name == "unsqueeze" and user.args[0] is node:
            at = user.kwargs.get("dim", user.args[1] if len(user.args) > 1 else None) % out
            dim += at <= dim
        elif name in BROADCASTING:
            dim += out - rank
        else:
            return None
        node = user
    return dim


def _batch_arange(index, rows, out_rank: int) -> bool:
    """``index`` is ``arange(rows)`` along the first of ``out_rank`` dims (``b[:, None, None, None]``): a table's row b
    lands on the mask's batch b."""
    return (
        isinstance(index, torch.Tensor)
        and index.dim() == out_rank == 4
        and index.numel() == index.size(0) == rows
        and torch.equal(index.flatten().cpu(), torch.arange(rows))
    )


def _restarts_of(ids: fx.Node) -> fx.Node | None:
    """The positions ``p`` when ``ids`` is ``cumsum(diff(p) != 1)`` along the tokens (HF's
    ``find_packed_sequence_indices``: a document starts wherever position ids do not count up by one), else None.
    Inside a run of equal ids, ``p`` then counts up by one, so ``p[k] - p[q] == k - q`` there."""
    node = _plain(ids)
    if not (_calls(node, "cumsum") and _last_dim(node, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))):
        return None
    changed = _plain(node.args[0])
    if not _calls(changed, "ne") or len(changed.args) != 2 or changed.args[1] != 1:
        return None
    diff = _plain(changed.args[0])
    if not _calls(diff, "diff") or not _last_dim(
        diff, diff.kwargs.get("dim", diff.args[2] if len(diff.args) > 2 else -1)
    ):
        return None
    if len(diff.args) > 1 and diff.args[1] != 1 or diff.kwargs.get("n", 1) != 1 or "append" in diff.kwargs:
        return None
    return diff.args[0]


def _calls(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and op_name(node) == name


def _last_dim(node: fx.Node, dim) -> bool:
    rank = example_value(node).dim()
    return isinstance(dim, int) and dim % rank == rank - 1


def _plain(node):
    """The value under casts and broadcasts (``position_ids.expand(B, -1)`` is ``position_ids``)."""
    while (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and (op_name(node) in KEEP_VALUES | {"expand"})
    ):
        node = node.args[0]
    return node


# ---- 2. the mask program ------------------------------------------------------------------------------
def _program(
    ctx: PassContext, region: MaskRegion, kind: str, reshape: tuple | None = None, factor: float = 1.0
) -> fx.GraphModule:
    """``program(q_pos, kv_pos, *inputs)``: the region, with its per-token inputs restricted to the
    positions (``index_select`` along their role dims) and expands dropped (the ring broadcasts); a
    ``reshape`` (method name and arguments) brings its result to the ring's ``[B, H, n, m]``; a float
    result is multiplied by ``factor`` (a scale the model applies outside the mask or bias)."""
    graph = fx.Graph()
    positions = {Q: graph.placeholder("q_pos"), KV: graph.placeholder("kv_pos")}
    whole = {node: graph.placeholder(f"input_{i}") for i, node in enumerate(region.input_nodes)}
    env: dict[Use, fx.Node] = {}
    for node, roles in region.inputs:
        value = whole[node]
        for dim, role in roles:
            value = graph.call_method("index_select", (value, dim, positions[role]))
        env[(node, roles)] = value
    order = {node: i for i, node in enumerate(ctx.gm.graph.nodes)}
    for use in sorted(region.ops, key=lambda u: order[u[0]]):
        node, uses = use[0], region.ops[use]
        if op_name(node) == "expand":  # broadcasting later restores the shape; keep the rank
            missing = len(example_value(node).shape) - example_value(node.args[0]).dim()
            source = env[uses[node.args[0]]]
            env[use] = graph.call_function(operator.getitem, (source, (None,) * missing)) if missing else source
        else:
            env[use] = graph.node_copy(node, lambda arg, uses=uses: env[uses[arg]] if arg in uses else _unpassable(arg))
    result = env[region.mask]
    if kind == "masked_out":
        result = graph.call_function(operator.invert, (result,))
    if factor != 1.0:
        result = graph.call_function(operator.mul, (result, factor))
    if reshape is not None:
        result = graph.call_method(reshape[0], (result, *reshape[1:]))
    graph.output(result)
    return fx.GraphModule(torch.nn.Module(), graph, class_name="MaskProgram")


# ---- 3. masks from S x S inputs ------------------------------------------------------------------------
def _unpassable(arg: fx.Node):
    raise refusal(
        f"The attention mask uses {describe(arg)}, a size or value the ring cannot pass to its mask program; "
        "please report this model.",
        arg,
    )


def _shape_only_flags(
    ctx: PassContext, mask: fx.Node, kind: str, n, resize: tuple | None = None
) -> tuple[bool, int | None] | None:
    """A mask from an S x S tensor that depends on shapes only, evaluated once (at length ``n``; see
    `_evaluate` for ``resize``): (True, None) when it is exactly causal, (True, W) when it is causal within a
    band of W keys (a sliding-window buffer), else None."""
    n = n.node.hint if isinstance(n, torch.SymInt) else n
    values = _evaluate(ctx, mask, resize) if n <= MASK_LIMIT else None
    if values is None or values.dim() < 2:
        return None
    grid = values.reshape(-1, *values.shape[-2:])[..., -n:, -n:]
    try:
        visible, bias = (~grid.bool(), None) if kind == "masked_out" else split_additive(grid)
    except NotSupportedError as error:
        raise refusal(f"The attention mask at {describe(mask)}: {error}", mask) from None
    if bias is not None:
        raise refusal(
            f"The attention mask at {describe(mask)} adds a bias held as a sequence x sequence tensor; ring attention "
            "computes biases per tile from positions (ALiBi slopes, a bias built from position vectors), so no rank "
            "holds S x S values. Build the bias from positions.",
            mask,
        )
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    width = int(visible[..., -1, :].sum(-1).max()) if visible.numel() else 0
    for window in (None, width):
        band = causal if window is None else causal & ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        if window != 0 and bool((visible == band).all()):
            return True, window if window is not None and window < n else None
    return None


def _causal_from_sizes_alone(
    ctx: PassContext, region: MaskRegion, kind: str, n: torch.SymInt
) -> tuple[bool, int | None] | None:
    """With dynamic shapes, a mask from an S x S tensor that reads the sequence length only as the size of new
    tensors (``triu(full((S, S), -inf), 1)``: ``nn.Transformer.generate_square_subsequent_mask``) or as the end
    of a prefix of module state (a causal buffer ``self.bias[:, :, :S, :S]``), and is causal, or causal within
    one band of W keys, at each of `CHECK_LENGTHS`, at the example's and at the buffer's whole length: (True,
    None) or (True, W); else None. Such a mask is made of constants and of ops on positions, so a few lengths
    show what it is at all. A length used in arithmetic (a window ``min(S, W)``, a slice ``x[1:S]``) could
    change it at lengths not checked: not accepted."""
    longest = [_prefix_limits(big) for big in region.oversized]
    if any(limits is None for limits in longest):
        return None
    buffers = [x for limits in longest for x in limits]
    limit = min(buffers, default=MASK_LIMIT)  # a buffer's length: the longest prefix it has
    lengths = sorted(x for x in {*CHECK_LENGTHS, n.node.hint, *([limit] if buffers else [])} if x <= limit)
    flags = {length: _shape_only_flags(ctx, region.mask[0], kind, length, resize=(n, length)) for length in lengths}
    window = max((f[1] for f in flags.values() if f is not None and f[1] is not None), default=None)
    band = {length: (True, window if window is not None and window < length else None) for length in lengths}
    return (True, window) if flags == band else None


CHECK_LENGTHS = (1, 2, 3, 5, 8, 13, 32, 67)
FACTORIES = CREATORS | {torch.arange}


def _prefix_limits(node: fx.Node) -> list[int] | None:
    """The lengths of the module state ``node`` reads prefixes of, when every symbolic size it is computed
    from goes only into the sizes of tensor factories or the ends of such prefixes; else None."""
    limits = []
    for op in ancestors(node):
        sizes = [a for a in op.all_input_nodes if isinstance(example_value(a), torch.SymInt)]
        if (
            not sizes
            or op.target == "size"
            or (op.target is operator.getitem and isinstance(example_value(op.args[0]), (torch.Size, tuple)))
        ):
            continue
        prefix = _prefix_of_state(op)
        if prefix is not None:
            limits += prefix
            continue
        full = op.target in (torch.full, "new_full")
        fill_at = 1 if op.target is torch.full else 2
        fill = op.kwargs.get("fill_value", op.args[fill_at] if full and len(op.args) > fill_at else None)
        if op.target not in FACTORIES or fill in sizes:
            return None
    return limits


def _prefix_of_state(op: fx.Node) -> list[int] | None:
    """``state[:, :S, :S]`` on a parameter or buffer (slices from 0 with step 1): the state's sizes along the
    sliced dims; else None."""
    state = op.args[0] if op.target is operator.getitem else None
    if (
        not isinstance(state, fx.Node)
        or not (state.op == "get_attr" or is_module_state(state))
        or not isinstance(example_value(state), torch.Tensor)
    ):
        return None
    index = op.args[1] if isinstance(op.args[1], tuple) else (op.args[1],)
    shape = example_value(state).shape
    if not all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in index) or len(
        index
    ) > len(shape):
        return None
    return [int(shape[d]) for d, i in enumerate(index) if i.stop is not None]


def _mask_given_whole(ctx: PassContext, big: fx.Node) -> str:
    """A note for an S x S mask that arrives as a graph input: one built in another compiled graph crosses as its
    per-token description (`ringpass.frontend.crossing_masks`), so this one was built outside the compiled graphs, or in
    one whose mask could not be described."""
    if big.op != "placeholder" or is_module_state(big):
        return ""
    return (
        " (It arrives as an S x S tensor: it was built outside the graphs the ring compiles (the model's forward "
        "runs eagerly and only its blocks are compiled, so the mask is made whole before they run), or in a graph "
        "whose mask could not be described per token (one computed from a trainable value or an S x S tensor). "
        "Compile the code that builds the mask with the ring backend too, e.g. torch.compile(model, "
        "backend='ring') (FSDP2's hooks still break it into one graph per block): the mask then reaches the "
        "blocks as its per-token description, a ringpass.SequenceMask.)"
    )


def _unreadable_state(ctx: PassContext, mask: fx.Node) -> str:
    """A note naming the module state the mask reads whose values are not known (a model on the meta
    device): a causal buffer there cannot be checked."""
    names = [
        user_name(p)
        for p in placeholders_of(mask)
        if is_module_state(p)
        and "grapharg" in p.meta
        and ctx.host_values.get(id(p.meta["grapharg"].example), p.meta["grapharg"].example).device.type == "meta"
    ]
    return (
        (
            f" (The mask reads {', '.join(sorted(names))}, on the meta device: its values are unknown, so a causal "
            "buffer cannot be recognised. Build the model, or at least that buffer, on the CPU.)"
        )
        if names
        else ""
    )


def _evaluate(ctx: PassContext, node: fx.Node, resize: tuple | None = None):
    """The value of ``node`` when it depends on module state and shapes only (else None), computed on the
    host (CPU), whatever device the graph runs on. With dynamic shapes, sizes take the example's values;
    ``resize=(n, length)`` gives size inputs equal to the symbolic sequence length ``n`` the value
    ``length`` instead. Module state captured as meta tensors is read from ``ctx.host_values``."""
    env: dict[fx.Node, object] = {}

    def on_host(arg):
        return torch.device("cpu") if isinstance(arg, torch.device) else arg

    def value(n: fx.Node):
        if n in env:
            return env[n]
        if n.op == "placeholder":
            v = example_value(n)
            if isinstance(v, torch.SymInt):
                env[n] = resize[1] if resize is not None and same(v, resize[0]) else v.node.hint
            elif is_module_state(n):
                state = n.meta["grapharg"].example
                state = ctx.host_values.get(id(state), state)
                if state.device.type == "meta":
                    raise LookupError  # a model built on the meta device: no values to read
                env[n] = state.cpu()
            else:
                raise LookupError
            return env[n]
        if n.op == "get_attr":
            env[n] = getattr(ctx.gm, n.target)
            return env[n]
        if n.op == "call_method" and n.target in NEW_LIKE:  # the source's dtype only, not its values (HF's and_masks)
            source = torch.empty((), dtype=example_value(n.args[0]).dtype)
            args = fx.node.map_aggregate(fx.node.map_arg(n.args[1:], value), on_host)
            kwargs = fx.node.map_aggregate(fx.node.map_arg(n.kwargs, value), on_host)
            env[n] = getattr(source, n.target)(*args, **kwargs)
            return env[n]
        args = fx.node.map_aggregate(fx.node.map_arg(n.args, value), on_host)
        kwargs = fx.node.map_aggregate(fx.node.map_arg(n.kwargs, value), on_host)
        env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        return env[n]

    try:
        with torch.no_grad():
            return value(node)
    except (LookupError, RuntimeError, IndexError, ValueError):  # an input, or sizes that do not fit (resize)
        return None
