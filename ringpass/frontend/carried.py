"""Values that cross graph boundaries sharded: `SequenceSharded` inputs in, `SequenceSharded` outputs out.

Dynamo traces a `SequenceSharded` input as a plain tensor of the global shape. Before the passes run,
`take_carried_inputs` checks it against the ring (same ranks; one layout for the whole graph), gives its placeholder
a plain example value of that shape, and records it in ``ctx.carried_inputs``: the passes then treat the graph as
one with full inputs, except that a carried input arrives as this rank's tokens (no ``shard_sequence``, no gather).
After them, the inner compiler is given each carried input's local tokens as its example (`local_examples`), and
`CarriedGraph` runs the compiled graph: it unwraps carried inputs (differentiably), calls the graph, and wraps the
outputs ``insert_boundaries`` left sharded (``outputs="auto"``, ``ctx.carried_outputs``) with their layout.
With dynamic shapes the graph returns the global length as one more output, so a wrapped output knows it; in the
documents layout it returns the host copy of the document ids too, and a graph receiving such values takes those ids
as one more input (`_take_document_ids`), so both plan the same layout.
"""

from __future__ import annotations

import torch

from lowering import compat
from lowering.errors import InvalidInputError, NotSupportedError
from lowering.layout import DOCUMENTS_KIND, local_length
from lowering.sequence_tensor import SequenceSharded, SequenceSpec, carry
from ringpass.frontend.crossing_masks import wrap_mask_outputs
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import example_value, is_module_state, user_name
from ringpass.fx.sizes import same


def take_carried_inputs(ctx: PassContext) -> None:
    """Records the graph's `SequenceSharded` inputs in ``ctx.carried_inputs`` (placeholder -> sequence dim) and
    gives their placeholders plain example values of the global shape; refuses one the ring cannot take."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    kinds = set()
    for node, value in zip(placeholders, ctx.example_inputs):
        if not isinstance(value, SequenceSharded):
            continue
        spec, name = value.spec, user_name(node)
        if spec.world_size != ctx.world_size or spec.group_name != ctx.group_name:
            raise InvalidInputError(
                f"Input {name} is sequence-sharded over {spec.world_size} ranks of group '{spec.group_name}', "
                f"but this ring runs over {ctx.world_size} ranks of group '{ctx.group_name}'. Compile every graph "
                "that passes it on with the same group."
            )
        if spec.rows != 1:
            raise NotSupportedError(
                f"Input {name} holds {spec.rows} sequences one after the other along dim {spec.dim} (a view merged "
                "the batch into the sequence); view it back to [batch, sequence, ...] before the compiled call."
            )
        if ctx.ulysses:
            raise NotSupportedError(
                f"Input {name} is a SequenceSharded value, and this graph runs Ulysses x ring, whose token order "
                "it does not carry yet; pass it whole (.full_tensor()) or compile this graph without ulysses."
            )
        if ctx.options.inputs == "sharded":
            raise InvalidInputError(
                f"Input {name} is a SequenceSharded value, which says it is sharded; inputs='sharded' is for plain "
                "local shards. Compile with inputs='full' (the default): full inputs are sharded, carried ones kept."
            )
        kinds.add(spec.kind)
        traced = example_value(node)
        if isinstance(traced, SequenceSharded):  # of fake tokens: the passes see a plain tensor of its shape
            node.meta["example_value"] = traced._local.new_empty(traced.shape).requires_grad_(traced.requires_grad)
        ctx.carried_inputs[node] = spec.dim
    if len(kinds) > 1:
        raise InvalidInputError(f"The graph's sequence-sharded inputs come in different layouts {sorted(kinds)}.")
    if kinds and ctx.options.layout not in ("auto", *kinds):
        raise InvalidInputError(
            f"The graph's inputs are sequence-sharded in the {kinds.pop()} layout, but the backend was given "
            f"layout='{ctx.options.layout}'. Give every ring graph of the model the same layout (or 'auto')."
        )
    ctx.carried_layout = kinds.pop() if kinds else ""
    if ctx.carried_layout == DOCUMENTS_KIND:
        _take_document_ids(ctx)
    _same_length_as_carried(ctx)


def _take_document_ids(ctx: PassContext) -> None:
    """Inputs in the documents layout: the graph gets one more input, last, for the host copy of the document ids
    their layout was planned from (`CarriedGraph` passes the first carried input's), as ``ctx.document_ids``:
    `read_document_ids` copies it once per call, and every sequence op of this graph plans the same layout."""
    graph = ctx.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = next(i for i, n in enumerate(placeholders) if n in ctx.carried_inputs)
    carried, value = placeholders[index], ctx.example_inputs[index]
    if value.spec.documents is None:
        raise InvalidInputError(
            f"Input {user_name(carried)} is a SequenceSharded value in the documents layout without the document ids "
            "its layout is planned from (SequenceSharded.from_local takes none); pass it whole, or wrap shards of the "
            "zigzag layout."
        )
    traced = example_value(carried)
    with graph.inserting_after(placeholders[-1]):
        ids = graph.placeholder(f"{carried.name}_document_ids")
    shape = (value.spec.documents.shape[0], traced.shape[ctx.carried_inputs[carried]])
    ids.meta["example_value"] = traced.new_empty(shape, dtype=torch.int64, device="cpu")
    source = compat.dynamo_source(carried)
    if source is not None:  # AOTAutograd maps inputs by their source
        compat.set_dynamo_source(ids, compat.dynamo_sources.AttrSource(source, "document_ids"))
    ctx.example_inputs = [*ctx.example_inputs, value.spec.documents]
    ctx.document_ids = ids


def _same_length_as_carried(ctx: PassContext) -> None:
    """With dynamic shapes Dynamo gives a carried input's sequence (marked dynamic) a symbol of its own, where it
    gives the dims of plain inputs of one size one symbol (duck sizing): the labels of a loss computed in the graph
    would not be seen as sequence-long. A plain input's dim of the same size gets the carried length's symbol, as
    duck sizing would have given it (Dynamo guards that they are equal)."""
    lengths = [example_value(node).shape[dim] for node, dim in ctx.carried_inputs.items()]
    lengths = [n for n in lengths if isinstance(n, torch.SymInt)]
    for node in (n for n in ctx.gm.graph.nodes if n.op == "placeholder" and n not in ctx.carried_inputs):
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or is_module_state(node):
            continue
        for size in value.shape:
            for n in lengths:
                if _hinted(size) and _hinted(n) and size.node.hint == n.node.hint and not same(size, n):
                    bool(size == n)  # a guard, and the shape environment's replacement of one symbol by the other


def _hinted(size) -> bool:
    return isinstance(size, torch.SymInt) and size.node.has_hint()


def local_examples(example_inputs: list, ctx: PassContext) -> list:
    """The inner compiler's example inputs: each carried input's local tokens (with dynamic shapes a fake tensor
    whose sequence size is this rank's length of the traced symbolic one), the others as they are."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    examples = list(example_inputs)
    for i, node in enumerate(placeholders):
        if node in ctx.whole_carried:  # all-gathered before the call (`CarriedGraph`): the whole value
            traced = example_value(node)
            if ctx.dynamic:
                whole = traced.new_empty(traced.shape)
            else:
                whole = torch.empty(traced.shape, dtype=traced.dtype, device=traced.device)
            examples[i] = whole.requires_grad_(traced.requires_grad)
        if node not in ctx.carried_inputs:
            continue
        traced, dim = example_value(node), ctx.carried_inputs[node]
        if ctx.dynamic or node in ctx.exchanged_inputs:  # (an exchanged input's example is its whole batch)
            shape = list(traced.shape)
            shape[dim] = local_length(ctx.layout_kind, ctx.world_size, shape[dim])
            examples[i] = traced.new_empty(shape).requires_grad_(traced.requires_grad)
        else:
            examples[i] = example_inputs[i]._local.detach().requires_grad_(example_inputs[i].requires_grad)
    return examples


def carry_layout_outputs(ctx: PassContext) -> None:
    """With outputs to wrap, what their `SequenceSpec` needs besides the graph's constants, as the graph's last
    outputs: the host copy of the document ids (the documents layout), then the global length (dynamic shapes)."""
    if not ctx.carried_outputs:
        return
    output = next(n for n in ctx.gm.graph.nodes if n.op == "output")
    extra = [ctx.document_ids] if ctx.document_ids is not None else []
    extra += [ctx.insert_length("global")] if ctx.dynamic else []
    output.args = ((*output.args[0], *extra),)


def crosses_boundaries(ctx: PassContext) -> bool:
    """Whether the graph takes or returns values that `CarriedGraph` unwraps or wraps."""
    return bool(ctx.carried_inputs or ctx.whole_carried or ctx.carried_outputs or ctx.mask_inputs or ctx.mask_outputs)


class CarriedGraph:
    """The compiled graph called with carried inputs unwrapped and `SequenceMask` inputs replaced by the tensors
    that describe them (`ringpass.frontend.crossing_masks`), its carried outputs wrapped and its mask descriptions
    wrapped. With ``masks=False`` the caller splices and wraps the masks (`ringpass.frontend.per_rank.PerRankGraph`,
    whose runs each take one rank's description)."""

    def __init__(self, compiled, ctx: PassContext, masks: bool = True):
        placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
        self.compiled = compiled
        # exchanged inputs (``inputs="per_rank"``) arrive as this rank's tokens already
        self.inputs = [
            i for i, n in enumerate(placeholders) if n in ctx.carried_inputs and n not in ctx.exchanged_inputs
        ]
        self.whole = [i for i, n in enumerate(placeholders) if n in ctx.whole_carried]
        self.mask_inputs = dict(ctx.mask_inputs) if masks else {}  # argument index -> how many tensors describe it
        self.outputs = dict(ctx.carried_outputs)  # output index -> sequence dim
        self.mask_outputs = dict(ctx.mask_outputs) if masks else {}
        self.length_output = bool(self.outputs) and ctx.dynamic
        self.documents_output = bool(self.outputs) and ctx.document_ids is not None
        self.documents_input = self.inputs[0] if ctx.carried_layout == DOCUMENTS_KIND else None
        self.static_length = None if ctx.dynamic or not self.outputs else int(ctx.sequence.global_seq_len)
        self.layout = (ctx.layout_kind, ctx.world_size, ctx.group_name)

    def __call__(self, *args):
        args = splice_mask_inputs(args, self.mask_inputs)
        if self.documents_input is not None:  # (`_take_document_ids`)
            args.append(args[self.documents_input].spec.documents)
        for i in self.inputs:
            args[i] = args[i].to_local()
        for i in self.whole:
            args[i] = args[i].full_tensor()
        outputs = list(self.compiled(*args))
        seq_len = int(outputs.pop()) if self.length_output else self.static_length
        documents = outputs.pop() if self.documents_output else None
        kind, world_size, group_name = self.layout
        for index, dim in self.outputs.items():
            spec = SequenceSpec(kind, world_size, seq_len, dim, group_name, documents=documents)
            outputs[index] = carry(outputs[index], spec)
            if self.length_output:  # a graph compiled for any length hands on values of any length
                compat.maybe_mark_dynamic(outputs[index], dim)
        return wrap_mask_outputs(outputs, self.mask_outputs)


def splice_mask_inputs(args, mask_inputs: dict) -> list:
    """``args``, each `SequenceMask` (at the indices of ``mask_inputs``) replaced by the tensors that describe it."""
    return [t for i, a in enumerate(args) for t in (a.inputs if i in mask_inputs else [a])]
