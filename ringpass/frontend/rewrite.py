"""The one compile protocol every front end (the ``ring`` backend, `ringpass.inspect`, `ringpass.convert`) runs on a
graph Dynamo captured: the boundaries in, the pass pipeline, and a retrace where the pipeline asks for one.

0. A graph that ends at a graph break under ``outputs="sharded"`` carries its outputs as ``"auto"`` does (plain
   shards would enter the next graph as if whole), and its report says so.
1. Boundaries (with ``boundaries=True``): masks that crossed from another graph as their per-token description
   become the tensors that describe them (`crossing_masks.rebuild_mask_inputs`), `SequenceSharded` inputs are taken
   as this rank's tokens (`carried.take_carried_inputs`), and masks the graph returns are described
   (`crossing_masks.describe_mask_outputs`). A converted model is one graph called with whole tensors: none.
2. The pipeline (`ringpass.passes.run_pipeline`), which rewrites ``ctx.gm`` or records why not in ``ctx.report``.
3. A retrace where the pipeline asks for one (`ringpass.frontend.retrace`; the caller lets the exception through to
   Dynamo): ``inputs="sharded"`` under static shapes (`StaticShardedLengths`) has the frame traced again with the
   sequence dims dynamic; dynamic shapes where part of the graph runs at its traced sizes only (`NeedsStaticShapes`:
   a chunked scan) have it traced again static, and the next graph's report says so. Where a retrace cannot help, the
   refusal is written into the report and raised.
The dim marks a retrace added are released once a graph got through (`retrace.release_marks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from lowering import compat
from lowering.errors import NotSupportedError
from ringpass.frontend.carried import take_carried_inputs
from ringpass.frontend.crossing_masks import describe_mask_outputs, rebuild_mask_inputs
from ringpass.frontend.retrace import release_marks, request_retrace, request_static_retrace, take_retrace_note
from ringpass.fx.context import PassContext
from ringpass.fx.static_shapes import NeedsStaticShapes
from ringpass.passes import run_pipeline
from ringpass.passes.sharded_lengths import StaticShardedLengths


class Retrace(Exception):
    """Raised by `rewrite_graph` around the exception Dynamo restarts on (``restart``): the caller drops what it
    recorded of this graph and raises ``restart`` from its Dynamo backend."""

    def __init__(self, restart: BaseException):
        super().__init__("ringpass: Dynamo traces the frame again")
        self.restart = restart


def rewrite_graph(
    ctx: PassContext,
    boundaries: bool = True,
    before_passes: Callable[[PassContext], None] | None = None,
    static_retrace: bool = True,
) -> None:
    """Runs the protocol (module docstring) on ``ctx``: `Retrace` when Dynamo must trace again, a `RingpassError`
    when the graph is refused (also in ``ctx.report``), else ``ctx.gm`` rewritten (or recorded as left unchanged).
    ``before_passes`` reads the graph as the boundaries left it, before the pipeline (inspect: its outputs' sizes).
    ``static_retrace=False``: `NeedsStaticShapes` is the refusal (a conversion asked for dynamic shapes gets none)."""
    retrace = None
    note = take_retrace_note()
    if note is not None:
        ctx.report.notes.append(note)
    if ctx.options.outputs == "sharded" and compat.ends_at_graph_break(ctx.gm):  # plain shards would enter the next
        ctx.options = replace(ctx.options, outputs="auto")  # graph as if whole: a wrong answer where it has no ring
        ctx.report.notes.append(
            "ends at a graph break: its outputs are carried into the code after it as outputs='auto' carries them "
            "(outputs='sharded' gives plain shards where the model returns)"
        )
    try:
        if boundaries:
            rebuild_mask_inputs(ctx)
            take_carried_inputs(ctx)
            describe_mask_outputs(ctx)
        if before_passes is not None:
            before_passes(ctx)
        try:
            run_pipeline(ctx)
        except (StaticShardedLengths, NeedsStaticShapes) as error:
            if isinstance(error, StaticShardedLengths):
                retrace = request_retrace(error)
            elif static_retrace:
                retrace = request_static_retrace(error)
            if retrace is None:
                ctx.report.refusal.message = str(error)
                if isinstance(error, NeedsStaticShapes):  # a refusal, as the user reads it
                    raise NotSupportedError(*error.args) from None
                raise
            raise Retrace(retrace) from None
    finally:
        if retrace is None:
            release_marks()
