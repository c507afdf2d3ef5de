"""Run each function call the probe could not shard (a chunked scan) on the whole sequence, on every rank.

Matches the ``ctx.sequence.regions`` (`find_sequence_axes`: a call such as Jamba's selective scan, whose ops cut the
sequence into chunks or loop over it and carry a state across) that `split_region_heads` did not split by heads
(``ctx.sequence.heads`` says why: the report's strategy repeats it).
Writes ``ringpass::gather_sequence`` after each of its entries that holds this rank's tokens (once per entry: every
rank then holds the whole sequence, in position order, padding dropped) and points the call's reads of the entry at
it; the call itself runs unchanged, as traced, and its exits are sharded again where per-token ops read them
(`insert_boundaries`: the shard's backward gathers the exits' gradients, so every rank differentiates the call
alike and the gather's backward keeps its own rows). Each call's `MixerRecord` goes to the report, with the bytes a
rank sends per call, and each all-gather's `CollectiveRecord`.

Exact, and the rest of the model stays sharded, but the call's memory and compute are the unsharded model's on every
rank: with ``scans="state"`` a call of a known scan passes its state instead (`pass_scan_states`, before this pass).
"""

from __future__ import annotations

import torch

from ringpass.fx.context import FULL, LOCAL, PassContext
from ringpass.fx.findings import HeadSplit
from ringpass.fx.nodes import copy_origin, example_value, module_path, nbytes, plain, short_source, user_name
from ringpass.fx.report import CollectiveRecord, MixerRecord

STRATEGY = "computed whole on every rank: its per-token inputs all-gathered, its outputs sharded again"


def gather_whole_regions(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for region in ctx.sequence.regions:
        why_whole = ctx.sequence.heads[region]  # find_region_heads: a HeadSplit, or why not
        if isinstance(why_whole, HeadSplit):
            continue
        first = region.internal[0]
        internal = set(region.internal)
        sent = 0
        for entry in region.entries:
            if ctx.placement.get(entry) != LOCAL:
                continue
            dim = ctx.sequence.axes[entry][0].dim
            with graph.inserting_before(first):
                whole = graph.call_function(
                    torch.ops.ringpass.gather_sequence.default, (entry, dim, *ctx.layout_args()), ctx.layout_kwargs()
                )
            copy_origin(whole, first).meta["example_value"] = example_value(entry)
            ctx.placement[whole], ctx.sequence.axes[whole] = FULL, ctx.sequence.axes[entry]
            for user in [u for u in entry.users if u in internal]:
                user.replace_input_with(entry, whole)
            size = nbytes(example_value(entry))
            sent += size // ctx.world_size
            what = f"{user_name(entry)}, read by `{region.function}` (computed whole)"
            ctx.report.collectives.append(CollectiveRecord("all-gather", "forward", what, short_source(first), size))
        kind = f"`{region.function}`: {region.why}"
        strategy = f"{STRATEGY} (not split by heads: {why_whole})"
        if region in ctx.sequence.states:  # scans="state", and no binding
            strategy += f" (state not passed: {ctx.sequence.states[region]})"
        record = MixerRecord(module_path(first), region.call_site, kind, strategy, plain(sent))
        ctx.report.mixers.append(record)
