"""Run each call of a known chunked scan on this rank's chunks only, each from the state the chunks before it leave.

Matches the `WholeRegion`\\ s with a `ScanBinding` (`find_scan_states`, option ``scans="state"``: Hugging Face's
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``). Writes one call of `lowering.state_passing.scan_region` in
place of the call's nodes, on the values the binding gives as the function's arguments (its per-token ones: this
rank's tokens), the function named by its module and name, with the constants the call was traced with; the call's
readers outside read its result (this rank's tokens of the output; a reader computed whole reads it all-gathered);
the call's nodes are erased and the region leaves ``ctx.sequence.regions`` (no pass after this one splits it by heads
or gathers it). At run time each rank scans each of its chunks twice (its summary, then its output) and all-gathers
the summaries: bytes per call independent of the length (`MixerRecord`; the all-gather's `CollectiveRecord`).
"""

from __future__ import annotations

from lowering.layout import cached_layout
from lowering.state_passing import scan_region
from ringpass.fx.context import PassContext
from ringpass.fx.findings import ScanBinding, WholeRegion
from ringpass.fx.nodes import copy_origin, example_value, module_path, short_source, user_name
from ringpass.fx.report import CollectiveRecord, MixerRecord
from ringpass.fx.sharded_reads import read_tokens_instead

STRATEGY = (
    "state passing: each of this rank's chunks scanned from the state the chunks before it leave "
    "(every chunk's summary all-gathered)"
)


def pass_scan_states(ctx: PassContext) -> None:
    for region in list(ctx.sequence.regions):
        binding = ctx.sequence.states.get(region)
        if isinstance(binding, ScanBinding):
            _pass_state(ctx, region, binding)
            ctx.sequence.regions.remove(region)


def _pass_state(ctx: PassContext, region: WholeRegion, binding: ScanBinding) -> None:
    graph, first = ctx.gm.graph, region.internal[0]
    args = (
        binding.adapter,
        binding.module,
        binding.function,
        binding.constants,
        list(binding.tokens),
        list(binding.weights),
        *ctx.layout_args(),
    )
    with graph.inserting_before(first):
        tokens = graph.call_function(scan_region, args)
    copy_origin(tokens, binding.exit).meta["example_value"] = example_value(binding.exit)
    inside = set(region.internal)
    readers = [u for u in binding.exit.users if u not in inside]
    what = f"{user_name(binding.exit)}, returned by `{region.function}`"
    sent = read_tokens_instead(ctx, binding.exit, tokens, readers, what)
    for node in reversed(region.internal):
        graph.erase_node(node)
        ctx.placement.pop(node, None)
        ctx.sequence.axes.pop(node, None)
    layout = cached_layout(ctx.layout_kind, ctx.world_size, ctx.sequence.global_seq_len)
    summaries = binding.summary_bytes * len(layout.chunks(0))
    what = f"the chunks' summaries of `{region.function}` (state passed)"
    ctx.report.collectives.append(
        CollectiveRecord("all-gather", "forward", what, short_source(tokens), summaries * ctx.world_size)
    )
    kind = f"`{region.function}`: {region.why}"
    strategy = f"{STRATEGY} ({binding.predicted})" if binding.predicted else STRATEGY
    ctx.report.mixers.append(MixerRecord(module_path(tokens), region.call_site, kind, strategy, summaries + sent))
