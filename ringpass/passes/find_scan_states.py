"""Find which function calls computed whole are a known chunked scan whose state can be passed, so that each rank scans
only its own chunks, from the state the chunks before them leave (`pass_scan_states` writes that).

Matches each `WholeRegion` of ``ctx.sequence.regions`` whose function is a `ringpass.fx.known_scans.KnownScan` (by
name: Hugging Face's ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``), with the option ``scans="state"`` or
``"auto"``. The
graph does not say which of the call's values is which argument of the function, nor the keyword constants it was
called with, so they are found by what they compute: for each assignment of the call's per-token values to the
function's per-token arguments and of its other values to its weights (a weight it does not read: None), values are
drawn for each argument as the argument can take them (a decay's log at most 0), and the call's nodes and the function
(with each candidate of the constants) run on them; the assignment whose output equals the call's, bitwise (the same
ops), binds it. Calls of one function with the same shapes (a model's layers) bind alike, checked with one run each.

The call must return one value, ``[B, N, ...]`` with the sequence in dim 1 as its per-token values, at static shapes.

With ``scans="auto"``, a bound call that also splits by heads (`find_region_heads`) passes its state only where
`lowering.costmodel.scan_seconds` predicts that faster on ``ctx.hardware`` (each strategy's ops, counted on fake
values, and the bytes of its collectives).

Writes ``ctx.sequence.states[region]``: a `ScanBinding` (with the prediction under ``auto``), or why the state is not
passed (the report's strategy says it after the strategy the call runs with).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import torch

from lowering.costmodel import ScanCost, scan_seconds
from lowering.layout import cached_layout
from lowering.state_passing import scan_for, scan_region, summary_nbytes, zero_state
from ringpass.fx.call_regions import run_call
from ringpass.fx.context import LOCAL, PassContext
from ringpass.fx.findings import HeadSplit, ScanBinding, WholeRegion
from ringpass.fx.known_scans import KNOWN_SCANS, KnownScan, function_module
from ringpass.fx.nodes import example_value, nbytes, probing


class _NotBound(Exception):
    """Why the call's state cannot be passed."""


def find_scan_states(ctx: PassContext) -> None:
    if ctx.options.scan_strategy not in ("state", "auto"):
        return
    bound: dict[tuple, tuple] = {}  # (function, the entries' shapes) -> the assignment that bound such a call
    for region in ctx.sequence.regions:
        try:
            binding = _bind(ctx, region, bound)
        except _NotBound as why:
            ctx.sequence.states[region] = str(why)
            continue
        split = ctx.sequence.heads[region]
        if ctx.options.scan_strategy == "auto" and isinstance(split, HeadSplit):
            ctx.sequence.states[region] = _cheaper(ctx, region, binding, split)
        else:
            ctx.sequence.states[region] = binding


def _cheaper(ctx: PassContext, region: WholeRegion, binding: ScanBinding, split: HeadSplit) -> ScanBinding | str:
    """``binding`` where the cost model predicts passing the state faster than splitting by heads on
    ``ctx.hardware`` (with the prediction), else why not: each strategy's ops counted on fake values (the call's
    nodes on the traced ones; `lowering.state_passing.scan_region` on one rank's share of its per-token inputs)."""
    from ringpass.fx.op_costs import OpCosts  # torch's flop counter imports Triton: importing ringpass must not

    layout = cached_layout(ctx.layout_kind, ctx.world_size, ctx.sequence.global_seq_len)
    local = layout.chunk_len * len(layout.chunks(0))
    with probing(ctx.gm.graph):
        with OpCosts(set()) as whole:
            run_call(ctx.gm, region.internal, {e: example_value(e) for e in region.entries})
        tokens = [
            example_value(t).narrow(1, 0, 1).expand(-1, local, *example_value(t).shape[2:]) for t in binding.tokens
        ]
        weights = [example_value(w) if w is not None else None for w in binding.weights]
        with OpCosts(set()) as mine:
            scan_region(
                binding.adapter, binding.module, binding.function, binding.constants, tokens, weights,
                layout.kind, ctx.world_size, layout.seq_len, ctx.group_name,
            )  # fmt: skip
    exchanged = [
        nbytes(example_value(e)) // (ctx.world_size if d is not None else 1)
        for e, d in split.entries.items()
        if ctx.placement.get(e) == LOCAL
    ]
    cost = ScanCost(
        heads_ops=tuple(op[:2] for op in whole.ops),
        state_ops=tuple(op[:2] for op in mine.ops),
        heads_bytes=sum(exchanged) + sum(nbytes(example_value(e)) // ctx.world_size for e in split.exits),
        summaries_bytes=binding.summary_bytes * layout.num_chunks,
    )
    seconds = scan_seconds(cost, ctx.world_size, ctx.hardware)
    state, heads = (f"{seconds[k] * 1e3:.3g} ms" for k in ("state", "heads"))
    if seconds["state"] < seconds["heads"]:
        return dataclasses.replace(binding, predicted=f"predicted {state} against {heads} split by heads")
    return f"split by heads predicted faster: {heads} against {state} passing the state"


def _bind(ctx: PassContext, region: WholeRegion, bound: dict) -> ScanBinding:
    known = KNOWN_SCANS.get(region.function)
    if known is None:
        raise _NotBound(f"`{region.function}` is not a scan ringpass knows the state of")
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
    trials = itertools.chain([bound[key]] if key in bound else [], _assignments(known, region, tokens))
    for assignment in trials:
        found = _constants_computing(ctx, region, known, function, assignment)
        if found is not None:
            constants, arguments, expected = found
            _check_passing_state(known, module, region.function, constants, arguments, expected)
            bound[key] = assignment
            return _binding(ctx, region, known, module, assignment, constants)
    raise _NotBound(f"no assignment of its values to `{region.function}`'s arguments computes its output")


def _check_passing_state(known: KnownScan, module: str, function: str, constants, arguments: dict, expected) -> None:
    """The state passed as `lowering.state_passing` passes it, on the drawn values in one process: the first half's
    summary folded into the second half's initial state, both halves scanned; their output must be the call's (to
    the rounding of another summation order), or the function does not take its state as the adapter gives it."""
    scan = scan_for(known.adapter, module, function, constants)
    tokens = {name: arguments[name] for name in known.tokens}
    weights = {name: arguments[name] for name in known.weights}
    half = max(1, expected.shape[1] // 2)
    first, second = ({n: t[:, part] for n, t in tokens.items()} for part in (slice(0, half), slice(half, None)))
    try:
        with torch.no_grad():
            zero = zero_state(scan, first, weights)
            start = scan.advance(scan.summary(first, weights, zero), zero)
            halves = [scan.call(first, weights, zero)[0]] + (
                [scan.call(second, weights, start)[0]] if half < expected.shape[1] else []
            )
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise _NotBound(f"`{function}` does not take a state as {known.adapter}'s adapter gives it: {error}") from None
    got = torch.cat(halves, 1)
    scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
    if got.shape != expected.shape or not ((got - expected).abs().max() / scale <= 1e-4):
        raise _NotBound(
            f"`{function}` passed its state as {known.adapter}'s adapter passes it does not compute the call"
        )


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
    """(constants, the drawn arguments, the call's output on them): the first candidate of the keyword constants
    (`KnownScan.constants`' order: what the call spells first) with which ``function`` on the values ``assignment``
    gives its arguments returns what the call's nodes return on them (bitwise); or None."""
    order, weight_slots = assignment
    names = [*known.tokens, *known.weights]
    generator = torch.Generator().manual_seed(0)
    drawn = {}
    for name, index in zip(names, (*order, *weight_slots)):
        if index is not None:
            value = example_value(region.entries[index])
            device = torch.device("cpu") if value.device.type == "meta" else value.device
            drawn[index] = known.draw(name)(tuple(value.shape), generator, value.dtype, device)
    entries = {e: drawn[i].clone() if i in drawn else None for i, e in enumerate(region.entries)}
    try:
        with torch.no_grad():
            expected = run_call(ctx.gm, region.internal, entries)[region.exits[0][0]]
    except torch.OutOfMemoryError:
        raise
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
        except torch.OutOfMemoryError:
            raise
        except Exception:  # not these constants
            continue
        out = out[0] if isinstance(out, tuple) else out
        if isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.equal(out, expected):
            return tuple(sorted(constants.items())), arguments, expected
    return None


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
