"""Masks that cross graph boundaries as their per-token description (`lowering.sequence_mask.SequenceMask`).

A model whose graph breaks between building its attention mask and using it (FSDP2's hooks on every block, a
graph break in the model) would hand each block graph an S x S tensor, which the ring cannot take without every
rank holding it whole. Instead:

- `describe_mask_outputs` (the graph that builds the mask) matches each output that is a mask as SDPA takes one:
  a 4-D ``[B, 1 or H, S, S]`` bool or float value that needs no gradient, whose pairwise part
  (`lift_masks.MaskRegion`, read from the output as query rows x key columns) varies along the keys and reads
  per-token values only (no S x S value, no random op). It writes the mask's recipe (the region and the
  shape-only values it reads, e.g. ``arange``s, copied into their own graph, registered by content; with dynamic
  shapes a length is read as a size of one of those values) and makes the graph return the per-token values the
  recipe reads (its *crossings*, each at most ``[B, S]``; a graph input is cloned, so the mask is what it was
  when built; a mask from shapes alone gets an empty ``[0, S]`` tensor) instead of the mask;
  `wrap_mask_outputs` makes them a `SequenceMask`. The S x S value is no longer computed unless an attention of
  this graph needs it (then `lift_masks` lifts it as usual). The crossings are kept whole on every rank, as
  the inputs of the ring's mask programs are (`ctx.masks.whole_values`; one this rank would hold a shard of is
  gathered): the description is the same on every rank.
- `rebuild_mask_inputs` (a graph that receives one) replaces the mask's placeholder by placeholders for its
  crossings and the recipe written into the graph, so that `lift_masks` sees a mask built from per-token inputs,
  as if the graph had built it itself; `CarriedGraph` passes the crossings in the mask's place.

What is not described crosses as before: a plain S x S tensor, refused by `lift_masks` with the reason unless
``masks="materialize"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from lowering import compat
from lowering.errors import InvalidInputError
from lowering.sequence_mask import SequenceMask, recipe, register_recipe
from ringpass.fx.context import PassContext
from ringpass.fx.nodes import (
    ancestors,
    example_value,
    nbytes,
    plain,
    refresh_example_values,
    remove_dead_code,
    short_source,
    user_name,
)
from ringpass.fx.sizes import same
from ringpass.fx.spellings import op_name
from ringpass.passes.lift_masks import KV, MaskRegion

RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli", "dropout"}
RANDOM |= {"normal", "multinomial", "uniform_", "normal_", "bernoulli_", "random_", "exponential_"}
KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack")  # where the recipe's ops are, for messages


@dataclass
class MaskOutput:
    """An output described: its recipe's key, and the outputs that carry its crossings (the first is the mask's
    own position, the rest are appended to the graph's outputs)."""

    key: str
    crossings: list[int]


def describe_mask_outputs(ctx: PassContext) -> None:
    """Replaces each mask output by its crossings (see the module docstring); records them in
    ``ctx.mask_outputs`` (output index -> `MaskOutput`)."""
    if ctx.options.outputs == "sharded" or ctx.options.inputs == "sharded":  # values as the graph has them
        return
    graph = ctx.gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    results = list(output.args[0])
    for index, node in enumerate(list(results)):
        described = _describe(node) if isinstance(node, fx.Node) else None
        if described is None:
            continue
        key, crossings = described
        with graph.inserting_before(output):  # a graph input is handed on as it is now, not as it may become
            crossings = [_cloned(graph, c) if c.op == "placeholder" else c for c in crossings]
        ctx.mask_outputs[index] = MaskOutput(key, [index, *range(len(results), len(results) + len(crossings) - 1)])
        ctx.masks.whole_values.update(crossings)  # computed whole on every rank, as the ring's programs read them
        results[index] = crossings[0]
        results += crossings[1:]
        value, sizes = example_value(node), sum(nbytes(example_value(c)) for c in crossings)
        ctx.report.masks.append(
            f"output {index}: the {[plain(s) for s in value.shape]} mask of {short_source(node)} leaves as its "
            f"per-token description (SequenceMask of {len(crossings)} tensor(s), {sizes} bytes instead of "
            f"{nbytes(value)})"
        )
    output.args = (tuple(results),)
    remove_dead_code(graph)


def wrap_mask_outputs(outputs: list, mask_outputs: dict) -> list:
    """The graph's results as the caller gets them: each described mask a `SequenceMask` of its crossings, and
    the crossings appended to the outputs dropped. A length traced symbolically stays so in the next graph."""
    outputs = list(outputs)
    for index, described in mask_outputs.items():
        tensors = [outputs[i] for i in described.crossings]
        outputs[index] = mask = SequenceMask(tensors, described.key)
        entry = recipe(described.key)
        for dim, size in enumerate(entry.shape):
            if not isinstance(size, int):
                compat.maybe_mark_dynamic(mask, dim)
        for i, dim in (*entry.sizes, *(s for s in entry.shape if not isinstance(s, int))):
            compat.maybe_mark_dynamic(tensors[i], dim)
    return outputs[: len(outputs) - sum(len(m.crossings) - 1 for m in mask_outputs.values())]


def _describe(node: fx.Node) -> tuple[str, list[fx.Node]] | None:
    """(the recipe's key, its crossings) when ``node`` is a mask built from per-token values, else None (the
    graph unchanged)."""
    value = example_value(node)
    if not _mask_shaped(value):
        return None
    region = MaskRegion(node)
    roles = {role for _, dims in region.inputs for _, role in dims}
    if region.oversized or KV not in roles:  # it needs an S x S value, or it does not vary along the keys
        return None
    crossings = [n for n in region.input_nodes if _reads_data(n)]
    if any(_per_token_bound(value) < plain(example_value(c).numel()) for c in crossings):
        return None  # a whole table the region indexes pairwise: not smaller than S x S by a factor S
    anchor = None if crossings else _anchor(node)
    crossings = crossings or ([anchor] if anchor is not None else [])
    shape = [_size_in(s, crossings) for s in value.shape]
    program, sizes = _recipe(node, crossings) if crossings else (None, ())
    if program is None or None in shape:  # a length none of the crossings has, a random or impure op
        if anchor is not None:
            node.graph.erase_node(anchor)
        return None
    source = short_source(node) or user_name(node)
    return register_recipe(program, value.dtype, sizes, shape, source), crossings


def _mask_shaped(value) -> bool:
    """A 4-D ``[B, 1 or H, S, S]`` bool or float value, as SDPA and Hugging Face take masks."""
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or value.requires_grad:
        return False
    n, m = value.shape[-2:]
    return same(n, m) and plain(n) > 1 and (value.dtype == torch.bool or value.is_floating_point())


def _per_token_bound(value: torch.Tensor) -> int:
    return plain(value.numel()) // plain(value.shape[-1])


def _reads_data(node: fx.Node) -> bool:
    """The value depends on a tensor the graph takes (not on shapes and constants alone)."""
    return any(
        n.op == "get_attr" or (n.op == "placeholder" and isinstance(example_value(n), torch.Tensor))
        for n in ancestors(node)
    )


def _anchor(mask: fx.Node) -> fx.Node | None:
    """For a mask built from shapes alone (``arange``s): an empty ``[0, S]`` tensor to carry its description (its
    device, and its length when that is symbolic); None if the graph has no input for a symbolic length."""
    value, graph = example_value(mask), mask.graph
    n = value.shape[-1]
    length = _symbol_input(graph, n) if isinstance(n, torch.SymInt) else n
    if length is None:
        return None
    output = next(p for p in graph.nodes if p.op == "output")
    with graph.inserting_before(output):
        anchor = graph.call_function(torch.empty, ((0, length),), {"device": value.device, "dtype": torch.bool})
    anchor.meta["example_value"] = value.new_empty((0, n), dtype=torch.bool)
    return anchor


def _same_symbol(size, n) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr == n.node.expr


def _symbol_input(graph: fx.Graph, n: torch.SymInt) -> fx.Node | None:
    """The graph's input for the symbolic length ``n`` (Dynamo passes each symbol a graph reads), if it has one."""
    return next((p for p in graph.nodes if p.op == "placeholder" and _same_symbol(example_value(p), n)), None)


def _cloned(graph: fx.Graph, node: fx.Node) -> fx.Node:
    clone = graph.call_method("clone", (node,))
    clone.meta["example_value"] = example_value(node)
    return clone


def _size_in(size, crossings: list[fx.Node]):
    """``size`` itself when it is a number, else where a crossing has it: (crossing, dim); None if none has."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    for i, node in enumerate(crossings):
        for dim, own in enumerate(example_value(node).shape):
            if _same_symbol(own, size):
                return i, dim
    return None


def _recipe(mask: fx.Node, crossings: list[fx.Node]):
    """(``program(*crossings, *sizes)``, ``sizes``): the nodes ``mask`` is computed from, cut at the crossings and
    at the lengths it reads (each a size of a crossing); (None, ()) when it reads anything else."""
    graph, env, sizes = fx.Graph(), {}, []
    for i, node in enumerate(crossings):
        env[node] = graph.placeholder(f"input_{i}")
    needed, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in env or node in needed:
            continue
        if isinstance(example_value(node), torch.SymInt):  # a length: read from a crossing's size
            size = _size_in(example_value(node), crossings)
            if size is None:
                return None, ()
            env[node] = graph.placeholder(f"size_{len(sizes)}")
            sizes.append(size)
            continue
        if node.op not in ("call_function", "call_method") or op_name(node) in RANDOM or node.is_impure():
            return None, ()  # an input of another kind, or a value drawn anew wherever the recipe runs
        needed.add(node)
        stack += node.all_input_nodes
    for node in mask.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
            env[node].meta = {k: v for k, v in node.meta.items() if k in KEPT_META}  # not the producer's fakes
    graph.output(env[mask])
    return fx.GraphModule(torch.nn.Module(), graph, class_name="MaskRecipe"), sizes


def rebuild_mask_inputs(ctx: PassContext) -> None:
    """Writes each `SequenceMask` input's recipe into the graph in place of its placeholder (see the module
    docstring); ``ctx.example_inputs`` gets its crossings in its place, ``ctx.mask_inputs`` their count."""
    if not any(isinstance(value, SequenceMask) for value in ctx.example_inputs):
        return
    if ctx.options.inputs == "sharded":
        raise InvalidInputError(
            "A graph compiled with inputs='sharded' received a ringpass.SequenceMask (a mask another ring graph "
            "described per token, for graphs that take whole inputs); compile every graph of the model with the "
            "same inputs= option, or pass mask.full_tensor()."
        )
    ctx.gm = _own_copy(ctx.gm)
    graph = ctx.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    examples, written, fake_mode = [], [], None
    for index, (node, value) in enumerate(zip(placeholders, ctx.example_inputs)):
        if not isinstance(value, SequenceMask):
            examples.append(value)
            continue
        traced, entry = example_value(node), recipe(value.recipe)
        fake_mode = traced.inputs[0].fake_mode
        with graph.inserting_before(node):
            crossings = [graph.placeholder(f"{node.name}_input_{i}") for i in range(value.count)]
        for i, (crossing, fake) in enumerate(zip(crossings, traced.inputs)):
            crossing.meta["example_value"] = fake
            compat.set_dynamo_source(crossing, _inner_source(node, i))  # AOTAutograd maps inputs by their source
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        steps = [n for n in entry.program.graph.nodes if n.op == "placeholder"]
        env = dict(zip(steps, crossings))
        with graph.inserting_before(first_op):
            for step, (i, dim) in zip(steps[value.count :], entry.sizes):
                env[step] = _length(graph, crossings[i], traced.inputs[i].shape[dim], dim)
                written.append(env[step])
            for step in entry.program.graph.nodes:
                if step.op in ("call_function", "call_method"):
                    env[step] = graph.node_copy(step, env.__getitem__)
                    written.append(env[step])
        ctx.report.masks.append(
            f"input {user_name(node)}: the {[plain(s) for s in value.shape]} mask arrives as its per-token "
            f"description (SequenceMask from {entry.source}) and is evaluated here per tile"
        )
        node.replace_all_uses_with(env[next(n for n in entry.program.graph.nodes if n.op == "output").args[0]])
        graph.erase_node(node)
        ctx.mask_inputs[index] = value.count
        examples += value.inputs
    refresh_example_values(graph, {n for n in written if n.op != "placeholder"}, fake_mode=fake_mode)
    ctx.example_inputs = examples


def _length(graph: fx.Graph, crossing: fx.Node, size, dim: int) -> fx.Node:
    """The graph's own input for a symbolic length, so that `lift_masks` reads a recipe's ``arange(n)`` as
    positions; else ``crossing.size(dim)``."""
    own = _symbol_input(graph, size) if isinstance(size, torch.SymInt) else None
    return own if own is not None else graph.call_method("size", (crossing, dim))


def _inner_source(placeholder: fx.Node, i: int):
    """Where Dynamo would say the mask's ``i``-th describing tensor comes from: the mask argument's attribute."""
    source = compat.dynamo_source(placeholder)
    return compat.dynamo_sources.AttrSource(source, f"input_{i}") if source is not None else None


def _own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module whose inputs may change: Dynamo calls the compiled graph with the
    arguments its own graph's placeholders name, so those stay as they are."""
    graph, copies = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for node, copy in copies.items():
        if compat.dynamo_source(node) is not None:
            compat.set_dynamo_source(copy, compat.dynamo_source(node))
    copied = fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    compat.copy_parameter_sources(copied, gm)
    return copied
