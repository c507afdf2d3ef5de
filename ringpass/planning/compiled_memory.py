"""What a compiled training step holds at its peak: AOTAutograd's own graphs, captured on fake tensors, run in
order with every value freed after its last use.

`ringpass plan` measures the model alone (P = 1) as eager autograd runs it, under torch's ``MemTracker``
(`ringpass.planning.model_plan.measure_step`). A model compiled by the ring backend keeps less: AOTAutograd splits each
graph into a forward that returns the values the backward needs (its min-cut partitioner chooses them,
recomputing cheap ones, and with activation checkpointing recomputes each checkpointed block in the backward) and
a backward that takes them. `compiled_step_memory` compiles the model with the partitioner the backend's
compilers use (``min_cut_rematerialization_partition``) inside ``FakeTensorMode``, keeps the forward and
backward graphs, and walks each as its interpreter runs it:

- a node that makes a tensor allocates its storage's bytes (a view, or an item of a multi-output op, shares its
  base's storage); a storage is freed when the last node reading any of its aliases has run, unless the graph
  returns it;
- the forward's inputs (weights, buffers, the user's tensors) are not activations; its outputs beyond the user's
  are the values saved for the backward (those that are inputs, the weights, cost nothing);
- the backward starts holding every forward's saved values and the outputs the caller keeps (the logits), takes
  its output gradient, and its results are the parameters' gradients, live to the step's end;
- the ring backend's graph differs from the model's in one place that holds memory: each parameter's gradient is
  made whole over the ring (``reduce_grads``: ``all_reduce_sum`` on a clone of it, or with an outer FSDP2 / DDP
  its share times P), a new tensor of the gradient's size made as soon as the gradient is, the share freed after
  it. The walk adds that copy beside what is live when each parameter's gradient is made (``copies_gradients``),
  one at a time. For a large vocabulary at a short slice of the sequence the embedding's and the head's
  gradients (vocabulary x hidden each) are the largest tensors of the step, and the copy of one of them sets the
  backward's peak.

Several graphs (graph breaks) run forward in order, each holding the saved values of those before it, and
backward in reverse, each holding the gradients of those after it; eager code between graphs, and graphs that
compute no gradient, are not counted.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from lowering import compat
from lowering.compat import pytree
from lowering.errors import NotSupportedError


@dataclass
class GraphMemory:
    """One AOTAutograd graph walked in order: its peak and end in bytes (what it allocates, plus the inputs it
    counts), and which of its nodes' storages it returns."""

    peak: int
    end: int  # what stays: the returned storages
    returned_at_peak: int  # of the peak, the storages it returns (a backward's: the gradients)
    returned: dict  # node name -> bytes of the storage it returns (0: an input's or an alias already counted)


@dataclass
class StepMemory:
    """A compiled training step's bytes at its peak: ``activations`` (every value live but the gradients) and
    ``gradients`` (those live at the peak)."""

    activations: int
    gradients: int


def compiled_step_memory(
    model: torch.nn.Module, inputs, checkpointing: bool, gradient_copies: bool = True
) -> StepMemory:
    """Compile ``model`` (fake tensors, inside ``FakeTensorMode``) with the backend's partitioner, run one
    training step of ``inputs`` (each block of its block lists checkpointed with ``checkpointing``) and walk the
    captured graphs (module docstring); ``gradient_copies``: each parameter's gradient copied once as the ring
    makes it whole (False: a plain ``torch.compile``'s step, which makes no such copy)."""
    aot_autograd, make_boxed_func = compat.aot_autograd, compat.make_boxed_func
    min_cut_rematerialization_partition = compat.min_cut_rematerialization_partition

    if checkpointing:
        _checkpoint_blocks(model)
    pairs: list[dict] = []  # per Dynamo graph, in the forward's order: {"forward": gm, "backward": gm, ...}

    def capture(gm: fx.GraphModule, example_inputs: list):
        # the backward's results are the gradients of these inputs, in this order: which are parameters'
        pair: dict = {"parameters": [isinstance(x, torch.nn.Parameter) for x in example_inputs]}
        pairs.append(pair)

        def keep(kind):
            def compiler(graph: fx.GraphModule, _examples):
                pair[kind] = graph
                return make_boxed_func(graph.forward)

            return compiler

        return aot_autograd(
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    compat.dynamo_reset()
    try:
        compiled = torch.compile(model, backend=capture)
        out = compiled(**inputs) if isinstance(inputs, dict) else compiled(*inputs)
        loss = getattr(out, "loss", None)
        if loss is None:
            loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.float().sum().backward()
    except Exception as error:
        raise NotSupportedError(
            f"plan: compiling the model on fake tensors, to price what its compiled step keeps, failed: {error}. "
            "The ring backend compiles the model too: make it compile with torch.compile first."
        ) from error
    finally:
        compat.dynamo_reset()
    trained = [p for p in pairs if "backward" in p]
    if not trained:
        raise NotSupportedError("plan: the compiled model has no graph that trains; there is no step to price.")
    return _walk_step(trained, gradient_copies)


def _walk_step(pairs: list[dict], gradient_copies: bool = True) -> StepMemory:
    """The step's peak over its forward graphs in order and its backward graphs in reverse."""
    forwards = [walk(p["forward"], counted_inputs=set()) for p in pairs]
    saved = [sum(f.returned.values()) for f in forwards]
    peak = max(sum(saved[:i]) + f.peak for i, f in enumerate(forwards))
    gradients_at_peak = 0
    later_gradients = 0
    for i in reversed(range(len(pairs))):
        counted = {name for name, size in forwards[i].returned.items() if size}  # the saved values; not the weights
        backward = walk(
            pairs[i]["backward"],
            counted_inputs=counted,
            tangents=True,
            copies_gradients=pairs[i]["parameters"] if gradient_copies else None,
        )
        taken = _placeholder_names(pairs[i]["backward"])
        user_outputs = sum(  # what the caller holds that the backward does not take
            size for name, size in forwards[i].returned.items() if name not in taken
        )
        total = sum(saved[:i]) + user_outputs + later_gradients + backward.peak
        if total > peak:
            peak, gradients_at_peak = total, later_gradients + backward.returned_at_peak
        later_gradients += backward.end
    return StepMemory(peak - gradients_at_peak, gradients_at_peak)


def walk(
    gm: fx.GraphModule, counted_inputs: set, tangents: bool = False, copies_gradients: list | None = None
) -> GraphMemory:
    """Run ``gm`` in order on paper: each storage allocated by the node that makes it, freed after the last
    reader of any alias unless returned. Inputs count only when named in ``counted_inputs`` (a backward's saved
    values) or, with ``tangents``, when they are output gradients. ``copies_gradients`` (a backward's, per result:
    whether it is a parameter's gradient): each such result is copied once when made, the ring's reduction of
    the gradient (module docstring): the copy is live beside what is live then."""
    nodes = list(gm.graph.nodes)
    returned_nodes = set(gm.graph.output_node().all_input_nodes)
    last_read = {}
    for index, node in enumerate(nodes):
        for read in node.all_input_nodes:
            last_read[read] = index
    copied = _copied_gradients(gm, copies_gradients) if copies_gradients is not None else {}
    root: dict[fx.Node, fx.Node] = {}
    aliases: dict[fx.Node, list[fx.Node]] = {}
    size: dict[fx.Node, int] = {}
    live = peak = returned_at_peak = 0
    for index, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op == "placeholder":
            counts = node.name in counted_inputs or (tangents and node.name.startswith("tangents"))
            root[node], size[node] = node, _bytes(node) if counts else 0
        elif _aliases_input(node):
            root[node], size[node] = root[node.args[0]], 0
        else:
            root[node], size[node] = node, _bytes(node)
        aliases.setdefault(root[node], []).append(node)
        live += size[node]
        if live > peak:
            kept = {root[n] for n in returned_nodes if n in root}
            peak, returned_at_peak = live, sum(size[base] for base in kept)
        for base in {root[n] for n in (*node.all_input_nodes, node) if n in root}:
            dead = all(last_read.get(a, -1) <= index and a not in returned_nodes for a in aliases[base])
            if dead and size[base]:
                live, size[base] = live - size[base], 0
        if root[node] is node and node in copied and live + copied[node] > peak:  # the gradient's copy, made now
            kept = {root[n] for n in returned_nodes if n in root}
            peak, returned_at_peak = live + copied[node], sum(size[base] for base in kept)
    returned = {}
    for node in returned_nodes:
        base = root[node]
        returned[node.name] = size[base] if base.op != "placeholder" else 0
        size[base] = 0  # an alias returned twice counts once
    return GraphMemory(peak, live, returned_at_peak, returned)


def _copied_gradients(gm: fx.GraphModule, parameters: list) -> dict[fx.Node, int]:
    """The storages a backward's parameter gradients are made in (the node that allocates each: a view's or an
    item's base) -> the bytes of the largest gradient in it, the copy the ring's reduction makes of it. Results
    are matched to the forward's inputs in order; where their counts differ, every result is taken."""
    results = gm.graph.output_node().args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    if len(parameters) != len(results):
        parameters = [True] * len(results)
    copied: dict[fx.Node, int] = {}
    for result, is_parameter in zip(results, parameters):
        if not (is_parameter and isinstance(result, fx.Node)):
            continue
        base = result
        while _aliases_input(base) and base.op != "placeholder":
            base = base.args[0]
        copied[base] = max(copied.get(base, 0), _bytes(result))
    return copied


def _aliases_input(node: fx.Node) -> bool:
    """A view of its first argument, or an item of a multi-output op's result: no storage of its own."""
    target = node.target
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return False
    return target is operator.getitem or bool(getattr(target, "is_view", False))


def _bytes(node: fx.Node) -> int:
    return sum(_storage_bytes(t) for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor))


def _storage_bytes(tensor: torch.Tensor) -> int:
    n = tensor.untyped_storage().nbytes()
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)


def _placeholder_names(gm: fx.GraphModule) -> set[str]:
    return {node.name for node in gm.graph.nodes if node.op == "placeholder"}


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    """Every entry of the model's block lists checkpointed (non-reentrant), as Hugging Face's and torchtitan's
    activation checkpointing wrap them."""
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                module[i] = compat.checkpoint_wrapper(block)
