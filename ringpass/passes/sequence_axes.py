"""Find the sequence axis of every value, by running the graph at another sequence length.

Matches: the sequence length N is the attentions' query length, the length the sequence mixers (``ctx.mixers``) run
along and the length of the inputs that arrive sequence-sharded (``ctx.carried_inputs``; all must agree). Sources of the
sequence axis are user inputs with a dimension of N (batch-first: dim 1 when it fits), ``arange(N)``
(positions), tensors created with a size N, and slices ``[:N]`` of module state (position tables); the
slots of a `ringpass.ShardedCache` (``ringpass::prompt_slots``) have none, whatever the prompt's length.
Every other node is executed on fake tensors with the sequence resized to N+1 (a probe): the dimensions
whose size moved are its sequence axes. The nodes inside a hand-written attention (scores, soft-cap, bias,
probabilities: the rewrite removes them) are not run; the attention's output is probed from q and v, a sequence mixer's
from its input (a mixer that does not run along its input's sequence axis is dropped from ``ctx.mixers``: a
convolution then mixes tokens, a cumsum is an ordinary op). Ops
that spell sizes literally (``view``, ``reshape``, ``expand``, ``repeat``) are given the probe's sizes by
`resize_size_args`, which the shape rewrite reuses for the real local length.

Writes ``ctx.sequence`` (`SequenceFindings`): ``seq_len`` (N), ``global_seq_len`` (N x P with
``inputs="sharded"``), ``axes`` (node -> `SeqDim`s), ``sources`` (where the sequence axis comes from),
``length_nodes`` (SymInt inputs equal to N, with dynamic shapes), ``mixing`` (ops that move information between
tokens, with why) and ``reductions`` (per-token values reduced over the sequence: sum, mean, cross-entropy, a
pick of a few tokens). An op that cannot run at the probe's length because it cuts the sequence into chunks, or
because it reads a value a loop over the tokens left at the traced length, inside a function call that reads and
returns per-token values, makes that call a `WholeRegion` (``ctx.sequence.regions``, `ringpass.fx.call_regions`):
computed whole on every rank, its nodes unprobed, its outputs probed at the probe's length; the probe starts again
from the call. Under dynamic shapes with whole inputs, a chunked scan (read up front: a reshape cutting the sequence
into chunks of a length the op spells), a call computed whole or an op that fails at the probe's length raises
`NeedsStaticShapes`: the front end has Dynamo trace the frame again at static sizes (where such an op is refused or
runs). Refuses those with sharded inputs, attentions over different lengths, a
reshape that splits the sequence, and any other op that fails at the probe's length (its sizes do not follow the
sequence).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from lowering import compat
from lowering.errors import NotSupportedError
from ringpass.fx.call_regions import boundary, enclosing_calls
from ringpass.fx.context import PassContext
from ringpass.fx.findings import MixerMatch, SeqDim, WholeRegion
from ringpass.fx.nodes import (
    describe,
    example_value,
    is_module_state,
    is_vmap_bookkeeping,
    op_label,
    probing,
    refusal,
    user_name,
)
from ringpass.fx.runner import FAKE_EQUIVALENTS
from ringpass.fx.sizes import chunked_scan, is_size_op, resize_size_args, same, value_of, view_target_dim
from ringpass.fx.spellings import CREATORS, EXPANDS, FLATTENS, PROMPT_SLOTS, VIEWS, op_name
from ringpass.fx.static_shapes import needs_static_shapes
from ringpass.fx.token_ops import classify, custom_forward, split_takes_everything, whole_slices_spelled


def find_sequence_axes(ctx: PassContext) -> None:
    lengths = [example_value(m.query).shape[-2] for m in ctx.attention]
    lengths += [example_value(node).shape[dim] for node, dim in ctx.carried_inputs.items()]
    if lengths:  # a mixer of another length is no sequence mixer (a convolution over a side input)
        ctx.mixers[:] = [m for m in ctx.mixers if same(example_value(m.input).shape[m.dim], lengths[0])]
    else:  # a graph whose only sequence mixers are convolutions and cumsums
        lengths = [example_value(m.input).shape[m.dim] for m in ctx.mixers]
    if not all(same(n, lengths[0]) for n in lengths):
        raise NotSupportedError(
            "The attentions, sequence mixers and sequence-sharded inputs of this graph have different lengths "
            f"{lengths}; ringpass shards one sequence."
        )
    ctx.sequence.seq_len = lengths[0]
    ctx.sequence.global_seq_len = (
        ctx.sequence.seq_len * ctx.world_size if ctx.options.inputs == "sharded" else ctx.sequence.seq_len
    )
    _Probe(ctx).run()
    if ctx.sequence.regions and (ctx.dynamic or ctx.options.inputs == "sharded"):
        region = ctx.sequence.regions[0]
        raise needs_static_shapes(
            ctx,
            f"`{region.function}` ({region.call_site}) runs whole on every rank ({region.why}), which ringpass does "
            "with static shapes and whole inputs only (its sizes are the traced ones): compile with "
            "dynamic=False and inputs='full'.",
            f"`{region.function}` ({region.call_site}) runs whole at its traced sizes ({region.why})",
            region.internal[0],
        )


class _Probe:
    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.n = ctx.sequence.seq_len
        self.probe_len = ctx.sequence.seq_len + 1
        self.values: dict[fx.Node, object] = {}
        self.open_vmap_levels = 0  # vmap levels the probe opened and has not closed yet
        self.inner_by_size: dict[object, int] = {_key(self.n): 1}
        self.attention_outputs = {m.output: m for m in ctx.attention}
        self.inside_attention = {n for m in ctx.attention for n in m.internal if n is not m.output}
        self.inside_attention |= {n for m in ctx.mixers for n in m.internal}  # a convolution's longer output
        self.mixer_outputs = {m.output: m for m in ctx.mixers}
        self.reads_inputs: dict[fx.Node, bool] = {}  # computed from an input other than module state
        self.region_nodes: set[fx.Node] = set()  # function calls computed whole (`ctx.sequence.regions`)
        self.region_exits: dict[fx.Node, int] = {}  # their values read outside them -> sequence dim
        self.current: fx.Node | None = None  # the node being probed

    def run(self) -> None:
        try:
            with probing(self.ctx.gm.graph):  # hypothetical sizes: no guards, failures are answers
                order = [node for node in self.ctx.gm.graph.nodes if node.op != "output"]
                i = 0
                while i < len(order):
                    try:
                        self._step(order[i])
                        i += 1
                    except _Rewind as rewind:  # a function call found to run whole: probe again from its start
                        start = order.index(rewind.start)
                        for node in order[start:i]:
                            self._forget(node)
                        i = start
        finally:
            for _ in range(self.open_vmap_levels):  # a refusal inside a vmap nest: close its levels
                compat.vmap_decrement_nesting()

    # ---- one node -------------------------------------------------------------------------------
    def _step(self, node: fx.Node) -> None:
        self.current = node
        self.reads_inputs[node] = (node.op == "placeholder" and not is_module_state(node)) or any(
            self.reads_inputs[a] for a in node.all_input_nodes
        )
        self.values[node] = self._probe(node)
        if node in self.region_exits or node not in self.region_nodes:
            self._record_axes(node)
        if node not in self.region_nodes:
            self._record_role(node)

    def _forget(self, node: fx.Node) -> None:
        """Undo what probing ``node`` recorded."""
        sequence = self.ctx.sequence
        for found in (sequence.axes, sequence.mixing, sequence.reductions, sequence.sources):
            found.pop(node, None)
        if self.values.pop(node, None) is not None and _opens_or_closes_a_vmap_level(node):
            self.open_vmap_levels -= _vmap_levels_opened([node])

    def _probe(self, node: fx.Node):
        original = example_value(node)
        if node.op == "placeholder":
            return self._probe_placeholder(node, original)
        if node.op == "get_attr" or node in self.inside_attention or node.target in PROMPT_SLOTS:
            return original  # a KV cache's slots are this rank's, whatever the prompt's length
        if node in self.region_exits:  # computed whole, read per token outside: at the probe's length
            return self._resized(original, [self.region_exits[node]])
        if node in self.region_nodes:
            return original
        if node in self.attention_outputs:  # out: q's leading dims and v's head dim (flex: and an LSE)
            match = self.attention_outputs[node]
            q, v = self.values[match.query], self.values[match.value]
            if isinstance(original, tuple):
                return tuple(
                    q.new_empty((*q.shape[:-1], v.shape[-1]) if i == 0 else q.shape[:-1], dtype=item.dtype)
                    for i, item in enumerate(original)
                )
            return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=original.dtype)
        if node in self.mixer_outputs:  # a sequence mixer keeps its input's shape
            value = self.values[self.mixer_outputs[node].input]
            return value.new_empty(value.shape, dtype=original.dtype) if isinstance(value, torch.Tensor) else original
        if node.op == "call_method" and node.target in CREATORS and self._source_kind(node, original):
            self.ctx.sequence.sources[node] = "created"  # x.new_empty(B, H, N, D): sizes spelled, like torch.zeros
            return self._resized(original, [d for d, s in enumerate(original.shape) if same(s, self.n)])
        if _opens_or_closes_a_vmap_level(node):  # functorch's global state: run whatever the inputs
            self.open_vmap_levels += _vmap_levels_opened([node])
        elif not any(self.ctx.sequence.axes.get(a) or self._tuple_has_seq(a) for a in node.all_input_nodes):
            source = self._source_kind(node, original)
            if source is not None:
                self.ctx.sequence.sources[node] = source
                return self._resized(original, [d for d, s in enumerate(original.shape) if same(s, self.n)])
            if not any(self._changed(a) for a in node.all_input_nodes):
                return original
        if self.ctx.dynamic and self._chunk_cut(node, static_chunk=True):  # its sizes follow a symbolic length,
            raise needs_static_shapes(  # but Dynamo unrolled the loop over its chunks at the traced count
                self.ctx,
                f"{describe(node)} cuts the sequence into chunks: a chunked scan, whose loop over its chunks Dynamo "
                "unrolled at the traced count, which ringpass runs with static shapes and whole inputs only: compile "
                "with dynamic=False and inputs='full'.",
                f"a chunked scan ({describe(node)} cuts the sequence into chunks) runs at its traced sizes only",
                node,
            )
        try:
            args, kwargs = self._probe_args(node)
            if node.op == "call_function" and node.target is torch.ops.higher_order.autograd_function_apply:
                return custom_forward(node)(*args[2:])[0]  # the Function's forward body: (outputs, saved)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return FAKE_EQUIVALENTS.get(node.target, node.target)(*args, **kwargs)
        except Exception as error:  # an op whose sizes do not follow its input's sequence length
            scan = self._chunk_cut(node)
            self._compute_whole(
                node, f"a chunked scan (`{op_label(node)}` cuts the sequence into chunks)" if scan else ""
            )
            if isinstance(error, NotSupportedError):
                raise
            why = scan or (
                " It combines a value that follows the sequence length with one whose size stays at the traced "
                "length: typically a loop over the sequence that Dynamo unrolled (a recurrence: a state-space scan, "
                "linear attention), which cannot be sharded along the sequence yet, or a size read from a tensor's "
                "data. If neither fits, please report this model."
            )
            raise needs_static_shapes(  # under dynamic shapes: its sizes may follow the length at static ones
                self.ctx,
                f"{describe(node)} cannot run on a sequence shard: {type(error).__name__}: {error}.{why}",
                f"{describe(node)} fails at another length while sizes are symbolic ({type(error).__name__})",
                node,
            ) from None

    def _chunk_cut(self, node: fx.Node, static_chunk: bool = False) -> str:
        """Where ``node`` (a reshape, view or unflatten) cuts the sequence into chunks at the traced sizes, the
        sentence saying so (`chunked_scan`); else "". A chunked scan's loop over its chunks is unrolled at the traced
        count: with static shapes the probe's length fails the reshape, with dynamic ones it does not."""
        if node.op not in ("call_method", "call_function") or not (
            node.target in VIEWS or op_name(node) == "unflatten"
        ):
            return ""
        axes = self.ctx.sequence.axes.get(node.args[0], ())
        return "".join(chunked_scan(node, axis, self.n, static_chunk=static_chunk) for axis in axes)

    def _probe_placeholder(self, node: fx.Node, original):
        if isinstance(original, torch.SymInt) and same(original, self.n):
            self.ctx.sequence.length_nodes.add(node)  # dynamic shapes: the sequence length as an input
            return original + 1
        if not isinstance(original, torch.Tensor) or is_module_state(node):
            return original
        dims = [d for d, s in enumerate(original.shape) if same(s, self.n)]
        if not dims:
            return original
        if isinstance(self.n, torch.SymInt) and 0 in dims and len(dims) > 1:
            raise refusal(
                f"Input `{user_name(node)}` has shape {tuple(original.shape)}: its batch size and its sequence length "
                "are one symbol. With dynamic shapes Dynamo gives sizes that are equal in the first call one symbol "
                "(duck sizing), and ringpass then cannot tell the batch from the sequence. Make the first call with "
                "a batch size other than the sequence length, or compile with static shapes.",
                node,
            )
        self.ctx.sequence.sources[node] = "input"
        if 1 not in dims and original.dim() == 4 and {2, 3} <= set(dims):
            return self._resized(original, [2, 3])  # a [B, 1 or H, S, S] mask
        return self._resized(original, [1 if 1 in dims else dims[0]])

    def _source_kind(self, node: fx.Node, original) -> str | None:
        if not isinstance(original, torch.Tensor) or not any(same(s, self.n) for s in original.shape):
            return None
        if node.target is torch.arange and original.dim() == 1:
            args = [value_of(a) for a in node.args if not isinstance(a, torch.device)]
            start, step = (args[0] if len(args) > 1 else 0), (args[2] if len(args) > 2 else 1)
            return "positions" if same(start, 0) and same(step, 1) else None
        if node.target in CREATORS:
            return "created"
        if node.target is operator.getitem and isinstance(node.args[1], (slice, tuple)):
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if any(isinstance(i, slice) and same(value_of(i.stop), self.n) and i.start in (None, 0) for i in index):
                # a table's first N rows (positions); not a value computed from the inputs whose sequence axis the
                # probe lost (Mamba2's scan output on transformers 5.25, padded to whole chunks, then cut to N)
                return None if self.reads_inputs[node.args[0]] else "sliced"
        return None

    def _resized(self, original: torch.Tensor, dims: list[int]):
        shape = list(original.shape)
        for d in dims:
            shape[d] = self.probe_len
        return torch.empty(shape, dtype=original.dtype, device=original.device)

    def _probe_args(self, node: fx.Node):
        args = map_aggregate(node.args, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(node.kwargs, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
        if is_size_op(node):
            resized = resize_size_args(node, self.ctx.sequence.axes.get(node.args[0], ()), self.probe_len, self.n)
            args = map_aggregate(resized, lambda a: self.values[a] if isinstance(a, fx.Node) else a)
        elif node.target is operator.getitem and self.ctx.sequence.axes.get(node.args[0]):
            args = (args[0], self._whole_slices(node))
        elif op_name(node) == "tensor_split" and self.ctx.sequence.axes.get(node.args[0]):
            if split_takes_everything(node):  # everything at the probe's length too
                args = (args[0], [self.probe_len] * len(node.args[1]), *args[2:])
        return args, kwargs

    def _whole_slices(self, node: fx.Node):
        """A getitem's index with each slice that takes the whole sequence at the traced length (``x[:, -N:]``,
        ``x[..., :N]``: Lfm2 and Mamba2 slice their padding mask so, OLMo-Hybrid its convolution's output) spelled
        ``:`` (`whole_slices_spelled`), its tensors the probe's."""
        axes = self.ctx.sequence.axes[node.args[0]]
        spelled = whole_slices_spelled(node.args[1], example_value(node.args[0]).shape, axes)
        return map_aggregate(spelled, lambda a: self.values[a] if isinstance(a, fx.Node) else a)

    def _changed(self, node: fx.Node) -> bool:
        """The probe changed this node's value: a sequence axis, a tuple holding one, or a length."""
        value = self.values.get(node)
        if isinstance(value, torch.SymInt):
            return not same(value, example_value(node))
        return bool(self.ctx.sequence.axes.get(node)) or self._tuple_has_seq(node)

    def _tuple_has_seq(self, node: fx.Node) -> bool:
        value = self.values.get(node)
        original = example_value(node)
        if not isinstance(value, (tuple, list)) or not isinstance(original, (tuple, list)):
            return False
        return any(isinstance(v, torch.Tensor) and not _same_shape(v.shape, o.shape) for v, o in zip(value, original))

    # ---- function calls computed whole ------------------------------------------------------------
    def _compute_whole(self, node: fx.Node, scan: str) -> None:
        """``node`` cannot run on a shard. Where it cuts the sequence into chunks (``scan``: a chunked scan) or reads
        a value that lost its sequence axis (a loop over the tokens unrolled at the traced length: a selective scan),
        the innermost function call around that value, or else around ``node``, that reads and returns per-token
        values becomes a `WholeRegion`, and the probe starts again from the call's first node (`_Rewind`). Returns
        when there is none (another op that cannot run on a shard is refused, not computed whole)."""
        lost = self._lost_sequence(node)  # a value computed before lost it: that is where to look first
        for start in (*lost, node) if scan else lost:
            why = "a loop over the sequence, unrolled at the traced length" if start in lost else scan
            for function, call_site, nodes in enclosing_calls(self.ctx.gm.graph, start):
                region = self._region(function, call_site, nodes, why)
                if region is not None:
                    self.ctx.sequence.regions.append(region)
                    self.region_nodes.update(region.internal)
                    self.region_exits.update(region.exits)
                    raise _Rewind(region.internal[0])

    def _lost_sequence(self, node: fx.Node) -> list[fx.Node]:
        """The values ``node`` reads, directly or through others like them, that were computed from the inputs and
        have a dim of the sequence's length the probe did not move."""
        lost, stack = [], list(node.all_input_nodes)
        while stack and len(lost) < 64:
            value = stack.pop(0)
            original = example_value(value)
            if value in lost or self.ctx.sequence.axes.get(value) or not self.reads_inputs.get(value):
                continue
            if isinstance(original, torch.Tensor) and any(same(size, self.n) for size in original.shape):
                lost.append(value)
                stack += value.all_input_nodes
        return lost

    def _region(self, function: str, call_site: str, nodes: list[fx.Node], why: str) -> WholeRegion | None:
        """The call as a `WholeRegion`, if it can be one: no attention or other sequence mixer inside it, every
        entry with a sequence axis holding it alone (the all-gather's dim), every exit a tensor with a dim of the
        sequence's length."""
        inside = set(nodes)
        if inside & (self.inside_attention | set(self.attention_outputs) | set(self.mixer_outputs) | self.region_nodes):
            return None
        order = list(self.ctx.gm.graph.nodes)
        probed_again = order[order.index(nodes[0]) : order.index(self.current) + 1]
        if _vmap_levels_opened(probed_again) or _vmap_levels_opened(nodes):
            return None  # functorch's levels are global state: probed again, each level opened must close
        entries, exits = boundary(nodes)
        if not any(self.ctx.sequence.axes.get(e) for e in entries):
            return None
        for entry in entries:
            axes = self.ctx.sequence.axes.get(entry, ())
            if self._tuple_has_seq(entry) or (axes and (len(axes) != 1 or not self._sequence_alone(entry))):
                return None
        exit_dims = []
        for node in exits:
            value = example_value(node)
            shape = value.shape if isinstance(value, torch.Tensor) else ()
            dims = [d for d, size in enumerate(shape) if same(size, self.n)]
            if not dims:
                return None
            exit_dims.append((node, 1 if 1 in dims else dims[0]))
        return WholeRegion(function, call_site, tuple(nodes), tuple(entries), tuple(exit_dims), why)

    # ---- what the probe says ----------------------------------------------------------------------
    def _record_axes(self, node: fx.Node) -> None:
        original, probe = example_value(node), self.values[node]
        if not isinstance(original, torch.Tensor) or not isinstance(probe, torch.Tensor):
            return
        moved = [d for d in range(original.dim()) if not same(original.shape[d], probe.shape[d])]
        inputs_have_seq = any(self.ctx.sequence.axes.get(a) or self._tuple_has_seq(a) for a in node.all_input_nodes)
        if not moved:
            return
        if len(moved) > 1 and node.op != "placeholder" and node not in self.ctx.sequence.sources:
            self.ctx.sequence.mixing[node] = "it builds a sequence x sequence tensor"
        axes = []
        for d in moved:
            size = original.shape[d]
            inner = self._inner(node, d, size)
            aligned = (
                inner is not None
                and same(size % (self.n * inner), 0)
                and same(probe.shape[d], size // self.n * self.probe_len)
            )
            axes.append(SeqDim(d, inner or 1, aligned))
            if aligned:
                self.inner_by_size.setdefault(_key(size), inner)
        self.ctx.sequence.axes[node] = tuple(axes)
        if inputs_have_seq and not all(a.aligned for a in axes):
            self.ctx.sequence.mixing.setdefault(
                node, "it changes the sequence length (a shift, slice, pad or concatenation)"
            )
        if any(not a.aligned for arg in node.all_input_nodes for a in self.ctx.sequence.axes.get(arg, ())):
            self.ctx.sequence.mixing.setdefault(node, "it reads a shifted or resized sequence")

    def _inner(self, node: fx.Node, dim: int, size: int) -> int | None:
        if is_size_op(node) or node.target in FLATTENS:
            return _view_inner(node, self.ctx.sequence.axes[node.args[0]], dim, self.n)
        if same(size, self.n):
            return 1
        return self.inner_by_size.get(_key(size))

    def _record_role(self, node: fx.Node) -> None:
        """Per-token op, reduction over the sequence, or token mixing (see `token_ops.classify`)."""
        if node.op not in ("call_function", "call_method"):
            return
        if node in self.mixer_outputs and self._runs_along_the_sequence(self.mixer_outputs[node]):
            return  # rewrite_sequence_mixers runs it on this rank's tokens
        if not any(self.ctx.sequence.axes.get(a) or self._tuple_has_seq(a) for a in node.all_input_nodes):
            return
        output_has_seq = bool(self.ctx.sequence.axes.get(node)) or self._tuple_has_seq(node)
        role, why = classify(node, lambda a: {axis.dim for axis in self.ctx.sequence.axes.get(a, ())}, output_has_seq)
        if role == "pick" and not self._sequence_alone(node.args[0]):
            role, why = "mixing", "it picks tokens by index from a sequence axis merged with others (batch x sequence)"
        if role == "mixing":
            self.ctx.sequence.mixing.setdefault(node, why)
        elif role != "token":
            self.ctx.sequence.reductions[node] = role

    def _sequence_alone(self, node: fx.Node) -> bool:
        """Every sequence axis of ``node`` holds the sequence alone (no batch or other dim merged into it): what a pick
        by position needs (an index into ``x.reshape(B * N, D)`` is no position; JetMoE's routing indexes so)."""
        value = example_value(node)
        return all(
            axis.inner == 1 and axis.aligned and same(value.shape[axis.dim], self.n)
            for axis in self.ctx.sequence.axes.get(node, ())
        )

    def _runs_along_the_sequence(self, mixer: MixerMatch) -> bool:
        """The mixer's dim is its input's only sequence axis, the sequence itself (no other dim merged in). If not,
        it is no sequence mixer: a convolution that is not along the sequence mixes tokens (its slice reads a resized
        sequence), a cumsum along another dim is an ordinary op."""
        if self.ctx.sequence.axes.get(mixer.input, ()) == (SeqDim(mixer.dim, 1, True),):
            return True
        self.ctx.mixers.remove(mixer)
        del self.mixer_outputs[mixer.output]
        if mixer.internal and self.ctx.sequence.axes.get(mixer.input):
            self.ctx.sequence.mixing[mixer.output] = f"it reads a {mixer.describe()} not along the sequence axis"
        return False


class _Rewind(Exception):
    """`_Probe._compute_whole` found a function call to run whole: probe again from ``start``, its first node."""

    def __init__(self, start: fx.Node):
        super().__init__(start.name)
        self.start = start


def _vmap_levels_opened(nodes) -> int:
    """How many vmap levels ``nodes`` open and leave open (negative: close)."""
    return sum(
        1 if node.target.__name__ == "_vmap_increment_nesting" else -1
        for node in nodes
        if _opens_or_closes_a_vmap_level(node)
    )


def _opens_or_closes_a_vmap_level(node: fx.Node) -> bool:
    return is_vmap_bookkeeping(node) and node.target.__name__ in ("_vmap_increment_nesting", "_vmap_decrement_nesting")


def _view_inner(node: fx.Node, in_axes, dim: int, n: int) -> int | None:
    in_shape = example_value(node.args[0]).shape
    out_shape = example_value(node).shape
    for axis in in_axes:
        if not axis.aligned:  # a shifted or resized sequence: read whole (a mixing op), no inner factor
            continue
        if node.target in EXPANDS:
            if axis.dim + out_shape.__len__() - len(in_shape) == dim:
                return axis.inner
        else:
            j, inner = view_target_dim(node, axis, n)
            if j == dim:
                return inner
    return None


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _key(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size
