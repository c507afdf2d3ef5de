"""Find which function calls computed whole are a known chunked scan whose state can be passed, so that each rank scans
only its own chunks, from the state the chunks before them leave (`pass_scan_states` writes that).

Matches each `WholeRegion` of ``ctx.sequence.regions`` whose function is a `ringpass.fx.known_scans.KnownScan` (by
name: Hugging Face's ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``), with the option ``scans="state"``. The
graph does not say which of the call's values is which argument of the function, nor the keyword constants it was
called with, so they are found by what they compute: for each assignment of the call's per-token values to the
function's per-token arguments and of its other values to its weights (a weight it does not read: None), values are
drawn for each argument as the argument can take them (a decay's log at most 0), and the call's nodes and the function
(with each candidate of the constants) run on them; the assignment whose output equals the call's, bitwise (the same
ops), binds it. Calls of one function with the same shapes (a model's layers) bind alike, checked with one run each.

The call must return one value, ``[B, N, ...]`` with the sequence in dim 1 as its per-token values, at static shapes.

Writes ``ctx.sequence.states[region]``: a `ScanBinding`, or why the state is not passed (the report's strategy says
it after the strategy the call runs with).
"""

from __future__ import annotations

import importlib
import itertools
import operator

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from lowering.state_passing import summary_nbytes
from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.findings import ScanBinding, WholeRegion
from ringpass.fx.known_scans import KNOWN_SCANS, KnownScan, function_module
from ringpass.fx.nodes import example_value, probing


class _NotBound(Exception):
    """Why the call's state cannot be passed."""


def find_scan_states(ctx: PassContext) -> None:
    if ctx.options.scans != "state":
        return
    bound: dict[tuple, tuple] = {}  # (function, the entries' shapes) -> the assignment that bound such a call
    for region in ctx.sequence.regions:
        try:
            ctx.sequence.states[region] = _bind(ctx, region, bound)
        except _NotBound as why:
            ctx.sequence.states[region] = str(why)


def _bind(ctx: PassContext, region: WholeRegion, bound: dict) -> ScanBinding:
    known = KNOWN_SCANS.get(region.function)
    if known is None:
        raise _NotBound(f"`{region.function}` is not a scan ringpass knows the state of")
    if ctx.ulysses is not None:
        raise _NotBound("Ulysses x ring groups are not chunks of one sequence")
    module = function_module(list(region.internal), region.function)
    if module is None:
        raise _NotBound(f"the module defining `{region.function}` is not imported")
    if len(region.exits) != 1 or region.exits[0][1] != 1:
        raise _NotBound("it returns more than one value, or its output's sequence is not in dim 1")
    values = [example_value(e) for e in region.entries]
    if not all(isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape) for v in values):
        raise _NotBound("its inputs are not tensors of static shapes")
    tokens = [i for i, e in enumerate(region.entries) if ctx.sequence.axes.get(e)]
    if any(
        ctx.placement.get(e) != LOCAL or ctx.sequence.axes[e][0].dim != 1
        for e in map(region.entries.__getitem__, tokens)
    ):
        raise _NotBound("a per-token input is not this rank's tokens with the sequence in dim 1")
    function = getattr(importlib.import_module(module), region.function)
    key = (region.function, tuple(tuple(v.shape) for v in values))
    trials = [bound[key]] if key in bound else _assignments(known, region, tokens)
    for assignment in trials:
        constants = _constants_computing(ctx, region, known, function, assignment)
        if constants is not None:
            bound[key] = assignment
            return _binding(ctx, region, known, module, assignment, constants)
    raise _NotBound(f"no assignment of its values to `{region.function}`'s arguments computes its output")


def _assignments(known: KnownScan, region: WholeRegion, tokens: list[int]):
    """(entry index per per-token argument, entry index or None per weight), each way the counts allow."""
    others = [i for i in range(len(region.entries)) if i not in tokens]
    if len(tokens) != len(known.tokens) or len(others) > len(known.weights):
        return
    for order in itertools.permutations(tokens):
        for slots in itertools.permutations(range(len(known.weights)), len(others)):
            weights = [None] * len(known.weights)
            for slot, index in zip(slots, others):
                weights[slot] = index
            yield tuple(order), tuple(weights)


def _constants_computing(ctx: PassContext, region, known: KnownScan, function, assignment) -> tuple | None:
    """The first candidate of the keyword constants with which ``function`` on the values ``assignment`` gives its
    arguments returns what the call's nodes return on them (bitwise), or None."""
    order, weight_slots = assignment
    names = [*known.tokens, *known.weights]
    generator = torch.Generator().manual_seed(0)
    drawn = {}
    for name, index in zip(names, (*order, *weight_slots)):
        if index is not None:
            value = example_value(region.entries[index])
            device = torch.device("cpu") if value.device.type == "meta" else value.device
            drawn[index] = known.draw(name)(tuple(value.shape), generator, value.dtype, device)
    try:
        with torch.no_grad():
            expected = _run_region(ctx, region, drawn)
    except Exception:  # the call's ops refuse these values as these arguments
        return None
    arguments = {
        name: drawn.get(index) if index is not None else None for name, index in zip(names, (*order, *weight_slots))
    }
    candidates = known.constants(list(region.internal))
    for values in itertools.product(*candidates.values()):
        constants = dict(zip(candidates, values))
        try:
            with torch.no_grad():
                out = function(**arguments, **constants)
        except Exception:
            continue
        out = out[0] if isinstance(out, tuple) else out
        if isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.equal(out, expected):
            return tuple(sorted(constants.items()))
    return None


def _run_region(ctx: PassContext, region: WholeRegion, drawn: dict[int, torch.Tensor]) -> torch.Tensor:
    """The call's output on ``drawn`` (entry index -> value), its nodes run one by one."""
    values: dict[fx.Node, object] = {region.entries[i]: v.clone() for i, v in drawn.items()}
    for entry in region.entries:
        values.setdefault(entry, None)
    for node in region.internal:
        args = map_aggregate(node.args, lambda a: values[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(node.kwargs, lambda a: values[a] if isinstance(a, fx.Node) else a)
        if node.op == "call_method":
            values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        elif node.op == "call_function":
            values[node] = node.target(*args, **kwargs)
        elif node.op == "get_attr":
            values[node] = operator.attrgetter(node.target)(ctx.gm)
        else:
            raise _NotBound(f"it holds a {node.op} node")
    return values[region.exits[0][0]]


def _binding(ctx: PassContext, region, known: KnownScan, module: str, assignment, constants) -> ScanBinding:
    order, weight_slots = assignment
    tokens = tuple(region.entries[i] for i in order)
    weights = tuple(region.entries[i] if i is not None else None for i in weight_slots)
    with probing(ctx.gm.graph):  # one chunk's summary, on the traced (fake) values
        summary = summary_nbytes(
            known.adapter,
            module,
            region.function,
            constants,
            {name: example_value(t) for name, t in zip(known.tokens, tokens)},
            {name: example_value(w) if w is not None else None for name, w in zip(known.weights, weights)},
        )
    return ScanBinding(known.adapter, module, region.function, constants, tokens, weights, region.exits[0][0], summary)
